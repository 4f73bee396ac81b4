"""Where a normal-mode combine's time goes on the GPU: every operation of it on every stream, every rank.

Each rank dispatches once (4096 tokens x 7168, top-8, 256 experts, random routing), then times
`--iters` cached combines under torch.profiler. Before each combine the caller's stream sleeps
(`--lead-us`), so the host has queued all of the combine's work before the GPU reaches it and the
timeline is the GPU's alone; the L2 is flushed as in the bench. Two one-element kernels mark the
combine's start and end on the caller's stream: the end marker starts when the caller's stream is
released by the combine's joins.

For each operation (kernel, copy, memset) of a combine, on each stream, the script prints its start
and end in us from the start marker's end (median over the combines). The peer's operations are put
on this rank's time line through the profiler's host clock (both processes share the host), so the
rows copy into this rank can be seen beside this rank's reduction.

    python3 benchmarks/combine_timeline.py --out-dir /tmp/ctl     # GPU machine, every GPU one rank
    python3 benchmarks/combine_timeline.py --staging-tokens 4096  # the copy-engine combine at more than 2 ranks
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections import defaultdict
from typing import Dict, List

import torch
from torch.profiler import ProfilerActivity, profile

from ep_plugin import Buffer
from ep_plugin.bench import _sleep_cycles, random_routing
from ep_plugin.launch import parallel_launch, rank_device

MARK_START = "mark.add_"
MARK_END = "mark.mul_"


def profile_rank(rank: int, world_size: int, group, args: argparse.Namespace) -> Dict:
    device = rank_device(rank)
    config = {"backend": "native", "num_sms": args.num_sms, "check_inputs": False,
              "buffer": {"max_hidden": args.hidden, "combine_staging_tokens": args.staging_tokens}}
    buffer = Buffer.from_config(group, config, explicitly_destroy=True)
    generator = torch.Generator().manual_seed(2000 + rank)
    x = torch.randn(args.tokens, args.hidden, generator=generator).to(torch.bfloat16).to(device)
    topk_idx = random_routing(args.tokens, args.experts, args.topk, device, generator)
    weights = torch.rand(args.tokens, args.topk, generator=generator).to(device)
    layout = buffer.get_dispatch_layout(topk_idx, args.experts)
    recv_x, _, recv_weights, _, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3], num_tokens_per_expert=layout[2],
        topk_idx=topk_idx, topk_weights=weights)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    mark = torch.zeros(1, dtype=torch.int64, device=device)
    lead = _sleep_cycles(args.lead_us)

    def one_combine() -> None:
        torch.cuda._sleep(lead)
        flush.zero_()
        mark.add_(1)
        buffer.combine(recv_x, handle, topk_weights=recv_weights)
        mark.mul_(1)

    for _ in range(args.warmup):
        one_combine()
    torch.cuda.synchronize()
    torch.distributed.barrier(group=group)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.distributed.barrier(group=group)
        for _ in range(args.iters):
            one_combine()
        torch.cuda.synchronize()
    buffer.destroy()
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, f"combine_rank{rank}.json")
    prof.export_chrome_trace(path)
    return {"rank": rank, "trace": path, "rows_to_peer": int(recv_x.shape[0])}


def gpu_events(trace_path: str) -> List[Dict]:
    """The trace's kernels, copies and memsets: name, stream, absolute start and end (us)."""
    with open(trace_path) as handle:
        trace = json.load(handle)
    base_us = trace.get("baseTimeNanoseconds", 0) / 1000.0
    events = []
    for e in trace["traceEvents"]:
        if e.get("ph") != "X" or e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        start = base_us + float(e["ts"])
        events.append({"name": e["name"], "stream": e.get("args", {}).get("stream", -1), "start": start,
                       "end": start + float(e.get("dur", 0.0)), "cat": e["cat"]})
    return sorted(events, key=lambda e: e["start"])


def short_name(event: Dict) -> str:
    name = event["name"]
    for key in ("staged_reduce_kernel", "staging_wait_kernel", "write_word_kernel", "spin_kernel"):
        if key in name:
            return key
    if event["cat"] != "kernel":
        return name.split(" (")[0]
    if "add" in name.lower():
        return MARK_START
    if "mul" in name.lower():
        return MARK_END
    return "fill" if "fill" in name.lower() else name[:40]


