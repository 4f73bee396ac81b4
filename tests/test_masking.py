"""Rank masking in low-latency mode (ep_plugin/masking.py) on the reference backend: 3 gloo ranks.

Rank 2 is gone (never calls, or exits); ranks 0 and 1 run low-latency dispatch and combine with it
masked (by hand, or by the timeout of shrink mode). Their outputs must equal the dense oracle of a
run where rank 2's tokens are dropped and its experts' outputs count as zero. Unused slots of the
expert outputs are NaN, so reading one shows.
"""
from __future__ import annotations

import time

import pytest
import torch

import dense_oracle as oracle
import ep_plugin
from ep_plugin.launch import finish_rank, parallel_launch
from ep_plugin.masking import MaskedExchange, RankMask

R, GONE = 3, 2
T_MAX, H, K, E = 8, 32, 3, 6
TIMEOUT_S = 2.0


def inputs(rank: int, seed: int):
    generator = torch.Generator().manual_seed(seed * 100 + rank)
    num_tokens = int(torch.randint(1, T_MAX + 1, (1,), generator=generator))
    x = torch.randn(num_tokens, H, generator=generator).to(torch.bfloat16)
    topk_idx = torch.stack([torch.randperm(E, generator=generator)[:K] for _ in range(num_tokens)])
    topk_idx[torch.rand(num_tokens, K, generator=generator) < 0.2] = -1
    return x, topk_idx, torch.rand(num_tokens, K, generator=generator)


def expert_output(rows: torch.Tensor, expert: int) -> torch.Tensor:
    return (rows.float() * (expert + 1)).to(torch.bfloat16)


