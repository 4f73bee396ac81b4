"""The `ep-plugin` command: `bench` (the main job) and `config check`."""
from __future__ import annotations

import argparse
import shlex
import sys
from typing import Dict, List, Optional


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
        raise SystemExit(f"--sweep expects KEY=V1,V2,... with KEY one of {', '.join(allowed)} (or sms, tokens); got {text!r}")
    try:
        return {key: [int(v) for v in values.split(",") if v.strip()]}
    except ValueError:
        raise SystemExit(f"--sweep values must be integers, got {values!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ep-plugin", description="ep_plugin: expert-parallel dispatch/combine")
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
    bench.add_argument("--num-sms", type=int, default=None, help="SMs for normal-mode kernels")
    bench.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16", help="dispatch payload")
    bench.add_argument("--warmup", type=int, default=5)
    bench.add_argument("--iters", type=int, default=30)
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--gpu-lead-us", type=float, default=0.0,
                       help="queue a GPU sleep of this many us before each timed call, so that the host runs ahead "
                            "and the CUDA events time the GPU alone (default 0: DeepEP's method)")
    bench.add_argument("--sweep", default=None, help="e.g. num_sms=8,16,24 or tokens=128,1024")
    bench.add_argument("--no-baseline", action="store_true", help="skip timing the reference backend")
    bench.add_argument("--no-check", action="store_true", help="skip the check against the reference backend")
    bench.add_argument("--out", default=None, help="write the results and configuration as JSON")
    bench.add_argument("--plot", default=None, help="write a PNG plot (matplotlib)")

    config = sub.add_parser("config", help="configuration tools")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    check = config_sub.add_parser("check", help="validate a YAML config and print it with its environment")
    check.add_argument("file")
    check.add_argument("--low-latency", action="store_true", default=None,
                       help="show the environment for low-latency mode (default: the file's mode)")
    return parser


def _bench(args: argparse.Namespace, argv: List[str]) -> int:
    from .bench import BenchSettings, main_bench
    from .config import load_config

    mode = args.mode or load_config(args.config).mode
    settings = BenchSettings(mode=mode, backend=args.backend, config_path=args.config, num_ranks=args.ranks,
                             num_tokens=args.tokens, hidden=args.hidden, num_topk=args.topk,
                             num_experts=args.experts, num_sms=args.num_sms, dtype=args.dtype,
                             warmup=args.warmup, iters=args.iters, seed=args.seed, gpu_lead_us=args.gpu_lead_us,
                             baseline=not args.no_baseline,
                             check=not args.no_check, sweep=_parse_sweep(args.sweep),
                             command="ep-plugin " + " ".join(shlex.quote(a) for a in argv))
    return main_bench(settings, args.out, args.plot)


def _config_check(args: argparse.Namespace) -> int:
    from .config import ConfigError, load_config
    from .environment import describe_config

    try:
        cfg = load_config(args.file)
    except ConfigError as error:
        print(f"invalid: {error}", file=sys.stderr)
        return 2
    low_latency = args.low_latency if args.low_latency is not None else cfg.mode == "low_latency"
    print(describe_config(cfg, low_latency_mode=low_latency))
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        return _bench(args, argv)
    return _config_check(args)


if __name__ == "__main__":
    sys.exit(main())