def rounds_of(events: List[Dict]) -> List[Dict]:
    """Per combine: t0 (the start marker's end), the end marker's start, and the operations between."""
    caller = next(e["stream"] for e in events if short_name(e) == "spin_kernel")
    marks = [e for e in events if e["stream"] == caller and short_name(e) in (MARK_START, MARK_END)]
    rounds = []
    for first, second in zip(marks, marks[1:]):
        if short_name(first) != MARK_START or short_name(second) != MARK_END:
            continue
        t0 = first["end"]
        ops = [e for e in events if e["stream"] != caller and t0 - 50 <= e["start"] < second["start"] + 50
               and short_name(e) not in ("spin_kernel", "fill")]
        rounds.append({"t0": t0, "end": second["start"], "ops": ops, "caller": caller})
    return rounds


def stream_roles(events: List[Dict]) -> Dict[int, str]:
    """Each stream's role, from what runs on it: `reduce` (the owner's reduction), `copy` (the copy stream; with
    more than 2 ranks, one per owner: `copy1`, `copy2`, ... in the order they first run), `sN`."""
    roles: Dict[int, str] = {}
    copy_streams: List[int] = []
    for e in events:
        name = short_name(e)
        if name == "staged_reduce_kernel":
            roles[e["stream"]] = "reduce"
        elif e["stream"] not in roles and e["stream"] not in copy_streams and \
                (name == "staging_wait_kernel" or "PtoP" in name):
            copy_streams.append(e["stream"])
    for i, stream in enumerate(copy_streams):
        roles[stream] = "copy" if len(copy_streams) == 1 else f"copy{i + 1}"
    for e in events:
        roles.setdefault(e["stream"], f"s{e['stream']}")
    return roles


def op_key(event: Dict, roles: Dict[int, str]) -> str:
    return f"{roles[event['stream']]}:{short_name(event)}"


def summarize(rank_events: List[List[Dict]]) -> str:
    """Per rank: each operation's median start and end (us) from that rank's start marker, the peer's too."""
    lines = []
    all_rounds = [rounds_of(events) for events in rank_events]
    roles = [stream_roles(events) for events in rank_events]
    for rank, rounds in enumerate(all_rounds):
        peer = 1 - rank if len(all_rounds) == 2 else None
        table = defaultdict(list)
        for i, rnd in enumerate(rounds):
            seen = defaultdict(int)
            for op in rnd["ops"]:
                key = op_key(op, roles[rank])
                seen[key] += 1
                table[f"{key}#{seen[key]}"].append((op["start"] - rnd["t0"], op["end"] - rnd["t0"]))
            table["caller: end marker starts"].append((rnd["end"] - rnd["t0"], rnd["end"] - rnd["t0"]))
            if peer is not None and i < len(all_rounds[peer]):
                other = all_rounds[peer][i]
                seen_peer = defaultdict(int)
                for op in other["ops"]:
                    key = f"peer {op_key(op, roles[peer])}"
                    seen_peer[key] += 1
                    table[f"{key}#{seen_peer[key]}"].append((op["start"] - rnd["t0"], op["end"] - rnd["t0"]))
                table["peer: end marker starts"].append((other["end"] - rnd["t0"], other["end"] - rnd["t0"]))
        lines.append(f"rank {rank}: {len(rounds)} combines; us from the start marker's end (median; min-max of start)")
        lines.append(f"{'operation (stream:name#n)':<52}{'start':>9}{'end':>9}{'takes':>9}{'start range':>18}")
        for key, spans in sorted(table.items(), key=lambda kv: statistics.median(s for s, _ in kv[1])):
            starts = [s for s, _ in spans]
            ends = [e for _, e in spans]
            takes = statistics.median(e - s for s, e in spans)
            lines.append(f"{key[:51]:<52}{statistics.median(starts):>9.1f}{statistics.median(ends):>9.1f}"
                         f"{takes:>9.1f}{min(starts):>9.1f}-{max(starts):<8.1f}")
        lines.append("")
    return "\n".join(lines)


def staging_tokens(text: str):
    return text if text == "auto" else int(text)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--num-sms", type=int, default=24)
    parser.add_argument("--lead-us", type=float, default=400.0, help="the caller's GPU sleep before each combine")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--staging-tokens", type=staging_tokens, default="auto",
                        help="buffer.combine_staging_tokens (auto: the copy engines at 2 ranks only; a number "
                             "profiles them at more ranks)")
    parser.add_argument("--out-dir", default="combine_timeline")
    parser.add_argument("--traces", nargs="*", help="only summarize these traces (rank order)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.traces:
        paths = args.traces
    else:
        results = parallel_launch(torch.cuda.device_count(), profile_rank, args, timeout_s=600)
        paths = [r["trace"] for r in sorted(results, key=lambda r: r["rank"])]
    text = summarize([gpu_events(p) for p in paths])
    print(text)
    with open(os.path.join(os.path.dirname(paths[0]) or ".", "summary.txt"), "w") as handle:
        handle.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