def without_gone(topk_idx: torch.Tensor, src: int) -> torch.Tensor:
    """topk_idx as the survivors see it: rank GONE's tokens dropped, its experts' entries -1."""
    if src == GONE:
        return torch.full_like(topk_idx, -1)
    return torch.where(topk_idx // (E // R) == GONE, -1, topk_idx)


def expected(rank: int, seed: int):
    """(recv_count, per-expert rows, combined) that `rank` must get."""
    xs, ids, weights = zip(*(inputs(r, seed) for r in range(R)))
    kept = [without_gone(i, src) for src, i in enumerate(ids)]
    combine_xs = []
    for dst in range(R):
        got = oracle.low_latency_dispatch(dst, E, list(xs), kept, use_fp8=False)
        out = torch.full((E // R, R * T_MAX, H), float("nan"), dtype=torch.bfloat16)
        for j, rows in enumerate(got["rows"]):
            out[j, :rows.size(0)] = expert_output(rows, dst * (E // R) + j)
        combine_xs.append(out)
        if dst == rank:
            mine = got
    combined = oracle.low_latency_combine(rank, E, kept, kept[rank], weights[rank], combine_xs)
    return mine["recv_count"], mine["rows"], combined


def survivor_round(buffer: ep_plugin.Buffer, rank: int, seed: int, want) -> float:
    """One dispatch + combine checked against the oracle's `want`; returns the seconds the two calls took."""
    x, topk_idx, weights = inputs(rank, seed)
    want_count, want_rows, want_combined = want
    started = time.monotonic()
    recv_x, recv_count, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, T_MAX, E, use_fp8=False)
    seconds = time.monotonic() - started
    assert recv_count.tolist() == want_count, (recv_count.tolist(), want_count)
    out = torch.full_like(recv_x, float("nan"))
    for j, rows in enumerate(want_rows):
        assert torch.equal(recv_x[j, :rows.size(0)].view(torch.int16), rows.view(torch.int16)), f"expert {j}"
        out[j, :rows.size(0)] = expert_output(recv_x[j, :rows.size(0)], rank * (E // R) + j)
    started = time.monotonic()
    combined, _, _ = buffer.low_latency_combine(out, topk_idx, weights, handle)
    seconds += time.monotonic() - started
    torch.testing.assert_close(combined, want_combined, rtol=0, atol=0)
    return seconds


def masking_rank(rank: int, world: int, group, how: str):
    # NOTE: the oracle runs first: a rank still computing it when its peer calls would be masked.
    wants = {seed: expected(rank, seed) for seed in (1, 2)}
    buffer = ep_plugin.Buffer(group, low_latency_mode=True, enable_shrink=True,
                              config={"backend": "reference", "timeout_s": TIMEOUT_S})
    if rank == GONE:
        if how == "exits":
            finish_rank("gone")  # its connections close
        time.sleep(2 * TIMEOUT_S + 6)  # never calls
        finish_rank("gone")
    if how == "masked_by_hand":
        buffer.low_latency_update_mask_buffer(GONE, True)
    seconds = [survivor_round(buffer, rank, seed, wants[seed]) for seed in (1, 2)]
    status = torch.full((R,), 7, dtype=torch.int32)
    buffer.low_latency_query_mask_buffer(status)
    masked = status.tolist()
    buffer.low_latency_clean_mask_buffer()
    buffer.low_latency_query_mask_buffer(status)
    finish_rank(dict(seconds=seconds, masked=masked, after_clean=status.tolist()))


@pytest.mark.parametrize("how", ["masked_by_hand", "exits", "never_calls"])
def test_survivors_finish_without_the_masked_rank(how):
    results = parallel_launch(R, masking_rank, how, backend="gloo", timeout_s=90)
    assert results[GONE] == "gone"
    for rank in (0, 1):
        result = results[rank]
        assert result["masked"] == [0, 0, 1] and result["after_clean"] == [0, 0, 0], result
        first, second = result["seconds"]
        # Shrink mode masks a silent peer after the timeout; later calls skip it at once.
        assert first < (1.0 if how == "masked_by_hand" else TIMEOUT_S + 4.0), result
        assert second < 1.0, result


def test_a_peer_whose_connection_is_gone_when_posting_is_masked(monkeypatch):
    """gloo raises at once when a transfer is posted to a peer that has exited (its connection closed)."""
    def gone(rows, peer, group=None, tag=0):
        raise RuntimeError("Read error: Connection reset by peer")

    monkeypatch.setattr(torch.distributed, "isend", gone)
    monkeypatch.setattr(torch.distributed, "irecv", gone)
    exchange = MaskedExchange.__new__(MaskedExchange)
    exchange.mask, exchange.group, exchange.timeout_s = RankMask(rank=0, num_ranks=2), None, 1.0
    exchange.global_ranks, exchange._abandoned_sends = [0, 1], []
    send = torch.arange(12, dtype=torch.uint8).view(3, 4)
    recv = exchange.all_to_all(send, [1, 2], [1, 3])
    assert exchange.mask.masked == [False, True]
    assert torch.equal(recv[:1], send[:1]) and not recv[1:].any()  # its own row, and zeros from the masked peer


def test_rank_mask_checks_its_arguments():
    mask = RankMask(rank=1, num_ranks=4)
    with pytest.raises(ValueError, match="rank_to_mask"):
        mask.update(4, True)
    with pytest.raises(ValueError, match="cannot mask itself"):
        mask.update(1, True)
    with pytest.raises(ValueError, match="int32"):
        mask.query(torch.zeros(4, dtype=torch.int64))
    mask.update(3, True)
    status = torch.zeros(4, dtype=torch.int32)
    mask.query(status)
    assert status.tolist() == [0, 0, 0, 1]
    ids = torch.tensor([[0, 7, -1], [6, 3, 2]])
    assert mask.expert_is_masked(ids, 8).tolist() == [[False, True, False], [True, False, False]]


def no_shrink_rank(rank: int, world: int, group):
    buffer = ep_plugin.Buffer(group, low_latency_mode=True, config={"backend": "reference"})
    try:
        buffer.low_latency_update_mask_buffer(1, True)
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_masking_needs_enable_shrink():
    assert all("enable_shrink=True" in r for r in parallel_launch(2, no_shrink_rank, backend="gloo", timeout_s=60))
