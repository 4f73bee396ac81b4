"""Where the host's time goes in one normal-mode round: per-call host time and a Python profile.

Each rank runs rounds of layout -> dispatch -> cached dispatch -> combine. First the host time of each
call (perf_counter, no profiler; medians over `--iters` rounds), then the same rounds under cProfile:
rank 0 prints its functions by own time and by cumulative time. A call whose host time passes its GPU
time leaves the GPU idle at small batches; this says which Python or C++ entry the time is spent in.

    python3 benchmarks/profile_host.py --tokens 128 --iters 200      # GPU machine, one rank per GPU

`--eager` instead times what a DeepEP program pays per call when it calls eagerly (no CUDA graph):
`get_dispatch_layout`, and a low-latency dispatch + combine pair (FP8 dispatch, T_max = --tokens),
for ep_plugin and, where `deep_ep` is importable, DeepEP V1, each in its own launch of the same run
(both start NVSHMEM), with and without torch.set_default_device("cuda") + set_default_dtype(bf16).
"host" is the median host time of one call (perf_counter), "mean" its mean (a few stalled calls show
there only); "wall" is the time of --iters calls
back to back divided by --iters, with one synchronisation at the end (the larger of host and GPU);
"gpu" the GPU's time per call with the host ahead (calls queued behind a sleep; NaN where the host could
not get ahead): where "wall" passes "gpu", the host sets the pace.
`--repeat N` runs every configuration N times, every other time in reverse order (a row's time
could owe to its place in the run rather than to its settings). Under each row, every rank's timed host
loop: its median host time per call, the main thread's CPU share (below 100%: it waited or was
descheduled) and its share spent runnable but waiting for a CPU, its context switches (blocked /
preempted), garbage collections, cudaMalloc calls, and the busiest other thread of the process.

    python3 benchmarks/profile_host.py --eager --tokens 128 --iters 500 --ranks 2 --repeat 2
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import glob
import importlib
import importlib.util
import io
import os
import pstats
import resource
import statistics
import threading
import time
from typing import Callable, Dict, List, Tuple

import torch
import torch.distributed as dist

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
    text.write(f"==== {', '.join(steps)}\n")
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


def _loop_counters() -> Dict[str, float]:
    """What can make the host's calls slow without showing in their code: this thread's CPU time and
    context switches (voluntary: it blocked, e.g. in a driver wait; involuntary: it was preempted), the
    garbage collector's runs and the CUDA caching allocator's cudaMalloc calls."""
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    # NOTE: thread_time (the scheduler's count, ns) rather than rusage's CPU times (clock ticks).
    counters = {"cpu_s": time.thread_time(), "blocked": usage.ru_nvcsw, "preempted": usage.ru_nivcsw,
                "gc": sum(stats["collections"] for stats in gc.get_stats()), "wall_s": time.perf_counter()}
    counters["mallocs"] = torch.cuda.memory_stats().get("segment.all.allocated", 0) if torch.cuda.is_available() else 0
    counters["threads"] = _thread_schedstats()
    return counters


def _thread_schedstats() -> Dict[str, Tuple[float, float]]:
    """Every thread of this process by "name/tid": seconds on a CPU and seconds runnable but waiting for one
    (the scheduler's counts, /proc/<pid>/task/<tid>/schedstat; empty where the kernel keeps none)."""
    stats = {}
    for task in glob.glob("/proc/self/task/*"):
        try:
            with open(f"{task}/schedstat") as f:
                on_cpu_ns, waiting_ns = f.read().split()[:2]
            with open(f"{task}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        stats[f"{name}/{os.path.basename(task)}"] = (int(on_cpu_ns) * 1e-9, int(waiting_ns) * 1e-9)
    return stats


def _thread_report(before: Dict[str, Tuple[float, float]], after: Dict[str, Tuple[float, float]],
                   wall_s: float) -> Dict[str, float]:
    """The main thread's share of the loop spent waiting for a CPU, and the busiest other thread's CPU share
    (a thread that spins beside the calls: a proxy, a watchdog)."""
    main = f"{_comm()}/{threading.get_native_id()}"
    shares = {name: (after[name][0] - before[name][0]) / wall_s for name in after if name in before}
    others = {name: share for name, share in shares.items() if name != main}
    busiest = max(others, key=others.get, default="none")
    waited = (after[main][1] - before[main][1]) / wall_s if main in after and main in before else float("nan")
    return {"runqueue_share": waited, "busiest_other": busiest, "busiest_other_share": others.get(busiest, 0.0)}


def _comm() -> str:
    with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
        return f.read().strip()


def _eager_times(step: Callable[[], None], iters: int, group) -> Dict[str, float]:
    for _ in range(20):  # warm-up
        step()
    _synchronize()
    host = []
    before = _loop_counters()
    for _ in range(iters):
        begin = time.perf_counter()
        step()
        host.append((time.perf_counter() - begin) * 1e6)
    after = _loop_counters()
    _synchronize()
    begin = time.perf_counter()
    for _ in range(iters):
        step()
    _synchronize()
    wall = (time.perf_counter() - begin) * 1e6 / iters
    delta = {name: after[name] - before[name] for name in after if name != "threads"}
    return {"host": statistics.median(host), "host_mean": statistics.fmean(host), "wall": wall,
            "gpu": _gpu_us(step, group), "cpu_share": delta["cpu_s"] / delta["wall_s"],
            **{name: delta[name] for name in ("blocked", "preempted", "gc", "mallocs")},
            **_thread_report(before["threads"], after["threads"], delta["wall_s"])}


def _gpu_us(step: Callable[[], None], group, calls: int = 100, sleep_cycles: int = 60_000_000) -> float:
    """GPU time per call with the host ahead of the GPU: the stream sleeps (about 35 ms) while the host queues
    `calls` calls, which then run back to back between two events. NaN where the host took longer than the
    sleep to queue them (the GPU waited for it), or without a GPU."""
    if not torch.cuda.is_available():
        return float("nan")
    # Every rank's sleep starts together: a rank whose GPU wakes first would time its wait for the others.
    dist.barrier(group=group)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(sleep_cycles)
    start.record()
    for _ in range(calls):
        step()
    end.record()
    host_was_behind = start.query()  # the sleep ended before the host had queued every call
    torch.cuda.synchronize()
    return float("nan") if host_was_behind else start.elapsed_time(end) * 1e3 / calls


def eager_rank(rank: int, world_size: int, group, args: argparse.Namespace, library: str,
               global_defaults: bool) -> Dict:
    """One library's eager per-call times on this rank (ep_plugin or deep_ep; same calls, same data)."""
    lib = importlib.import_module(library)
    device = rank_device(rank)
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(args.tokens, args.hidden, generator=generator).to(torch.bfloat16).to(device)
    topk_idx = random_routing(args.tokens, args.experts, args.topk, device, generator)
    topk_idx = topk_idx.to(getattr(lib, "topk_idx_t", torch.int64))
    weights = torch.rand(args.tokens, args.topk, generator=generator).to(device)
    if global_defaults:
        torch.set_default_device("cuda")
        torch.set_default_dtype(torch.bfloat16)
    normal = lib.Buffer(group, args.nvl_bytes, 0, explicitly_destroy=True)
    rdma = lib.Buffer.get_low_latency_rdma_size_hint(args.tokens, args.hidden, world_size, args.experts)
    ll = lib.Buffer(group, 0, rdma, low_latency_mode=True, num_qps_per_rank=args.experts // world_size,
                    explicitly_destroy=True)
    recv_x, _, handle, _, _ = ll.low_latency_dispatch(x, topk_idx, args.tokens, args.experts, use_fp8=True)
    expert_out = torch.randn(recv_x[0].shape, generator=generator, dtype=torch.float32, device="cpu").to(
        torch.bfloat16).to(device)
    ll.low_latency_combine(expert_out, topk_idx, weights, handle)

    def ll_pair():
        _, _, pair_handle, _, _ = ll.low_latency_dispatch(x, topk_idx, args.tokens, args.experts, use_fp8=True)
        ll.low_latency_combine(expert_out, topk_idx, weights, pair_handle)

    times = {"get_dispatch_layout": _eager_times(lambda: normal.get_dispatch_layout(topk_idx, args.experts),
                                                 args.iters, group),
             "ll_dispatch+combine": _eager_times(ll_pair, args.iters, group)}
    # Where an ep_plugin pair's host time goes, with and without the global defaults (every rank makes the
    # calls, rank 0 reports).
    profile = ""
    if library == "ep_plugin":
        profile = _profile({"ll_pair" + (" (global default cuda/bf16)" if global_defaults else ""): ll_pair},
                           args.iters, args.top)
    _synchronize()
    ll.destroy()
    normal.destroy()
    return {"times": times, "profile": profile}


def _loop_report(t: Dict[str, float]) -> str:
    """One rank's timed host loop: median host time per call, the thread's CPU share and its share waiting
    for a CPU, its context switches (blocked / preempted), garbage collections, cudaMalloc calls and the
    busiest other thread over the loop."""
    return (f"host {t['host']:.0f} cpu {100 * t['cpu_share']:.0f}% runqueue {100 * t['runqueue_share']:.0f}% "
            f"switches {t['blocked']:.0f}/{t['preempted']:.0f} gc {t['gc']:.0f} malloc {t['mallocs']:.0f} "
            f"busiest other thread {t['busiest_other']} {100 * t['busiest_other_share']:.0f}%")


def eager_main(args: argparse.Namespace, ranks: int) -> None:
    libraries = ["ep_plugin"] + (["deep_ep"] if importlib.util.find_spec("deep_ep") is not None else [])
    print(f"eager per-call us, rank 0 (median host / wall per call over {args.iters}; {args.tokens} tokens x "
          f"{args.hidden}, top-{args.topk} of {args.experts} experts, {ranks} ranks, "
          f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'})")
    profiles = []
    for repeat in range(args.repeat):
        # Every other round in the opposite order: a row that only ever runs first or last could owe its
        # time to its place (process placement, clocks) rather than to its settings.
        order = (False, True) if repeat % 2 == 0 else (True, False)
        for library in libraries if repeat % 2 == 0 else libraries[::-1]:
            for global_defaults in order:
                results = parallel_launch(ranks, eager_rank, args, library, global_defaults, timeout_s=600.0)
                result = results[0]
                label = f"{library}{' (global default cuda/bf16)' if global_defaults else ''}"
                print(f"{label:45s} " + "  ".join(
                    f"{name}: host {t['host']:.1f} (mean {t['host_mean']:.1f}) wall {t['wall']:.1f} gpu {t['gpu']:.1f}"
                    for name, t in result["times"].items()))
                print(f"{'':45s}   the timed host loops, rank by rank: " + "; ".join(
                    f"{name}: " + " | ".join(_loop_report(r["times"][name]) for r in results) for name in result["times"]))
                if repeat == 0:
                    profiles.append(result["profile"])  # rank 0's
    print("".join(profiles))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=None, help="default: one per GPU")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--top", type=int, default=30, help="functions listed per table")
    parser.add_argument("--repeat", type=int, default=1,
                        help="--eager: run every configuration this many times, every other time in reverse order")
    parser.add_argument("--nvl-bytes", type=int, default=1 << 30)
    parser.add_argument("--eager", action="store_true", help="eager per-call times, ep_plugin and DeepEP V1")
    args = parser.parse_args()
    ranks = args.ranks or max(2, torch.cuda.device_count())
    if args.eager:
        eager_main(args, ranks)
        return
    results = parallel_launch(ranks, profile_rank, args, timeout_s=600.0)
    print(f"host us per call (median of {args.iters} rounds; {args.tokens} tokens x {args.hidden}, "
          f"top-{args.topk} of {args.experts} experts, {ranks} ranks)")
    for r in results:
        print(f"rank {r['rank']}: " + ", ".join(f"{k} {v:.1f}" for k, v in r["host_us"].items()))
    print(results[0]["profile"])


if __name__ == "__main__":
    main()
