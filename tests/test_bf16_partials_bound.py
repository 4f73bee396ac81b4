"""The rounding bound the low-latency tests hold bf16 expert-side partials to (CPU).

The GPU kernel sums each token's columns per rank in fp32 (k order), rounds a peer's partial to bf16,
and the token's rank adds the partials in rank order in fp32, then rounds to bf16. Emulated here in
torch on random data, with heavy cancellation between ranks: the bound must hold for every element,
and must reject a combine that lost or doubled a partial.
"""
from __future__ import annotations

import pytest
import torch

from ep_plugin.testing import assert_within_bf16_partials_bound


def _columns(seed: int, T: int = 64, K: int = 8, H: int = 512):
    gen = torch.Generator().manual_seed(seed)
    rows = (torch.randn(T, K, H, generator=gen) * torch.rand(T, 1, 1, generator=gen) * 10).to(torch.bfloat16)
    weights = torch.rand(T, K, generator=gen)
    # Cancellation: the second half of the columns repeats the first with negated rows, slightly perturbed.
    rows[:, K // 2:] = (-rows[:, :K // 2].float() * (1 + 1e-3 * torch.randn(T, K // 2, H, generator=gen))).to(rows.dtype)
    weights[:, K // 2:] = weights[:, :K // 2]
    rank_of_column = (torch.arange(K) >= K // 2).long()  # the halves on two ranks: large partials, a small sum
    return rows, weights, rank_of_column


def _k_order_sum(rows: torch.Tensor, weights: torch.Tensor, columns) -> torch.Tensor:
    acc = torch.zeros(rows.shape[0], rows.shape[2])
    for k in columns:
        acc = acc + weights[:, k:k + 1] * rows[:, k].float()
    return acc


def _reference(rows, weights):
    return _k_order_sum(rows, weights, range(rows.shape[1])).to(torch.bfloat16)


def _magnitude(rows, weights):
    return _k_order_sum(rows.abs(), weights.abs(), range(rows.shape[1])).to(torch.bfloat16)


def _expert_side(rows, weights, rank_of_column, own_rank: int = 0, drop_rank=None, double_rank=None):
    """What the kernel computes: per-rank fp32 partials, a peer's rounded to bf16, added in rank order."""
    total = torch.zeros(rows.shape[0], rows.shape[2])
    for r in (0, 1):
        partial = _k_order_sum(rows, weights, [k for k in range(rows.shape[1]) if rank_of_column[k] == r])
        if r != own_rank:
            partial = partial.to(torch.bfloat16).float()
        if r == drop_rank:
            continue
        total = total + partial * (2 if r == double_rank else 1)
    return total.to(torch.bfloat16)


@pytest.mark.parametrize("seed", range(6))
def test_bound_holds_for_bf16_partials_with_cancellation(seed):
    rows, weights, ranks = _columns(seed)
    want = _reference(rows, weights)
    got = _expert_side(rows, weights, ranks, own_rank=seed % 2)
    assert not torch.equal(got, want), "the data must exercise the extra rounding"
    assert_within_bf16_partials_bound(got, want, _magnitude(rows, weights))


@pytest.mark.parametrize("fault", ["drop", "double"])
def test_bound_rejects_a_lost_or_doubled_partial(fault):
    rows, weights, ranks = _columns(7)
    got = _expert_side(rows, weights, ranks, drop_rank=1 if fault == "drop" else None,
                       double_rank=1 if fault == "double" else None)
    with pytest.raises(AssertionError, match="outside the rounding bound"):
        assert_within_bf16_partials_bound(got, _reference(rows, weights), _magnitude(rows, weights))


def test_bound_rejects_nan_and_shape_mismatch():
    rows, weights, ranks = _columns(8)
    want, magnitude = _reference(rows, weights), _magnitude(rows, weights)
    got = want.clone()
    got[3, 5] = float("nan")
    with pytest.raises(AssertionError, match="1 of"):
        assert_within_bf16_partials_bound(got, want, magnitude)
    with pytest.raises(AssertionError, match="combine result"):
        assert_within_bf16_partials_bound(want[:, :10], want, magnitude)
