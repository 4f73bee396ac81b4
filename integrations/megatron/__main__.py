"""`python -m ep_plugin.integrations.megatron SCRIPT [ARGS...]`: register, then run SCRIPT as __main__.

Lets an unmodified Megatron-LM script (pretrain_gpt.py, ...) accept
`--moe-token-dispatcher-type ep_plugin` and `--ep-plugin-config FILE`; works under torchrun
(`torchrun ... -m ep_plugin.integrations.megatron pretrain_gpt.py ...`).
"""
import os
import runpy
import sys


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__.strip())
        sys.exit(0 if len(sys.argv) >= 2 else 2)
    from ep_plugin.integrations import megatron

    megatron.register()
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
