"""The GPU-idle gaps of a torch.profiler Chrome trace, each with the host op running when it began.

    python3 benchmarks/probes/trace_gaps.py TRACE.json [--top 15]
"""
from __future__ import annotations

import argparse
import json
from typing import Dict, List, Tuple

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATEGORIES = ("cpu_op", "user_annotation", "python_function")


def load_events(path: str) -> List[Dict]:
    with open(path) as handle:
        data = json.load(handle)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def busy_intervals(events: List[Dict]) -> List[Tuple[float, float]]:
    """The union of GPU activity intervals, sorted."""
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in GPU_CATEGORIES)
    merged: List[Tuple[float, float]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def innermost_host_op(host_ops: List[Dict], at: float) -> str:
    """The shortest host op that contains time `at` (the most specific one)."""
    best = None
    for op in host_ops:
        if op["ts"] <= at <= op["ts"] + op["dur"] and (best is None or op["dur"] < best["dur"]):
            best = op
    return best["name"] if best else "(no host op)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    events = load_events(args.trace)
    busy = busy_intervals(events)
    if not busy:
        print("no GPU activity in the trace")
        return 1
    host_ops = [e for e in events if e.get("cat") in HOST_CATEGORIES]
    span = busy[-1][1] - busy[0][0]
    busy_us = sum(end - start for start, end in busy)
    gaps = sorted(((busy[i + 1][0] - busy[i][1], busy[i][1]) for i in range(len(busy) - 1)), reverse=True)
    print(f"span {span / 1e3:.3f} ms, GPU busy {busy_us / 1e3:.3f} ms ({100 * busy_us / span:.0f}%), "
          f"idle {(span - busy_us) / 1e3:.3f} ms in {len(gaps)} gaps")
    print(f"{'gap us':>9}  {'at ms':>8}  host op when the gap began")
    for length, at in gaps[:args.top]:
        print(f"{length:9.1f}  {(at - busy[0][0]) / 1e3:8.3f}  {innermost_host_op(host_ops, at)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
