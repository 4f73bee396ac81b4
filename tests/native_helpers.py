"""Helpers shared by the native GPU tests (they run inside the spawned ranks).

Inputs for normal mode, exact comparison by bits, allocator poisoning, and CUDA-graph capture.
"""
from __future__ import annotations

from typing import Callable, Tuple

import torch

from ep_plugin.fp8 import quantize


def poison_allocator(megabytes: int = 512) -> None:
    """Fill soon-to-be-reused cached memory with 0x7F bytes (NaN in fp8, huge in bf16/fp32/int)."""
    block = torch.empty(megabytes << 20, dtype=torch.uint8, device="cuda")
    block.fill_(0x7F)
    del block


def make_routing(kind: str, T: int, E: int, K: int, R: int, gen: torch.Generator) -> torch.Tensor:
    E_local = E // R
    if kind == "random":
        idx = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
    elif kind == "minus_one":
        idx = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
        idx[torch.rand(T, K, generator=gen) < 0.3] = -1
    elif kind == "one_rank":  # every token only to rank 0's experts
        k = min(K, E_local)
        idx = torch.full((T, K), -1, dtype=torch.int64)
        idx[:, :k] = torch.rand(T, E_local, generator=gen).topk(k, dim=1).indices
    elif kind == "one_expert":  # every token to expert 3 only
        idx = torch.full((T, K), -1, dtype=torch.int64)
        idx[:, 0] = 3 % E
    elif kind == "unrouted":
        idx = torch.full((T, K), -1, dtype=torch.int64)
    else:
        raise ValueError(kind)
    return idx.to(torch.int64)


def make_inputs(rank: int, R: int, case: dict, seed: int):
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    T = 0 if case.get("empty_rank") and rank == R - 1 else case["T"]
    H, K, E = case["H"], case["K"], case["E"]
    topk_idx = make_routing(case.get("routing", "random"), T, E, K, R, gen).cuda()
    x = (torch.randn(T, H, generator=gen) * 3).to(torch.bfloat16).cuda()
    weights = torch.rand(T, K, generator=gen).cuda() if case.get("weights", True) else None
    payload = quantize(x, round_scale=False, use_ue8m0=False) if case.get("fp8") else x
    return payload, topk_idx, weights


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.dtype in (torch.bfloat16, torch.float32, torch.float8_e4m3fn) else t


def assert_same(name: str, got, want) -> None:
    if isinstance(want, tuple):
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(f"{name}[{i}]", g, w)
        return
    if want is None:
        assert got is None, f"{name}: expected None"
        return
    assert got.shape == want.shape and got.dtype == want.dtype, \
        f"{name}: {tuple(got.shape)} {got.dtype} != {tuple(want.shape)} {want.dtype}"
    if not torch.equal(bits(got), bits(want)):
        bad = (bits(got) != bits(want)).nonzero()[:5].tolist()
        raise AssertionError(f"{name}: values differ (first positions {bad})")


def rows(x, n: int):
    return tuple(t[:n] for t in x) if isinstance(x, tuple) else x[:n]


def capture_graph(step: Callable[[], object]) -> Tuple[torch.cuda.CUDAGraph, object]:
    """Run `step` once on a side stream (warm-up, outside capture), then capture it; returns (graph, outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs
