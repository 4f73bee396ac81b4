"""Shrink mode (rank masking) in the native low-latency kernels (ep_plugin/masking.py), on GPUs.

The last rank is the one masked: by the API (every other rank masks it, it masks every other rank), or
because it exits before a low-latency dispatch or before a combine (the survivors' waits for it pass
`timeout_s` and mask it on the device). Every rank's results must equal the dense oracle of a run in
which each rank's mask drops the masked ranks' tokens and counts their experts' outputs as zero,
computed from every rank's inputs: recv_count and the copied rows bit for bit, the combine within
bf16 rounding. Outputs are poisoned before each call; slots past an expert's count hold NaN in the
expert outputs, so reading one shows. A survivor's call that masks a dead rank ends within
timeout_s + a few seconds and leaves the CUDA context usable: the next call skips the rank at once.
EP_TEST_RANKS ranks (default 2); EP_TEST_SEED replays one run.
"""
from __future__ import annotations

import os
import random
import time
from typing import Dict, List, Set

import pytest
import torch
import torch.distributed as dist

import dense_oracle as oracle
from ep_plugin import Buffer
from ep_plugin.launch import finish_rank, parallel_launch
from ep_plugin.testing import assert_within_bf16_partials_bound, raw_bytes
from native_helpers import capture_graph, multi_gpu_ranks, needs_ranks, poison_allocator

try:
    from ep_plugin import _C_nvshmem
except ImportError:
    _C_nvshmem = None

RANKS = multi_gpu_ranks()
BASE_SEED = int(os.environ.get("EP_TEST_SEED", random.SystemRandom().randrange(1 << 30)))
needs_gpus = needs_ranks(RANKS, module=_C_nvshmem)

T_MAX, H, K, LOCAL_EXPERTS = 32, 1024, 4, 4
TIMEOUT_S = 3.0
FAST_S = 1.0  # a call that waits for no masked rank


def num_experts(R: int) -> int:
    return LOCAL_EXPERTS * R


# ---- inputs and the oracle (the same on every rank) ----------------------------------------------------
def inputs(src: int, R: int, seed: int):
    """Rank `src`'s (x [T, H] bf16, topk_idx [T, K] int64 with -1 entries, weights [T, K] float32)."""
    gen = torch.Generator().manual_seed(seed * 1000 + src)
    T = int(torch.randint(1, T_MAX + 1, (1,), generator=gen))
    ids = torch.rand(T, num_experts(R), generator=gen).argsort(dim=1)[:, :K]
    ids[torch.rand(T, K, generator=gen) < 0.2] = -1
    x = (torch.randn(T, H, generator=gen) * 2).to(torch.bfloat16)
    return x, ids, torch.rand(T, K, generator=gen)


def exchanged(ids: torch.Tensor, src: int, masked: Set[int], R: int) -> torch.Tensor:
    """`src`'s topk_idx as a rank that masks `masked` exchanges it: a masked source's tokens dropped, the
    entries of masked ranks' experts -1."""
    if src in masked:
        return torch.full_like(ids, -1)
    owner_masked = torch.zeros(R, dtype=torch.bool)
    owner_masked[sorted(masked)] = True
    return torch.where((ids >= 0) & owner_masked[ids.clamp(min=0) // LOCAL_EXPERTS], -1, ids)


def expert_output(rows: torch.Tensor, expert: int) -> torch.Tensor:
    return (rows.float() * (expert % 5 + 1) * 0.5).to(torch.bfloat16)


def expected(rank: int, R: int, seed: int, dispatch_masked: Set[int], combine_masked: Set[int]) -> Dict:
    """What `rank` must get when its dispatch masks `dispatch_masked` and its combine `combine_masked`
    (every other rank's mask agrees: no rank sends to a rank that does not receive from it)."""
    E = num_experts(R)
    xs, ids, weights = zip(*(inputs(src, R, seed) for src in range(R)))
    kept = [exchanged(ids[src], src, dispatch_masked, R) for src in range(R)]
    outputs, magnitudes = [], []
    for dst in range(R):
        got = oracle.low_latency_dispatch(dst, E, list(xs), kept, use_fp8=False)
        out = torch.full((LOCAL_EXPERTS, R * T_MAX, H), float("nan"), dtype=torch.bfloat16)
        for j, rows in enumerate(got["rows"]):
            out[j, :rows.size(0)] = expert_output(rows, dst * LOCAL_EXPERTS + j)
        outputs.append(out)
        magnitudes.append(out.abs())
        if dst == rank:
            mine = got
    combine_ids = exchanged(kept[rank], rank, combine_masked, R)
    combined = oracle.low_latency_combine(rank, E, kept, combine_ids, weights[rank], outputs)
    magnitude = oracle.low_latency_combine(rank, E, kept, combine_ids, weights[rank], magnitudes)
    return dict(recv_count=mine["recv_count"], rows=mine["rows"], combined=combined, magnitude=magnitude)


# ---- one round on a rank ---------------------------------------------------------------------------
def make_buffer(group, R: int) -> Buffer:
    size = Buffer.get_low_latency_rdma_size_hint(T_MAX, H, R, num_experts(R))
    buffer = Buffer(group, 0, size, low_latency_mode=True, explicitly_destroy=True, enable_shrink=True,
                    config={"backend": "native", "timeout_s": TIMEOUT_S, "transport": "nvlink"})
    assert buffer.backend_name == "native"
    return buffer


def check_dispatch(rank: int, recv_x: torch.Tensor, recv_count: torch.Tensor, want: Dict) -> List[str]:
    failures = []
    if recv_count.tolist() != want["recv_count"]:
        failures.append(f"recv_count {recv_count.tolist()} != {want['recv_count']}")
        return failures
    for j, rows in enumerate(want["rows"]):
        if not torch.equal(raw_bytes(recv_x[j, :rows.size(0)].cpu()), raw_bytes(rows)):
            failures.append(f"rows of local expert {j} differ")
    return failures


def expert_outputs(rank: int, recv_x: torch.Tensor, recv_count: torch.Tensor) -> torch.Tensor:
    out = torch.full_like(recv_x, float("nan"))
    for j, count in enumerate(recv_count.tolist()):
        out[j, :count] = expert_output(recv_x[j, :count], rank * LOCAL_EXPERTS + j)
    return out


def check_combined(combined: torch.Tensor, want: Dict, expert_sums: bool) -> List[str]:
    try:
        if expert_sums:  # partials rounded to bf16 once (low_latency.expert_sums_partials: bf16)
            assert_within_bf16_partials_bound(combined.cpu(), want["combined"], want["magnitude"])
        else:
            torch.testing.assert_close(combined.cpu(), want["combined"], rtol=1e-2, atol=1e-2)
    except AssertionError as error:
        return [f"combine: {error}"]
    return []


def ll_round(buffer: Buffer, rank: int, R: int, seed: int, want: Dict, expert_sums: bool = False):
    """One dispatch + combine of `rank`'s inputs of `seed`, checked against `want`; every call is made
    whatever the checks find. Returns (seconds the two calls took, failures)."""
    x, ids, weights = (t.cuda() for t in inputs(rank, R, seed))
    route = dict(topk_weights=weights) if expert_sums else {}
    poison_allocator(64)
    started = time.monotonic()
    recv_x, recv_count, handle, _, _ = buffer.low_latency_dispatch(x, ids, T_MAX, num_experts(R), use_fp8=False,
                                                                   **route)
    torch.cuda.synchronize()
    seconds = time.monotonic() - started
    failures = check_dispatch(rank, recv_x, recv_count, want)
    out = expert_outputs(rank, recv_x, recv_count)
    poison_allocator(64)
    started = time.monotonic()
    combined, _, _ = buffer.low_latency_combine(out, ids, weights, handle)
    torch.cuda.synchronize()
    seconds += time.monotonic() - started
    return seconds, failures + check_combined(combined, want, expert_sums)


def query(buffer: Buffer, R: int) -> List[int]:
    status = torch.full((R,), 7, dtype=torch.int32, device="cuda")
    buffer.low_latency_query_mask_buffer(status)
    return status.tolist()


def tagged(what: str, failures: List[str]) -> List[str]:
    return [f"{what}: {failure}" for failure in failures]


# ---- masked by the API ---------------------------------------------------------------------------------
def graph_round(buffer: Buffer, group, rank: int, R: int, seed: int, wants: Dict[str, Dict]) -> List[str]:
    """A dispatch + combine captured once with no rank masked, replayed with and without the mask: each
    replay reads the mask of the moment."""
    x, ids, weights = (t.cuda() for t in inputs(rank, R, seed))
    scale = torch.tensor([e % 5 + 1 for e in range(rank * LOCAL_EXPERTS, (rank + 1) * LOCAL_EXPERTS)],
                         dtype=torch.float32, device="cuda").view(-1, 1, 1) * 0.5

    def step():
        recv_x, recv_count, handle, _, _ = buffer.low_latency_dispatch(x, ids, T_MAX, num_experts(R), use_fp8=False)
        out = (recv_x.float() * scale).to(torch.bfloat16)  # expert_output of every slot (past a count: unread)
        combined, _, _ = buffer.low_latency_combine(out, ids, weights, handle)
        return recv_x, recv_count, combined

    graph, (recv_x, recv_count, combined) = capture_graph(step)
    failures = []
    for name in ("masked", "unmasked", "masked"):
        set_mask(buffer, rank, R, masked=name == "masked")
        torch.cuda.synchronize()
        dist.barrier(group=group)
        recv_x.fill_(float("nan"))
        recv_count.fill_(-1)
        combined.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        failures += tagged(f"graph replay {name}", check_dispatch(rank, recv_x, recv_count, wants[name]) +
                           check_combined(combined, wants[name], False))
    set_mask(buffer, rank, R, masked=False)
    return failures


def masked_by(rank: int, R: int) -> Set[int]:
    """The ranks `rank` masks in the API case: the last rank, or (on the last rank) every other one."""
    gone = R - 1
    return {gone} if rank != gone else set(range(R)) - {rank}


def set_mask(buffer: Buffer, rank: int, R: int, masked: bool) -> None:
    for other in masked_by(rank, R):
        buffer.low_latency_update_mask_buffer(other, masked)


def api_rank(rank: int, R: int, group, seed: int) -> Dict:
    masked = masked_by(rank, R)
    # NOTE: the oracle first: a rank still computing it when its peers call would be masked.
    wants = {s: expected(rank, R, seed + s, masked if s in (1, 2) else set(), masked if s in (1, 2) else set())
             for s in range(4)}
    graph_wants = {"unmasked": expected(rank, R, seed + 4, set(), set()),
                   "masked": expected(rank, R, seed + 4, masked, masked)}
    buffer = make_buffer(group, R)
    failures, seconds = [], {}
    dist.barrier(group=group)
    seconds["unmasked"], found = ll_round(buffer, rank, R, seed, wants[0])
    failures += tagged("unmasked", found)
    set_mask(buffer, rank, R, masked=True)
    status_masked = query(buffer, R)
    dist.barrier(group=group)
    seconds["masked"], found = ll_round(buffer, rank, R, seed + 1, wants[1])
    failures += tagged("masked", found)
    seconds["masked_expert_sums"], found = ll_round(buffer, rank, R, seed + 2, wants[2], expert_sums=True)
    failures += tagged("masked, expert-side sums", found)
    status_after = query(buffer, R)  # no wait timed out: the API's mask only
    buffer.low_latency_clean_mask_buffer()
    status_clean = query(buffer, R)
    dist.barrier(group=group)
    seconds["cleaned"], found = ll_round(buffer, rank, R, seed + 3, wants[3])
    failures += tagged("after clean", found)
    failures += graph_round(buffer, group, rank, R, seed + 4, graph_wants)
    torch.cuda.synchronize()
    buffer.destroy()
    return dict(failures=failures, seconds=seconds, masked=sorted(masked), status_masked=status_masked,
                status_after=status_after, status_clean=status_clean)


@needs_gpus
def test_masked_by_the_api_matches_the_masked_oracle():
    results = parallel_launch(RANKS, api_rank, BASE_SEED, backend="gloo", timeout_s=240)
    context = f"EP_TEST_SEED={BASE_SEED}, {RANKS} ranks"
    for rank, result in enumerate(results):
        assert not result["failures"], f"rank {rank} ({context}):\n" + "\n".join(result["failures"])
        want_status = [int(r in result["masked"]) for r in range(RANKS)]
        assert result["status_masked"] == want_status and result["status_after"] == want_status, (rank, result)
        assert result["status_clean"] == [0] * RANKS, (rank, result)
        for name in ("masked", "masked_expert_sums", "cleaned"):
            assert result["seconds"][name] < FAST_S, (rank, name, result["seconds"], context)


# ---- a rank that exits ----------------------------------------------------------------------------------
def exiting_rank(rank: int, R: int, group, seed: int, before: str) -> object:
    """The last rank makes one full round, then exits before the next dispatch (`before` = "dispatch") or
    after it, before the combine ("combine"). The survivors' round masks it; the one after skips it."""
    gone = R - 1
    dispatch_masked = {gone} if before == "dispatch" else set()
    wants = [expected(rank, R, seed, set(), set()), expected(rank, R, seed + 1, dispatch_masked, {gone}),
             expected(rank, R, seed + 2, {gone}, {gone})]
    buffer = make_buffer(group, R)
    dist.barrier(group=group)
    _, failures = ll_round(buffer, rank, R, seed, wants[0])
    failures = tagged("all ranks", failures)
    torch.cuda.synchronize()
    dist.barrier(group=group)  # the last collective: a peer exits after it
    if rank == gone:
        if before == "combine":
            x, ids, _ = (t.cuda() for t in inputs(rank, R, seed + 1))
            buffer.low_latency_dispatch(x, ids, T_MAX, num_experts(R), use_fp8=False)
            torch.cuda.synchronize()
        finish_rank("gone")
    seconds_masking, found = ll_round(buffer, rank, R, seed + 1, wants[1])
    failures += tagged("the round that masks", found)
    status_masking = query(buffer, R)
    seconds_after, found = ll_round(buffer, rank, R, seed + 2, wants[2])
    failures += tagged("the round after", found)
    status_after = query(buffer, R)
    buffer.low_latency_clean_mask_buffer()
    status_clean = query(buffer, R)
    # NOTE: no destroy: it is a collective, and a peer is gone (the process ends here).
    finish_rank(dict(failures=failures, seconds_masking=seconds_masking, seconds_after=seconds_after,
                     status_masking=status_masking, status_after=status_after, status_clean=status_clean))


@needs_gpus
@pytest.mark.parametrize("before", ["dispatch", "combine"])
def test_a_rank_that_exits_is_masked_and_the_survivors_go_on(before):
    results = parallel_launch(RANKS, exiting_rank, BASE_SEED, before, backend="gloo", timeout_s=180)
    context = f"EP_TEST_SEED={BASE_SEED}, {RANKS} ranks"
    assert results[RANKS - 1] == "gone"
    want_status = [int(r == RANKS - 1) for r in range(RANKS)]
    for rank, result in enumerate(results[:-1]):
        assert not result["failures"], f"rank {rank} ({context}):\n" + "\n".join(result["failures"])
        assert result["status_masking"] == want_status and result["status_after"] == want_status, (rank, result)
        assert result["status_clean"] == [0] * RANKS, (rank, result)
        assert result["seconds_masking"] < TIMEOUT_S + 4.0, (rank, result, context)
        assert result["seconds_after"] < FAST_S, (rank, result, context)
