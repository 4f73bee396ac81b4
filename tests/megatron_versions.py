"""Run the Megatron integration's CPU cases against other megatron-core releases (a developer tool).

    python3 tests/megatron_versions.py 0.16.1 0.17.1 0.18.2

For each release: `pip install --no-deps --ignore-requires-python --target DIR megatron-core==V`
(once; DIR under $EP_MEGATRON_VERSIONS_DIR, default /tmp/ep_plugin_megatron_versions), then a child
process with DIR first on PYTHONPATH runs the cases of tests/megatron_cases.py that need only
megatron-core on 2 ranks (EP 2), plus the Megatron-LM command-line case where the wheel ships
megatron.training (0.17 on), and prints one line per case. CI tests the installed (newest) release
only; this script checks the supported range by hand. Exit status 1 if any case failed.
"""
from __future__ import annotations

import os
import subprocess
import sys
import traceback

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
CASES = ("dropless", "router_probs_grad", "capacity", "drop_and_pad", "drop_and_pad_many_experts",
         "router_padding", "moe_layer_vs_dense", "moe_layer_one_ep_rank_idle", "registration")


def version_worker(rank: int, world: int, group, seed: int, cases):
    """One rank: the given cases; case -> None or the failure's traceback."""
    import torch.distributed as dist
    import megatron_cases

    ctx = megatron_cases.Ctx(rank, world, seed, 1)
    results = {}
    for name in cases:
        try:
            getattr(megatron_cases, f"case_{name}")(ctx)
            results[name] = None
        except Exception:  # noqa: BLE001 - reported per case
            results[name] = traceback.format_exc()
        dist.barrier()
    return results


def _child(seed: int, with_cli: bool) -> int:
    from importlib.metadata import version

    import megatron_env  # this file's directory is first on sys.path (run as a script)

    print(f"megatron-core {version('megatron-core')}", flush=True)
    cases = CASES + (("cli",) if with_cli else ())
    results = megatron_env.cpu_launch(2, version_worker, seed, cases, timeout_s=300)
    failed = 0
    for name in cases:
        errors = [result[name] for result in results if result[name]]
        failed += bool(errors)
        print(f"  {name}: {'FAILED' if errors else 'ok'}")
        if errors:
            print(errors[0])
    return 1 if failed else 0


def main(argv) -> int:
    if len(argv) >= 3 and argv[0] == "--child":
        return _child(int(argv[1]), argv[2] == "cli")
    root = os.environ.get("EP_MEGATRON_VERSIONS_DIR", "/tmp/ep_plugin_megatron_versions")
    status = 0
    for release in argv or ["0.16.1", "0.17.1", "0.18.2"]:
        target = os.path.join(root, release)
        if not os.path.isdir(os.path.join(target, "megatron", "core")):
            subprocess.run([sys.executable, "-m", "pip", "install", "-qq", "--no-deps", "--ignore-requires-python",
                            "--target", target, f"megatron-core=={release}"], check=True)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([target, TESTS_DIR, os.environ.get("PYTHONPATH", "")]))
        with_cli = "cli" if os.path.isdir(os.path.join(target, "megatron", "training")) else "no-cli"
        done = subprocess.run([sys.executable, "-W", "ignore", os.path.abspath(__file__), "--child", "7", with_cli],
                              env=env)
        status |= done.returncode
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
