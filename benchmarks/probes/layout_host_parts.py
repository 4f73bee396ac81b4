"""Where an eager `get_dispatch_layout` spends its host time on a GPU machine: the whole call and each
piece of it (allocations, views, the binding call, a launch), timed alone on rank 0 of 2, with DeepEP V1's
call beside it where `deep_ep` is importable. 128 tokens, top-8 of 256 experts, as profile_host.py --eager.

    python3 benchmarks/probes/layout_host_parts.py
"""
from __future__ import annotations

import time
from typing import Callable, Dict

import torch

import ep_plugin
from ep_plugin import _C
from ep_plugin.bench import random_routing
from ep_plugin.launch import parallel_launch, rank_device

TOKENS, EXPERTS, TOPK = 128, 256, 8


def median_us(step: Callable[[], object], iters: int = 400) -> str:
    """p50 and p10 host time of `step` in us (after a warm-up; the GPU drained before and after)."""
    for _ in range(50):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        begin = time.perf_counter_ns()
        step()
        times.append((time.perf_counter_ns() - begin) / 1e3)
    torch.cuda.synchronize()
    times.sort()
    return f"p50 {times[iters // 2]:6.1f} p10 {times[iters // 10]:6.1f}"


def pieces(buffer, device, topk_idx) -> Dict[str, Callable[[], object]]:
    backend = buffer._backend
    R = buffer.group_size
    per_rank = torch.empty(R, dtype=torch.int32, device=device)
    per_expert = torch.empty(EXPERTS, dtype=torch.int32, device=device)
    in_rank = torch.empty(TOKENS, R, dtype=torch.bool, device=device)
    stream = backend._stream()
    return {
        "Buffer.get_dispatch_layout": lambda: buffer.get_dispatch_layout(topk_idx, EXPERTS),
        "backend.get_dispatch_layout": lambda: backend.get_dispatch_layout(topk_idx, EXPERTS),
        f"torch.empty int32[{EXPERTS}]": lambda: torch.empty(EXPERTS, dtype=torch.int32, device=device),
        f"torch.empty bool[{TOKENS},{R}]": lambda: torch.empty(TOKENS, R, dtype=torch.bool, device=device),
        "a slice": lambda: per_expert[:EXPERTS // 2],
        "_C.get_dispatch_layout": lambda: _C.get_dispatch_layout(
            topk_idx.data_ptr(), TOKENS, TOPK, EXPERTS, R, R, per_rank.data_ptr(), 0, per_expert.data_ptr(),
            in_rank.data_ptr(), stream),
        "a torch launch (per_expert.zero_())": lambda: per_expert.zero_(),
    }


def probe_rank(rank: int, world_size: int, group) -> str:
    device = rank_device(rank)
    topk_idx = random_routing(TOKENS, EXPERTS, TOPK, device, torch.Generator().manual_seed(rank))
    buffer = ep_plugin.Buffer(group, 1 << 30, 0, explicitly_destroy=True)
    lines = [f"{name:34} {median_us(step)}" for name, step in pieces(buffer, device, topk_idx).items()]
    buffer.destroy()
    try:
        import deep_ep
    except ImportError:
        return "\n".join(lines)
    peer = deep_ep.Buffer(group, 1 << 30, 0, explicitly_destroy=True)
    lines.append(f"{'deep_ep get_dispatch_layout':34} {median_us(lambda: peer.get_dispatch_layout(topk_idx, EXPERTS))}")
    peer.destroy()
    return "\n".join(lines)


if __name__ == "__main__":
    print(parallel_launch(2, probe_rank, timeout_s=120)[0], flush=True)
