"""Low-latency dispatch/combine under CUDA graphs: native kernels vs the reference backend.

    python3 benchmarks/bench_low_latency.py --out benchmarks/results/h100x2-ep2-low-latency-graphs.json \
        --plot /tmp/low_latency_tokens.png

Per point (tokens per rank T, with T_max = T): one FP8 (or bf16) dispatch and one bf16 combine are
checked against the reference backend, then each is captured in its own CUDA graph and the two
graphs are replayed alternately `--replays` times; CUDA events around every replay give the times
(median, p10, p90 over replays, then averaged over ranks). Before each dispatch replay the L2 is
flushed (a 256 MiB memset on the same stream, outside the timed events) unless --no-flush.
Then `--kernel-replays` more replays run under the profiler, which gives the kernels' own
durations without the graph launch ("dispatch_kernel", "combine_kernel"): how DeepEP's
test_low_latency.py times its kernels (kineto), so the number to set beside DeepEP's.
The reference backend (not capturable: it reads counts on the host) is timed eagerly, with a
device sync and a barrier before each call.

Two native variants per point: "native", DeepEP's API (the combine sums each token's top-k bf16
rows on the token side), and "native_expert_sums", the dispatch also given topk_weights (an
ep_plugin extension): the combine sums on the expert side and sends one partial per (token,
rank), rounded to bf16 when it crosses to a peer unless --expert-sums-partials fp32 (checked against
the rounding bound of ep_plugin.testing.assert_within_bf16_partials_bound; fp32 partials with
assert_close). Bandwidth below counts the same messages for both.

Bandwidth, per rank, counted per (token, expert) message received:
    dispatch GB/s = received messages x (H + 4 x ceil(H / 128)) bytes (FP8 row + float scales;
                    2H for bf16) / median time
    combine  GB/s = received messages x 2H bytes / median time
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
from typing import Dict, List

import torch
import torch.distributed as dist

from ep_plugin import Buffer
from ep_plugin.launch import RANKS_PER_GPU_ENV, parallel_launch, rank_device, rank_slots
from ep_plugin.testing import assert_within_bf16_partials_bound, raw_bytes

DEFAULT_SWEEP = [1, 2, 4, 8, 16, 32, 64, 96, 128, 160, 192, 224, 256]
DEEPEP_REFERENCE_US = {"dispatch": 28.0, "combine": 41.0}   # DeepEP V1 low-latency, this machine (issue 4)
TARGETS_US = {"dispatch": 18.0, "combine": 25.0}
DEEPEP_BUFFER_BYTES = 1.9e9                                   # DeepEP at 128 x 7168 x 256 experts, 2 ranks


def summarize(times_us: List[float]) -> Dict[str, float]:
    ordered = sorted(times_us)

    def quantile(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]

    return {"median_us": statistics.median(ordered), "p10_us": quantile(0.1), "p90_us": quantile(0.9),
            "min_us": ordered[0], "max_us": ordered[-1]}


def make_inputs(rank: int, T: int, H: int, K: int, E: int, seed: int):
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16).cuda()
    ids = torch.rand(T, E, generator=gen).topk(K, dim=1).indices.cuda()
    weights = torch.rand(T, K, generator=gen).cuda()
    return x, ids, weights


def dispatch_kwargs(use_fp8: bool, weights, expert_sums: bool) -> dict:
    return dict(use_fp8=use_fp8, **({"topk_weights": weights} if expert_sums else {}))


def check_against_reference(native: Buffer, reference: Buffer, x, ids, weights, T: int, E: int, use_fp8: bool,
                            expert_sums: bool):
    got = native.low_latency_dispatch(x, ids, T, E, **dispatch_kwargs(use_fp8, weights, expert_sums))
    if got[2].expert_sums != expert_sums:
        raise AssertionError(f"expected expert_sums={expert_sums} on this machine, got {got[2].expert_sums}")
    want = reference.low_latency_dispatch(x, ids, T, E, use_fp8=use_fp8)
    if not torch.equal(got[1], want[1]):
        raise AssertionError("recv_count differs from the reference backend")
    for e, n in enumerate(want[1].tolist()):
        pairs = zip(got[0], want[0]) if use_fp8 else [(got[0], want[0])]
        for g, w in pairs:
            if not torch.equal(raw_bytes(g[e, :n]), raw_bytes(w[e, :n])):
                raise AssertionError(f"recv_x of local expert {e} differs from the reference backend")
    expert_out = torch.randn(want[2].recv_shape, device="cuda").to(torch.bfloat16)
    combined = native.low_latency_combine(expert_out, ids, weights, got[2])[0]
    want_combined = reference.low_latency_combine(expert_out, ids, weights, want[2])[0]
    if got[2].bf16_partials:
        magnitude = reference.low_latency_combine(expert_out.abs(), ids, weights, want[2])[0]  # weights >= 0
        assert_within_bf16_partials_bound(combined, want_combined, magnitude)
    else:
        torch.testing.assert_close(combined, want_combined)
    return int(want[1].sum())


def capture_graphs(native: Buffer, x, ids, weights, T: int, E: int, use_fp8: bool, expert_sums: bool):
    """Dispatch and combine, each captured in its own CUDA graph after a warm-up outside capture."""
    kwargs = dispatch_kwargs(use_fp8, weights, expert_sums)
    E_local = E // dist.get_world_size(native.group)
    expert_out = torch.randn(E_local, native.group_size * T, x.size(1), device="cuda").to(torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _, _, handle, _, _ = native.low_latency_dispatch(x, ids, T, E, **kwargs)
        native.low_latency_combine(expert_out, ids, weights, handle)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    dispatch_graph, combine_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(dispatch_graph):
        _, _, handle, _, _ = native.low_latency_dispatch(x, ids, T, E, **kwargs)
    with torch.cuda.graph(combine_graph):
        native.low_latency_combine(expert_out, ids, weights, handle)
    return dispatch_graph, combine_graph


def time_native_graphs(native: Buffer, graphs, replays: int, kernel_replays: int,
                       flush: bool) -> Dict[str, List[float]]:
    """The two graphs replayed alternately: CUDA events around every replay (graph launch included),
    then `kernel_replays` more under the profiler for the kernels' own durations (DeepEP's method)."""
    dispatch_graph, combine_graph = graphs
    flush_buffer = torch.empty(256 << 20, dtype=torch.uint8, device="cuda") if flush else None

    def replay(marks=None) -> None:
        if flush_buffer is not None:
            flush_buffer.zero_()
        if marks:
            marks[0].record()
        dispatch_graph.replay()
        if marks:
            marks[1].record()
        combine_graph.replay()
        if marks:
            marks[2].record()

    for _ in range(20):
        replay()
    torch.cuda.synchronize()
    dist.barrier(group=native.group)
    events = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(replays)]
    for marks in events:
        replay(marks)
    torch.cuda.synchronize()
    times = {"dispatch": [m[0].elapsed_time(m[1]) * 1e3 for m in events],
             "combine": [m[1].elapsed_time(m[2]) * 1e3 for m in events],
             "dispatch_combine": [m[0].elapsed_time(m[2]) * 1e3 for m in events]}
    if kernel_replays > 0:
        times.update(kernel_durations_us(native, replay, kernel_replays))
    return times


def kernel_durations_us(native: Buffer, replay, replays: int) -> Dict[str, List[float]]:
    """Durations of the low-latency kernels themselves, from a CUPTI trace of `replays` replays.

    Ranks that share a GPU launch send and receive separately: a replay's time is then the sum of
    its launches.
    """
    from torch.profiler import ProfilerActivity, profile

    dist.barrier(group=native.group)
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        for _ in range(replays):
            replay()
        torch.cuda.synchronize()
    launches: Dict[str, List[tuple]] = {"dispatch_kernel": [], "combine_kernel": []}
    for event in trace.events():
        if "low_latency" not in event.name:
            continue
        for op in ("dispatch", "combine"):
            if f"{op}_kernel" in event.name:
                launches[f"{op}_kernel"].append((event.time_range.start, event.time_range.elapsed_us()))
    return {op: per_replay_us(op, found, replays) for op, found in launches.items()}


def per_replay_us(op: str, launches: List[tuple], replays: int) -> List[float]:
    """(start, microseconds) of every launch of `op` -> its time per replay, launches in start order
    summed in equal groups (one group per replay)."""
    per_replay = len(launches) // replays
    if per_replay == 0 or len(launches) != per_replay * replays:
        raise RuntimeError(f"the profiler saw {len(launches)} {op} launches in {replays} replays")
    ordered = sorted(launches)
    return [sum(us for _, us in ordered[i:i + per_replay]) for i in range(0, len(ordered), per_replay)]


def time_reference(reference: Buffer, x, ids, weights, T: int, E: int, use_fp8: bool,
                   iters: int) -> Dict[str, List[float]]:
    times: Dict[str, List[float]] = {"dispatch": [], "combine": []}
    for i in range(iters + 3):
        torch.cuda.synchronize()
        dist.barrier(group=reference.group)
        start, middle, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        start.record()
        _, _, handle, _, _ = reference.low_latency_dispatch(x, ids, T, E, use_fp8=use_fp8)
        middle.record()
        expert_out = torch.empty(handle.recv_shape, dtype=torch.bfloat16, device="cuda")
        torch.cuda.synchronize()
        dist.barrier(group=reference.group)
        middle_start = torch.cuda.Event(enable_timing=True)
        middle_start.record()
        reference.low_latency_combine(expert_out, ids, weights, handle)
        end.record()
        end.synchronize()
        if i >= 3:
            times["dispatch"].append(start.elapsed_time(middle) * 1e3)
            times["combine"].append(middle_start.elapsed_time(end) * 1e3)
    return times


def bench_rank(rank: int, R: int, group, args: argparse.Namespace) -> dict:
    torch.cuda.set_device(rank_device(rank))
    H, K, E = args.hidden, args.topk, args.experts
    use_fp8 = args.dtype == "fp8"
    points = args.sweep or [args.tokens]
    t_max = max(points)
    num_rdma_bytes = Buffer.get_low_latency_rdma_size_hint(t_max, H, R, E)
    native = Buffer(group, 0, num_rdma_bytes, low_latency_mode=True, explicitly_destroy=True,
                    config={"backend": "native", "timeout_s": 60, "transport": "nvlink",  # one host: no NIC probing
                            "low_latency": {"expert_sums_partials": args.expert_sums_partials}})
    reference = Buffer(group, 0, 0, low_latency_mode=True, explicitly_destroy=True, config={"backend": "reference"})
    scale_bytes = 4 * math.ceil(H / 128)
    results = []
    for i, T in enumerate(points):
        x, ids, weights = make_inputs(rank, T, H, K, E, args.seed + i)
        native_times = {}
        for variant, expert_sums in (("native", False), ("native_expert_sums", True)):
            received = check_against_reference(native, reference, x, ids, weights, T, E, use_fp8, expert_sums)
            graphs = capture_graphs(native, x, ids, weights, T, E, use_fp8, expert_sums)
            native_times[variant] = time_native_graphs(native, graphs, args.replays, args.kernel_replays,
                                                       not args.no_flush)
        reference_times = time_reference(reference, x, ids, weights, T, E, use_fp8, args.reference_iters) \
            if args.reference_iters > 0 else {}
        dispatch_msg_bytes = H + scale_bytes if use_fp8 else 2 * H
        results.append({"tokens": T, "received_messages": received,
                        "dispatch_bytes": received * dispatch_msg_bytes, "combine_bytes": received * 2 * H,
                        **{variant: {k: summarize(v) for k, v in times.items()}
                           for variant, times in native_times.items()},
                        "reference": {k: summarize(v) for k, v in reference_times.items()}})
        if rank == 0:
            d, c = results[-1]["native"]["dispatch"], results[-1]["native"]["combine"]
            s = results[-1]["native_expert_sums"]["combine"]
            print(f"[{i + 1}/{len(points)}] T={T}: dispatch {d['median_us']:.1f} us, combine {c['median_us']:.1f} us "
                  f"(expert sums {s['median_us']:.1f} us)", file=sys.stderr, flush=True)
    torch.cuda.synchronize()
    native.destroy()
    reference.destroy()
    return {"num_rdma_bytes": num_rdma_bytes, "device_name": torch.cuda.get_device_name(rank), "points": results}


def aggregate(per_rank: List[dict]) -> List[dict]:
    """Average each statistic over ranks; GB/s from each rank's bytes and median, averaged."""
    points = []
    for i, first in enumerate(per_rank[0]["points"]):
        point = {"tokens": first["tokens"],
                 "received_messages_per_rank": [r["points"][i]["received_messages"] for r in per_rank]}
        for backend in ("native", "native_expert_sums", "reference"):
            if backend not in first:
                continue
            point[backend] = {}
            for op in first[backend]:
                stats = [r["points"][i][backend][op] for r in per_rank]
                entry = {key: sum(s[key] for s in stats) / len(stats) for key in stats[0]}
                byte_key = {"dispatch": "dispatch_bytes", "combine": "combine_bytes"}.get(op.replace("_kernel", ""))
                if byte_key:
                    entry["gbps"] = sum(r["points"][i][byte_key] / (s["median_us"] * 1e-6) / 1e9
                                        for r, s in zip(per_rank, stats)) / len(stats)
                point[backend][op] = entry
        points.append(point)
    return points


def plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = report["points"]
    tokens = [p["tokens"] for p in points]
    fig, (ax_time, ax_bw) = plt.subplots(1, 2, figsize=(12, 4.5))
    for backend, style in (("native", "-"), ("native_expert_sums", "-."), ("reference", ":")):
        for op, color in (("dispatch", "tab:blue"), ("combine", "tab:orange")):
            if op not in points[0].get(backend, {}):
                continue
            median = [p[backend][op]["median_us"] for p in points]
            ax_time.plot(tokens, median, style, color=color, marker="o", label=f"{backend} {op}")
            if backend != "reference":
                ax_time.fill_between(tokens, [p[backend][op]["p10_us"] for p in points],
                                     [p[backend][op]["p90_us"] for p in points], color=color, alpha=0.2)
                ax_bw.plot(tokens, [p[backend][op]["gbps"] for p in points], color=color, marker="o",
                           label=f"{backend} {op}")
                if f"{op}_kernel" in points[0][backend]:
                    ax_time.plot(tokens, [p[backend][f"{op}_kernel"]["median_us"] for p in points], "--",
                                 color=color, marker=".", label=f"{backend} {op}, kernel only")
    for op, color in (("dispatch", "tab:blue"), ("combine", "tab:orange")):
        ax_time.axhline(TARGETS_US[op], color=color, linestyle="--", linewidth=0.8, label=f"target {op}")
    ax_time.set_xlabel("tokens per rank")
    ax_time.set_ylabel("time per call (us), median; band p10-p90")
    ax_time.set_yscale("log")
    ax_bw.set_xlabel("tokens per rank")
    ax_bw.set_ylabel("GB/s per rank (per (token, expert) message)")
    s = report["settings"]
    fig.suptitle(f"ep_plugin low-latency, {report['num_ranks']} x {report['device_name']}, hidden {s['hidden']}, "
                 f"top-{s['topk']}, {s['experts']} experts, {s['dtype']} dispatch, CUDA graphs")
    ax_time.legend(fontsize=7)
    ax_bw.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=None, help="default: every GPU here")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per rank (without --sweep)")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--dtype", choices=("fp8", "bf16"), default="fp8", help="dispatch payload")
    parser.add_argument("--sweep", default=",".join(map(str, DEFAULT_SWEEP)),
                        help="tokens per rank, comma-separated ('' for --tokens only)")
    parser.add_argument("--replays", type=int, default=1000)
    parser.add_argument("--kernel-replays", type=int, default=200,
                        help="replays traced by the profiler for kernel-only durations (0: none)")
    parser.add_argument("--reference-iters", type=int, default=20, help="0 skips the reference backend")
    parser.add_argument("--expert-sums-partials", choices=("bf16", "fp32"), default="bf16",
                        help="low_latency.expert_sums_partials of the native_expert_sums variant")
    parser.add_argument("--no-flush", action="store_true", help="do not flush the L2 before each dispatch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the results as JSON")
    parser.add_argument("--plot", default=None, help="write a PNG (matplotlib)")
    args = parser.parse_args(argv)
    args.sweep = [int(v) for v in args.sweep.split(",") if v.strip()]
    if args.ranks is None:
        args.ranks = max(torch.cuda.device_count(), 2)
    if rank_slots() < args.ranks:
        print(f"needs {args.ranks} GPUs, found {torch.cuda.device_count()} (ranks share a GPU only under CUDA MPS "
              f"with {RANKS_PER_GPU_ENV} set)", file=sys.stderr)
        return 2
    per_rank = parallel_launch(args.ranks, bench_rank, args, timeout_s=1800)
    report = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "host": platform.node(),
              "command": "python3 " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
              "torch": torch.__version__, "num_ranks": args.ranks, "device_name": per_rank[0]["device_name"],
              "settings": {k: v for k, v in vars(args).items() if k not in ("out", "plot")},
              "num_rdma_bytes": per_rank[0]["num_rdma_bytes"],
              "num_rdma_bytes_at_128_tokens": Buffer.get_low_latency_rdma_size_hint(128, args.hidden, args.ranks,
                                                                                    args.experts),
              "deepep_buffer_bytes": DEEPEP_BUFFER_BYTES, "deepep_us": DEEPEP_REFERENCE_US, "targets_us": TARGETS_US,
              "points": aggregate(per_rank)}
    print(f"symmetric buffer: {report['num_rdma_bytes'] / 1e9:.3f} GB per GPU for T_max={max(args.sweep or [args.tokens])}"
          f" ({report['num_rdma_bytes_at_128_tokens'] / 1e9:.3f} GB at 128 tokens; DeepEP about 1.9 GB)")
    header = (f"{'tokens':>7} {'op':<10} {'native med us':>14} {'p10':>7} {'p90':>7} {'GB/s':>8} {'kernel us':>10} "
              f"{'reference us':>13}")
    print(header)
    print("-" * len(header))
    for point in report["points"]:
        for variant, op in (("native", "dispatch"), ("native", "combine"), ("native_expert_sums", "dispatch"),
                            ("native_expert_sums", "combine")):
            n, r = point[variant][op], point["reference"].get(op)
            kernel = point[variant].get(f"{op}_kernel")
            op = op if variant == "native" else f"{op}*"
            print(f"{point['tokens']:>7} {op:<10} {n['median_us']:>14.1f} {n['p10_us']:>7.1f} {n['p90_us']:>7.1f} "
                  f"{n['gbps']:>8.1f} {kernel['median_us'] if kernel else float('nan'):>10.1f} "
                  f"{r['median_us'] if r else float('nan'):>13.1f}")
    print(f"*: the dispatch given topk_weights, the combine summing on the expert side (ep_plugin extension), "
          f"{args.expert_sums_partials} partials")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=2)
        print(f"wrote {args.out}")
    if args.plot:
        plot(report, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
