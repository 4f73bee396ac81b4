"""The Python host cost of eager calls, on a machine without a GPU: a real `ep_plugin.Buffer` over the native
backend whose kernels are replaced by stand-ins that accept the same calls and do nothing.

What it measures: everything a user's eager `low_latency_dispatch`, `low_latency_combine`,
`get_dispatch_layout` and normal-mode `dispatch` (with notify, and cached) and `combine` run in Python
on the way to the kernel launch: Buffer's argument checks and wrappers, the backend's output
allocations (torch.empty on the CPU; at 2 ranks the normal-mode dispatch's outputs come from the
output region, here in host memory), its Args structs (the real pybind ones), handle objects. And,
for the dispatch with notify, the part of it on the GPU's critical path: the host's time from the
received count's arrival (the stand-in `wait_notify` returning) to the dispatch kernel's launch, while
the GPU idles. Two spawned ranks over gloo (a group of 2: 2 ranks' shapes); rank 0 times, rank 1
waits. Prints the median host time per call and rank 0's cProfiles, top functions by own time.

What it cannot measure: the native runtime's own host time (the pybind call into C++ and the CUDA
launch, and `wait_notify`'s conversion of its counts into Python lists, one int per local expert;
here a Python no-op), torch.empty through the CUDA caching allocator (here the CPU allocator,
with glibc's mmap threshold raised so that the 235 MB recv_x is not an mmap + munmap per call, as it is
not on a GPU), the current-stream lookup (here a stand-in returning 0), and Buffer's device and stream
handling, which on CPU is skipped (`Buffer._run` with no communication stream); nor how much slower
the GPU machine's CPU runs the same Python. benchmarks/profile_host.py --eager measures the whole on GPUs.
It times the checkout it sits in: to compare revisions, run it on each.

    python3 benchmarks/probes/host_overhead.py --iters 2000
    python3 benchmarks/probes/host_overhead.py --only normal   # the normal-mode calls alone
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: the repository's ep_plugin first (spawned ranks too)
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the stand-in kernels (tests/stand_in_native.py)
# Read by each spawned rank's allocator at start-up (see the docstring).
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 32))
os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(1 << 36))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from ep_plugin import Buffer  # noqa: E402
from ep_plugin.bench import random_routing  # noqa: E402
from ep_plugin.launch import parallel_launch  # noqa: E402
from stand_in_native import StandInLowLatencyRuntime, stand_in_kernels  # noqa: E402

# The rows of the host's stretches inside `dispatch (notify)`: before notify's launch, and from the count's
# arrival to the dispatch's launch (the GPU idles through both in eager use).
TO_NOTIFY = "  call -> notify launch"
WAIT_TO_LAUNCH = "  wait -> dispatch launch"


def _median_us(step: Callable[[], object], iters: int) -> float:
    for _ in range(iters // 10):  # warm-up
        step()
    times = []
    for _ in range(iters):
        begin = time.perf_counter()
        step()
        times.append((time.perf_counter() - begin) * 1e6)
    return statistics.median(times)


def _median_gaps_us(step: Callable[[], object], runtime, iters: int) -> Dict[str, float]:
    """Median host time from the call to notify's launch, and from `runtime.wait_notify`'s return to the
    dispatch's launch, over calls of `step`."""
    for _ in range(iters // 10):
        step()
    to_notify, wait_to_launch = [], []
    for _ in range(iters):
        begin = time.perf_counter()
        step()
        to_notify.append((runtime.notified_at - begin) * 1e6)
        wait_to_launch.append((runtime.launched_at - runtime.wait_returned_at) * 1e6)
    return {TO_NOTIFY: statistics.median(to_notify), WAIT_TO_LAUNCH: statistics.median(wait_to_launch)}


def _profile(name: str, step: Callable[[], object], iters: int, top: int) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(iters):
        step()
    profiler.disable()
    text = io.StringIO()
    text.write(f"---- {name}, by own time ({iters} calls; times are totals)\n")
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def _normal_steps(normal: Buffer, args: argparse.Namespace) -> Dict[str, Callable[[], object]]:
    """Normal-mode calls as DeepEP programs make them (layout, then dispatch with notify; cached dispatch;
    combine with weights), BF16, on fresh random inputs (CPU)."""
    generator = torch.Generator().manual_seed(1)
    T = args.normal_tokens
    x = torch.randn(T, args.hidden, generator=generator, dtype=torch.float32).to(torch.bfloat16)
    topk_idx = random_routing(T, args.experts, args.topk, "cpu", generator)
    weights = torch.rand(T, args.topk, generator=generator, dtype=torch.float32)
    per_rank, _, per_expert, in_rank, _ = normal.get_dispatch_layout(topk_idx, args.experts)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    recv_x, _, recv_weights, _, handle, _ = normal.dispatch(x, topk_idx=topk_idx, topk_weights=weights, **layout)
    expert_out = torch.randn(recv_x.shape, generator=generator, dtype=torch.float32).to(torch.bfloat16)
    return {"dispatch (notify)": lambda: normal.dispatch(x, topk_idx=topk_idx, topk_weights=weights, **layout),
            "cached dispatch": lambda: normal.dispatch(x, handle=handle),
            "combine": lambda: normal.combine(expert_out, handle, recv_weights)}


def _steps(ll: Buffer, normal: Buffer, args: argparse.Namespace) -> Dict[str, Callable[[], object]]:
    """The timed low-latency calls and the layout, on fresh random inputs (CPU)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(args.tokens, args.hidden, generator=generator, dtype=torch.float32).to(torch.bfloat16)
    topk_idx = random_routing(args.tokens, args.experts, args.topk, "cpu", generator)
    weights = torch.rand(args.tokens, args.topk, generator=generator, dtype=torch.float32)
    recv_x, _, handle, _, _ = ll.low_latency_dispatch(x, topk_idx, args.tokens, args.experts, use_fp8=True)
    expert_out = torch.randn(recv_x[0].shape, generator=generator, dtype=torch.float32).to(torch.bfloat16)

    def pair():
        pair_handle = ll.low_latency_dispatch(x, topk_idx, args.tokens, args.experts, use_fp8=True)[2]
        ll.low_latency_combine(expert_out, topk_idx, weights, pair_handle)

    return {"low_latency_dispatch": lambda: ll.low_latency_dispatch(x, topk_idx, args.tokens, args.experts,
                                                                    use_fp8=True),
            "low_latency_combine": lambda: ll.low_latency_combine(expert_out, topk_idx, weights, handle),
            "ll pair": pair,
            "get_dispatch_layout": lambda: normal.get_dispatch_layout(topk_idx, args.experts)}


def _timings(steps: Dict[str, Callable[[], object]], runtime, iters: int) -> Dict[str, float]:
    """Median us per call of each step; after the dispatch with notify, the gap inside it."""
    result = {}
    for name, step in steps.items():
        result[name] = _median_us(step, iters)
        if name == "dispatch (notify)":
            result.update(_median_gaps_us(step, runtime, iters))
    return result


def probe_rank(rank: int, world_size: int, group, args: argparse.Namespace) -> Dict:
    with stand_in_kernels(StandInLowLatencyRuntime()):
        rdma = Buffer.get_low_latency_rdma_size_hint(args.tokens, args.hidden, world_size, args.experts)
        ll = Buffer(group, 0, rdma, low_latency_mode=True, explicitly_destroy=True)
        normal = Buffer(group, 1 << 30, 0, explicitly_destroy=True)
        assert ll.backend_name == normal.backend_name == "native"
        result: Dict = {}
        if rank == 0:
            steps = {} if args.only == "normal" else _steps(ll, normal, args)
            if args.only != "low_latency":
                steps.update(_normal_steps(normal, args))
            runtime = normal._backend._runtime
            result["plain"] = _timings(steps, runtime, args.iters)
            result["profile"] = "".join(_profile(name, steps[name], args.iters, args.top)
                                        for name in ("ll pair", "dispatch (notify)") if name in steps)
            # As DeepEP programs often run: torch's default device and dtype set globally.
            torch.set_default_device("cpu")
            torch.set_default_dtype(torch.bfloat16)
            result["global defaults"] = _timings(steps, runtime, args.iters)
            torch.set_default_device(None)
            torch.set_default_dtype(torch.float32)
        dist.barrier(group=group)
        ll.destroy()
        normal.destroy()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--normal-tokens", type=int, default=4096, help="tokens per rank of the normal-mode calls")
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--only", choices=("low_latency", "normal"), help="time only these calls")
    parser.add_argument("--top", type=int, default=20, help="functions listed")
    args = parser.parse_args()
    result = parallel_launch(2, probe_rank, args, backend="gloo", timeout_s=600.0)[0]
    print(f"host us per call, median of {args.iters} (stand-in kernels, CPU tensors; low latency {args.tokens}, "
          f"normal mode {args.normal_tokens} tokens x {args.hidden}, top-{args.topk} of {args.experts} experts, "
          "2 ranks)")
    print(f"  {'':22s} {'plain':>7s} {'global default device/dtype':>28s}")
    for name, us in result["plain"].items():
        print(f"  {name:22s} {us:7.1f} {result['global defaults'][name]:28.1f}")
    print(result["profile"])


if __name__ == "__main__":
    main()
