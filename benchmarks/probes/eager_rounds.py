"""A DeepEP program's eager MoE step, round after round: ep_plugin's and DeepEP V1's, in the same processes.

Each round is what a DeepEP program calls per layer without the experts: `get_dispatch_layout`, `dispatch` (with
notify and the host's wait for the count) and `combine` of the dispatched rows, back to back, with an explicit
`Config(num_sms, DeepEP's NVL chunk, 256)` on every call and torch's default device and dtype set, as DeepEP
programs do. Such a loop is bound by the host and by each call's GPU latency, not by the links: it shows what
`ep-plugin bench --style deepep` times per call as one number a program feels, the round's wall time.

The libraries take turns, one block of rounds each (`--blocks` pairs): the host's speed drifts by up to 1.5x
between blocks on a shared machine, so compare the two blocks of one pair. Per block and rank: the round's wall
time (p10, p50, p90, from one round's start to the next) and each call's host time (p50). Where `deep_ep` is not
importable, ep_plugin runs alone; `--libraries` names them (one alone: each in a launch of its own).
`--dispatch-only`: a round is one dispatch with notify (the layout made once, each dispatch's outputs dropped),
as a loop of dispatches alone runs them: the dispatch's latency from call to call, notify's wait included.

    python3 benchmarks/probes/eager_rounds.py [--tokens 128] [--rounds 300] [--blocks 3]
        [--default-configs] [--no-global-defaults] [--libraries ep_plugin,deep_ep] [--dispatch-only]
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import time
from typing import Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

from ep_plugin.bench import explicit_configs, random_routing
from ep_plugin.launch import parallel_launch, rank_device

HIDDEN, EXPERTS, TOPK, NUM_SMS = 7168, 256, 8, 24
WARMUP_ROUNDS = 30
CALLS = ("layout", "dispatch", "combine")
DISPATCH_ONLY = ("dispatch",)
LIBRARIES = ("ep_plugin", "deep_ep")


class Step:
    """One library's buffer and the inputs of its rounds."""

    def __init__(self, lib, group, x: torch.Tensor, topk_idx: torch.Tensor, weights: torch.Tensor,
                 explicit: bool) -> None:
        R = group.size()
        lib.Buffer.set_num_sms(NUM_SMS)
        configs = explicit_configs(lib.Config, argparse.Namespace(num_sms=NUM_SMS), R)
        # Sized as a DeepEP program sizes it: the largest hint of the configs it may pass.
        hints = list(configs) + [lib.Buffer.get_dispatch_config(R), lib.Buffer.get_combine_config(R)]
        num_nvl_bytes = max(config.get_nvl_buffer_size_hint(HIDDEN * 2, R) for config in hints)
        self.buffer = lib.Buffer(group, num_nvl_bytes, 0, explicitly_destroy=True)
        self.dispatch_config, self.combine_config = configs if explicit else (None, None)
        self.x, self.topk_idx, self.weights = x, topk_idx, weights

    def rounds(self, count: int) -> List[Tuple[float, float, float, float]]:
        """`count` rounds; per round the host clock at its start and after each call (s)."""
        clock, buffer, stamps = time.perf_counter, self.buffer, []
        for _ in range(count):
            start = clock()
            per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(self.topk_idx, EXPERTS)
            laid_out = clock()
            recv_x, _, recv_weights, _, handle, _ = buffer.dispatch(
                self.x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=self.topk_idx, topk_weights=self.weights, config=self.dispatch_config)
            dispatched = clock()
            buffer.combine(recv_x, handle, topk_weights=recv_weights, config=self.combine_config)
            stamps.append((start, laid_out, dispatched, clock()))
        return stamps

    def dispatch_rounds(self, count: int) -> List[Tuple[float, float]]:
        """`count` dispatches with notify, one per round, on one layout; per round the host clock at its start
        and after the dispatch (s)."""
        per_rank, _, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(self.topk_idx, EXPERTS)
        clock, buffer, stamps = time.perf_counter, self.buffer, []
        for _ in range(count):
            start = clock()
            buffer.dispatch(self.x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                            num_tokens_per_expert=per_expert, topk_idx=self.topk_idx, topk_weights=self.weights,
                            config=self.dispatch_config)
            stamps.append((start, clock()))
        return stamps


