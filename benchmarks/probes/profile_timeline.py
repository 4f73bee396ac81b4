"""Each rank's host time per step (layout, dispatch, combine) beside its GPU span, from a torch.profiler timeline.

    python3 benchmarks/probes/profile_timeline.py --out-dir /tmp/timeline            # GPU machine
    python3 benchmarks/probes/profile_timeline.py --backend reference --ranks 2 ...   # anywhere (gloo on CPU)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Dict, List, Tuple

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from ep_plugin import Buffer
from ep_plugin.bench import per_token_fp8, random_routing
from ep_plugin.launch import parallel_launch, rank_device

GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
STEPS = ("ep.layout", "ep.dispatch", "ep.cached_dispatch", "ep.combine")


def _round(buffer: Buffer, x, topk_idx, weights, num_experts: int) -> None:
    with record_function("ep.layout"):
        layout = buffer.get_dispatch_layout(topk_idx, num_experts)
    with record_function("ep.dispatch"):
        recv_x, _, recv_weights, _, handle, _ = buffer.dispatch(
            x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3], num_tokens_per_expert=layout[2],
            topk_idx=topk_idx, topk_weights=weights)
    with record_function("ep.cached_dispatch"):
        buffer.dispatch(x, handle=handle)
    # FP8 rows come back as (rows, scales); the combine takes bf16 expert outputs, cast outside the steps.
    expert_out = recv_x[0].to(torch.bfloat16) if isinstance(recv_x, tuple) else recv_x
    with record_function("ep.combine"):
        buffer.combine(expert_out, handle, topk_weights=recv_weights)


def merge_intervals(intervals: List[Tuple[float, float]]) -> List[Tuple[float, float]]:
    """The unions of overlapping (start, end) intervals, in order."""
    merged: List[List[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def merged_spans(intervals: List[Tuple[float, float]]) -> List[float]:
    """Lengths of the unions of overlapping (start, end) intervals."""
    return [end - start for start, end in merge_intervals(intervals)]


def step_summary(trace_path: str) -> List[Dict]:
    """Per step, the median over rounds: host microseconds, the GPU span of its work (first start to last
    end), and its GPU work in order: each kernel (or copy) with its duration and the GPU-idle gap before it.

    Read from the Chrome trace: the profiler's averages give a step's host range and its GPU range
    (one per stream it used) under one name, so they cannot tell them apart.
    """
    with open(trace_path) as handle:
        events = [e for e in json.load(handle)["traceEvents"] if e.get("ph") == "X"]
    steps = [e for e in events if e.get("name") in STEPS]
    gpu_work = sorted((e for e in events if e.get("cat") in GPU_WORK), key=lambda e: e["ts"])
    rows = []
    for step in STEPS:
        host = [e["dur"] for e in steps if e["name"] == step and e.get("cat") == "user_annotation"]
        if not host:
            continue
        ranges = [(e["ts"], e["ts"] + e["dur"]) for e in steps
                  if e["name"] == step and e.get("cat") == "gpu_user_annotation"]
        # NOTE: a step that used several streams has one GPU range per stream; their union is the step's span.
        spans = merged_spans(ranges)
        rows.append({"step": step, "host_us": statistics.median(host),
                     "gpu_us": statistics.median(spans) if spans else 0.0,
                     "work": median_work(rounds_of_work(gpu_work, ranges))})
    return rows


def rounds_of_work(gpu_work: List[Dict], ranges: List[Tuple[float, float]]) -> List[List[Tuple[str, float, float]]]:
    """For each GPU range of a step (one per round and stream, merged where they overlap), its work in
    start order as (name, idle gap before it, duration); the first item's gap is 0."""
    rounds = []
    for start, end in merge_intervals(ranges):
        inside = [e for e in gpu_work if start <= e["ts"] <= end]
        items, busy_until = [], None
        for e in inside:
            gap = 0.0 if busy_until is None else max(0.0, e["ts"] - busy_until)
            items.append((short_name(e["name"]), gap, e["dur"]))
            busy_until = e["ts"] + e["dur"] if busy_until is None else max(busy_until, e["ts"] + e["dur"])
        rounds.append(items)
    return rounds


def median_work(rounds: List[List[Tuple[str, float, float]]]) -> List[Dict]:
    """Item by item, the medians over the rounds whose work has the most common sequence of names."""
    if not rounds:
        return []
    sequences = [tuple(name for name, _, _ in items) for items in rounds]
    common = max(set(sequences), key=sequences.count)
    same = [items for items, names in zip(rounds, sequences) if names == common]
    return [{"name": name, "gap_us": statistics.median(items[i][1] for items in same),
             "dur_us": statistics.median(items[i][2] for items in same)} for i, name in enumerate(common)]


