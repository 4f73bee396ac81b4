"""The `ep-plugin` command: `bench` (the main job), `info` and `config check`.

Bad arguments end with one line that names the argument and says what to do, and exit code 2;
a failure during a run ends with one line and exit code 1. `--debug` keeps the tracebacks.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from typing import Dict, List, Optional

PROG = "ep-plugin"


class UsageError(ValueError):
    """A bad argument: one line that names it and says what to do (exit code 2)."""


def _parse_sweep(text: Optional[str]) -> Dict[str, List[int]]:
    """`num_sms=8,16,24` -> {"num_sms": [8, 16, 24]}."""
    if not text:
        return {}
    allowed = ("num_sms", "num_tokens", "hidden", "num_topk", "num_experts")
    key, _, values = text.partition("=")
    key = key.strip().replace("-", "_")
    if key in ("sms", "tokens"):
        key = "num_" + key
    if key not in allowed or not values:
        raise UsageError(f"--sweep {text}: expects KEY=V1,V2,... with KEY one of {', '.join(allowed)} "
                         "(or sms, tokens)")
    try:
        return {key: [int(v) for v in values.split(",") if v.strip()]}
    except ValueError:
        raise UsageError(f"--sweep {text}: the values must be integers, e.g. --sweep sms=8,16,24") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="ep_plugin: expert-parallel dispatch/combine")
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="run dispatch + combine on random routing, verified and timed")
    bench.add_argument("--config", help="YAML config (default: $EP_PLUGIN_CONFIG or built-in defaults)")
    bench.add_argument("--backend", choices=("auto", "native", "reference"), default=None,
                       help="default: the config's backend (auto unless the file says otherwise)")
    bench.add_argument("--mode", choices=("normal", "low_latency"), default=None,
                       help="default: the config's mode")
    bench.add_argument("--ranks", type=int, default=None, help="processes (default: one per GPU, or 2 on CPU)")
    bench.add_argument("--tokens", type=int, default=None, help="tokens per rank")
    bench.add_argument("--hidden", type=int, default=None)
    bench.add_argument("--topk", type=int, default=None)
    bench.add_argument("--experts", type=int, default=None)
    bench.add_argument("--num-sms", type=int, default=None, help="SMs for normal-mode kernels (default: the config's)")
    bench.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16", help="dispatch payload")
    bench.add_argument("--warmup", type=int, default=5)
    bench.add_argument("--iters", type=int, default=30)
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--gpu-lead-us", type=float, default=0.0,
                       help="queue a GPU sleep of this many us before each timed call, so that the host runs ahead "
                            "and the CUDA events time the GPU alone (default 0: DeepEP's method)")
    bench.add_argument("--baseline", choices=("auto", "deepep", "reference", "none"), default="auto",
                       help="timed beside ep_plugin in the same run: auto (default) = the reference backend, and "
                            "DeepEP V1 where `deep_ep` is importable; deepep = both, DeepEP required; "
                            "reference; none")
    bench.add_argument("--no-baseline", action="store_true", help="the same as --baseline none")
    bench.add_argument("--style", default=None,
                       help="call as a DeepEP program does: deepep (every condition; col_scales with FP8 only), "
                            "or a comma list of col_scales, explicit_config, combine_after_dispatch, back_to_back, "
                            "default_device, default_dtype (default: plain)")
    bench.add_argument("--sweep", default=None, help="e.g. num_sms=8,16,24 or tokens=128,1024")
    bench.add_argument("--no-check", action="store_true", help="skip the check against the reference backend")
    bench.add_argument("--out", default=None, help="write the results and configuration as JSON")
    bench.add_argument("--plot", default=None, help="write a PNG plot (matplotlib)")
    bench.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")

    sub.add_parser("info", help="version, native extensions built or not (and why), GPUs, DeepEP V1 importable")

    config = sub.add_parser("config", help="configuration tools")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    check = config_sub.add_parser("check", help="validate a YAML config and print it with its environment")
    check.add_argument("file")
    check.add_argument("--low-latency", action="store_true", default=None,
                       help="show the environment for low-latency mode (default: the file's mode)")
    return parser


def _bench(args: argparse.Namespace, argv: List[str]) -> int:
    from .bench import BenchSettings, main_bench, parse_style, resolve_baselines
    from .config import load_config

    mode = args.mode or load_config(args.config).mode
    settings = BenchSettings(mode=mode, backend=args.backend or load_config(args.config).backend,
                             config_path=args.config, num_ranks=args.ranks,
                             num_tokens=args.tokens, hidden=args.hidden, num_topk=args.topk,
                             num_experts=args.experts, num_sms=args.num_sms, dtype=args.dtype,
                             warmup=args.warmup, iters=args.iters, seed=args.seed, gpu_lead_us=args.gpu_lead_us,
                             baselines=resolve_baselines("none" if args.no_baseline else args.baseline),
                             peer_required=not args.no_baseline and args.baseline == "deepep",
                             check=not args.no_check, style=parse_style(args.style, mode, args.dtype),
                             sweep=_parse_sweep(args.sweep),
                             command=f"{PROG} " + " ".join(shlex.quote(a) for a in argv))
    return main_bench(settings, args.out, args.plot)


def _info() -> int:
    import importlib.util
    import os

    import torch

    import ep_plugin
    from .bench import built_extensions, peer_importable

    print(f"ep_plugin {ep_plugin.__version__} at {os.path.dirname(ep_plugin.__file__)}")
    for name, state in built_extensions().items():
        print(f"  ep_plugin.{name}: {state}")
    if any(state.startswith("not built") for state in built_extensions().values()):
        print("  (a build says what it skipped and why: pip install -v . | grep 'ep_plugin:')")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    print(f"  torch {torch.__version__}, {gpus} GPU(s)" + (f": {torch.cuda.get_device_name(0)}" if gpus else ""))
    print(f"  DeepEP V1 (deep_ep) for --baseline deepep: {'importable' if peer_importable() else 'not importable'}")
    bars = "tqdm" if importlib.util.find_spec("tqdm") else "plain lines (pip install tqdm for bars)"
    print(f"  progress bars: {bars}")
    return 0


def _config_check(args: argparse.Namespace) -> int:
    from .config import load_config
    from .environment import describe_config

    cfg = load_config(args.file)
    low_latency = args.low_latency if args.low_latency is not None else cfg.mode == "low_latency"
    print(describe_config(cfg, low_latency_mode=low_latency))
    print(f"ok: {args.file}")
    return 0


def _run(args: argparse.Namespace, argv: List[str]) -> int:
    if args.command == "bench":
        return _bench(args, argv)
    if args.command == "info":
        return _info()
    return _config_check(args)


def main(argv: Optional[List[str]] = None) -> int:
    """Run the command; returns the exit code (0 ok, 1 a failed run, 2 a bad argument or config)."""
    from .bench import OutOfMemory
    from .config import ConfigError

    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    where = f"{PROG} {args.command}"
    try:
        return _run(args, argv)
    except (UsageError, ConfigError) as error:
        if getattr(args, "debug", False):
            raise
        prefix = "invalid: " if isinstance(error, ConfigError) else "error: "
        print(f"{where}: {prefix}{error}", file=sys.stderr)
        return 2
    except OutOfMemory as error:
        if getattr(args, "debug", False):
            raise
        print(f"{where}: {error}", file=sys.stderr)
        return 1
    except Exception as error:  # noqa: BLE001 - one line unless --debug
        if getattr(args, "debug", False):
            raise
        first = str(error).splitlines()[0] if str(error) else ""
        print(f"{where}: failed: {type(error).__name__}: {first} (--debug shows the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