def round_stats(stamps: Sequence[Tuple[float, ...]], calls: Sequence[str] = CALLS) -> Dict[str, float]:
    """Wall time per round (us: p10, p50, p90, from one round's start to the next) and each call's host p50
    (`calls`: the calls of a round, in order)."""
    def quantile(values: List[float], q: float) -> float:
        return values[round(q * (len(values) - 1))]

    walls = sorted((later[0] - earlier[0]) * 1e6 for earlier, later in zip(stamps, stamps[1:]))
    stats = {"p10": quantile(walls, 0.1), "p50": quantile(walls, 0.5), "p90": quantile(walls, 0.9)}
    for i, call in enumerate(calls):
        stats[call] = quantile(sorted((s[i + 1] - s[i]) * 1e6 for s in stamps), 0.5)
    return stats


def format_stats(name: str, block: int, stats: Dict[str, float], calls: Sequence[str] = CALLS) -> str:
    host = " ".join(f"{call} {stats[call]:6.1f}" for call in calls)
    return (f"{name:9} block {block}: round p10 {stats['p10']:6.1f} p50 {stats['p50']:6.1f} p90 {stats['p90']:6.1f}"
            f" us | host p50: {host}")


def step_inputs(rank: int, tokens: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A rank's tokens (bf16), top-k expert ids and weights on its GPU, seeded by the rank."""
    device = rank_device(rank)
    generator = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(tokens, HIDDEN, generator=generator).to(torch.bfloat16).to(device)
    topk_idx = random_routing(tokens, EXPERTS, TOPK, device, generator)
    weights = torch.rand(tokens, TOPK, generator=generator).to(device)
    return x, topk_idx, weights


def probe_rank(rank: int, world_size: int, group, libraries: Sequence[str], tokens: int, rounds: int, blocks: int,
               explicit: bool, global_defaults: bool, dispatch_only: bool = False) -> List[str]:
    device = rank_device(rank)
    inputs = step_inputs(rank, tokens)
    steps = {name: Step(importlib.import_module(name), group, *inputs, explicit) for name in libraries}
    saved_dtype = torch.get_default_dtype()
    if global_defaults:
        torch.set_default_device(device)
        torch.set_default_dtype(torch.bfloat16)
    calls = DISPATCH_ONLY if dispatch_only else CALLS
    lines = []
    try:
        for block in range(blocks):
            for name, step in steps.items():
                run = step.dispatch_rounds if dispatch_only else step.rounds
                run(WARMUP_ROUNDS)
                torch.cuda.synchronize()
                dist.barrier(group=group)
                stamps = run(rounds)
                torch.cuda.synchronize()
                lines.append(format_stats(name, block, round_stats(stamps, calls), calls))
    finally:
        torch.set_default_device(None)
        torch.set_default_dtype(saved_dtype)
    for step in steps.values():
        step.buffer.destroy()
    return lines


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128, help="tokens per rank")
    parser.add_argument("--rounds", type=int, default=300, help="timed rounds per block")
    parser.add_argument("--blocks", type=int, default=3, help="blocks per library, taken in turns")
    parser.add_argument("--default-configs", action="store_true",
                        help="no Config on the calls (each library's own defaults)")
    parser.add_argument("--no-global-defaults", action="store_true",
                        help="leave torch's default device and dtype alone")
    parser.add_argument("--dispatch-only", action="store_true",
                        help="a round is one dispatch with notify, on one layout")
    parser.add_argument("--libraries", default=None,
                        help="comma list of ep_plugin and deep_ep (default: both where deep_ep is importable)")
    args = parser.parse_args(argv)
    if args.rounds < 2 or args.blocks < 1:
        parser.error("--rounds must be at least 2 and --blocks at least 1")
    if args.libraries is None:
        args.libraries = ["ep_plugin"] + (["deep_ep"] if importlib.util.find_spec("deep_ep") is not None else [])
    else:
        args.libraries = args.libraries.split(",")
        unknown = sorted(set(args.libraries) - set(LIBRARIES))
        if unknown or not args.libraries:
            parser.error(f"--libraries: {', '.join(unknown) or 'none given'}; choose from {', '.join(LIBRARIES)}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    style = ("default Configs" if args.default_configs else "explicit Configs") + (
        "" if args.no_global_defaults else ", global default device and dtype")
    steps = "dispatch" if args.dispatch_only else "layout, dispatch, combine"
    print(f"eager rounds ({steps}) on 2 ranks, {args.tokens} tokens x {HIDDEN}, top-{TOPK} of "
          f"{EXPERTS} experts, {NUM_SMS} SMs, {style}; {args.blocks} blocks of {args.rounds} rounds", flush=True)
    results = parallel_launch(2, probe_rank, args.libraries, args.tokens, args.rounds, args.blocks,
                              not args.default_configs, not args.no_global_defaults, args.dispatch_only,
                              timeout_s=300)
    for rank, lines in enumerate(results):
        print(f"rank {rank}")
        print("\n".join(f"  {line}" for line in lines), flush=True)


if __name__ == "__main__":
    main()
