"""Where the host's time goes in one normal-mode round: per-call host time and a Python profile.

Each rank runs rounds of layout -> dispatch -> cached dispatch -> combine. First the host time of each
call (perf_counter, no profiler; medians over `--iters` rounds), then the same rounds under cProfile:
rank 0 prints its functions by own time and by cumulative time. A call whose host time passes its GPU
time leaves the GPU idle at small batches; this says which Python or C++ entry the time is spent in.

    python3 benchmarks/profile_host.py --tokens 128 --iters 200      # GPU machine, one rank per GPU
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from typing import Callable, Dict, List

import torch

from ep_plugin import Buffer
from ep_plugin.bench import random_routing
from ep_plugin.launch import parallel_launch, rank_device


def _round_steps(buffer: Buffer, x, topk_idx, weights, num_experts: int) -> Dict[str, Callable[[], None]]:
    """The round's calls in order; each step keeps what the next needs in `state`."""
    state = {}

    def layout():
        state["layout"] = buffer.get_dispatch_layout(topk_idx, num_experts)

    def dispatch():
        lay = state["layout"]
        recv_x, _, recv_weights, _, handle, _ = buffer.dispatch(
            x, num_tokens_per_rank=lay[0], is_token_in_rank=lay[3], num_tokens_per_expert=lay[2],
            topk_idx=topk_idx, topk_weights=weights)
        state.update(recv_x=recv_x, recv_weights=recv_weights, handle=handle)

    def cached_dispatch():
        buffer.dispatch(x, handle=state["handle"])

    def combine():
        buffer.combine(state["recv_x"], state["handle"], topk_weights=state["recv_weights"])

    return {"layout": layout, "dispatch": dispatch, "cached_dispatch": cached_dispatch, "combine": combine}


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _host_times(steps: Dict[str, Callable[[], None]], iters: int) -> Dict[str, float]:
    times: Dict[str, List[float]] = {name: [] for name in steps}
    for _ in range(iters):
        for name, step in steps.items():
            begin = time.perf_counter()
            step()
            times[name].append((time.perf_counter() - begin) * 1e6)
        _synchronize()  # the GPU is not let fall behind by more than one round
    return {name: statistics.median(t) for name, t in times.items()}


def _profile(steps: Dict[str, Callable[[], None]], iters: int, top: int) -> str:
    profiler = cProfile.Profile()
    for _ in range(iters):
        profiler.enable()
        for step in steps.values():
            step()
        profiler.disable()
        _synchronize()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    text.write(f"---- by own time ({iters} rounds; times are totals over the rounds)\n")
    stats.sort_stats("tottime").print_stats(top)
    text.write(f"---- by cumulative time ({iters} rounds)\n")
    stats.sort_stats("cumulative").print_stats(top)
    return text.getvalue()


def profile_rank(rank: int, world_size: int, group, args: argparse.Namespace) -> Dict:
    device = rank_device(rank)
    buffer = Buffer(group, num_nvl_bytes=args.nvl_bytes, explicitly_destroy=True)
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(args.tokens, args.hidden, generator=generator).to(torch.bfloat16).to(device)
    topk_idx = random_routing(args.tokens, args.experts, args.topk, device, generator)
    weights = torch.rand(args.tokens, args.topk, generator=generator).to(device)
    steps = _round_steps(buffer, x, topk_idx, weights, args.experts)
    _host_times(steps, 10)  # warm-up
    host = _host_times(steps, args.iters)
    report = _profile(steps, args.iters, args.top)  # on every rank: each round waits for the peers
    buffer.destroy()
    return {"rank": rank, "host_us": host, "profile": report if rank == 0 else ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=None, help="default: one per GPU")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--top", type=int, default=30, help="functions listed per table")
    parser.add_argument("--nvl-bytes", type=int, default=1 << 30)
    args = parser.parse_args()
    ranks = args.ranks or max(2, torch.cuda.device_count())
    results = parallel_launch(ranks, profile_rank, args, timeout_s=600.0)
    print(f"host us per call (median of {args.iters} rounds; {args.tokens} tokens x {args.hidden}, "
          f"top-{args.topk} of {args.experts} experts, {ranks} ranks)")
    for r in results:
        print(f"rank {r['rank']}: " + ", ".join(f"{k} {v:.1f}" for k, v in r["host_us"].items()))
    print(results[0]["profile"])


if __name__ == "__main__":
    main()
