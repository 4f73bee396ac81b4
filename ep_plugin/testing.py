"""Helpers for comparing backends bit for bit (tests, `ep-plugin bench`, benchmarks/)."""
from __future__ import annotations

import torch

_FLOAT_DTYPES = (torch.float8_e4m3fn, torch.bfloat16, torch.float16, torch.float32)


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a float tensor as uint8 (equality that NaN and -0.0 cannot fool), of a bool tensor too
    (torch.equal takes any nonzero byte, e.g. memory no kernel wrote, for True); others as they are.

    Copies into a fresh tensor: `contiguous()` keeps the strides of a slice it considers contiguous
    already (an empty slice, or a column-major scale slice of one row), and `view` then refuses it.
    """
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    if t.dtype not in _FLOAT_DTYPES:
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t).view(torch.uint8)


# bf16's unit roundoff: rounding to bf16 moves a value by at most this fraction of it.
BF16_UNIT_ROUNDOFF = 2.0 ** -8


def assert_within_bf16_partials_bound(got: torch.Tensor, want: torch.Tensor, magnitude: torch.Tensor) -> None:
    """A combine whose per-rank partial sums were rounded to bf16 once (low-latency expert-side sums
    with `low_latency.expert_sums_partials: bf16`) against the reference's, elementwise.

    `magnitude` is the same combine of |x| with |weights| (A = the sum over k of |w * x|, which bounds
    every partial). With u = bf16's unit roundoff: |got - want| <= u * A (the partials' roundings) +
    u * (|got| + |want|) (both results' roundings), with margins for fp32 sums and for A being rounded.
    A NaN anywhere fails.
    """
    if got.shape != want.shape or got.dtype != want.dtype:
        raise AssertionError(f"combine result {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {want.dtype}")
    u, a, ref = BF16_UNIT_ROUNDOFF, magnitude.float(), want.float()
    bound = u * (1.02 * a + 2.02 * ref.abs()) + 1e-6 * a
    outside = ~((got.float() - ref).abs() <= bound)
    if outside.any():
        where = tuple(outside.nonzero()[0].tolist())
        raise AssertionError(f"combine with bf16 partials: {int(outside.sum())} of {got.numel()} elements outside "
                             f"the rounding bound; first at {list(where)}: got {got[where].item()}, want "
                             f"{want[where].item()}, bound {bound[where].item():.3g}")