def short_name(name: str) -> str:
    """A kernel's name without its template arguments and parameter list."""
    return name.split("(")[0].split("<")[0].split("::")[-1] or name


def profile_rank(rank: int, world_size: int, group, args: argparse.Namespace) -> Dict:
    device = rank_device(rank)
    config = {"backend": args.backend, "num_sms": args.num_sms, "check_inputs": False,
              "buffer": {"max_hidden": args.hidden}}
    if args.ranks_per_node is not None:  # e.g. 1 on one host: emulated nodes, the internode path
        config.update(transport="nvlink", topology={"ranks_per_node": args.ranks_per_node})
    buffer = Buffer.from_config(group, config, explicitly_destroy=True)
    generator = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(args.tokens, args.hidden, generator=generator).to(torch.bfloat16).to(device)
    if args.dtype == "fp8":
        x = per_token_fp8(x)
    topk_idx = random_routing(args.tokens, args.experts, args.topk, device, generator)
    weights = torch.rand(args.tokens, args.topk, generator=generator).to(device)
    for _ in range(args.warmup):
        _round(buffer, x, topk_idx, weights, args.experts)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    if device.type == "cuda":
        torch.cuda.synchronize()
    torch.distributed.barrier(group=group)
    with profile(activities=activities) as prof:
        # NOTE: the profiler starts at different speeds on the ranks; without this barrier the first
        # round's dispatch of the faster rank waits for the other in its notify step.
        torch.distributed.barrier(group=group)
        for _ in range(args.iters):
            _round(buffer, x, topk_idx, weights, args.experts)
        if device.type == "cuda":
            torch.cuda.synchronize()
    backend = buffer.backend_name
    buffer.destroy()
    events = prof.key_averages()
    sort_key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = events.table(sort_by=sort_key, row_limit=args.rows)
    os.makedirs(args.out_dir, exist_ok=True)
    trace_path = os.path.join(args.out_dir, f"timeline_rank{rank}.json")
    prof.export_chrome_trace(trace_path)
    with open(os.path.join(args.out_dir, f"kernels_rank{rank}.txt"), "w") as handle:
        handle.write(table)
    return {"rank": rank, "backend": backend, "steps": step_summary(trace_path), "table": table}


def format_steps(result: Dict) -> str:
    lines = [f"rank {result['rank']} ({result['backend']}): per round (median), host time of each step and the "
             "GPU span of its work (first start to last end, every stream)",
             f"{'step':<20}{'host us':>12}{'GPU span us':>14}"]
    for row in result["steps"]:
        lines.append(f"{row['step']:<20}{row['host_us']:>12.1f}{row['gpu_us']:>14.1f}")
    lines.append("GPU work of each step (median): [idle gap before it] name duration, in us")
    for row in result["steps"]:
        work = "  ".join(f"[{item['gap_us']:.1f}] {item['name']} {item['dur_us']:.1f}" for item in row["work"])
        lines.append(f"{row['step']:<20}{work or '(none)'}")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=None, help="default: the GPUs here (2 on CPU)")
    parser.add_argument("--backend", default="native", choices=("native", "reference", "auto"))
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp8"),
                        help="dispatch payload: bf16 rows, or FP8 rows with one float scale per 128 channels")
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--num-sms", type=int, default=24)
    parser.add_argument("--ranks-per-node", type=int, default=None,
                        help="topology.ranks_per_node (fewer than the ranks: internode mode, emulated on one host)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--rows", type=int, default=20, help="rows of the kernel table")
    parser.add_argument("--out-dir", default="timeline")
    args = parser.parse_args(argv)
    if args.ranks is None:
        args.ranks = torch.cuda.device_count() if torch.cuda.is_available() else 2
    if args.experts % args.ranks:
        parser.error(f"--experts {args.experts} is not divisible by --ranks {args.ranks}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    results = parallel_launch(args.ranks, profile_rank, args, timeout_s=600)
    for result in results:
        print(format_steps(result))
    print(f"\nrank 0, top kernels and ops by GPU time ({args.iters} rounds):\n{results[0]['table']}")
    with open(os.path.join(args.out_dir, "steps.json"), "w") as handle:
        json.dump({"args": vars(args), "steps": [{k: r[k] for k in ("rank", "backend", "steps")} for r in results]},
                  handle, indent=1)
    print(f"traces and tables in {args.out_dir}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
