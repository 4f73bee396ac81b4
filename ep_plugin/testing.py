"""Helpers for comparing backends bit for bit (tests, `ep-plugin bench`, benchmarks/)."""
from __future__ import annotations

import torch

_FLOAT_DTYPES = (torch.float8_e4m3fn, torch.bfloat16, torch.float16, torch.float32)


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a float tensor as uint8 (equality that NaN and -0.0 cannot fool); others as they are.

    Copies into a fresh tensor: `contiguous()` keeps the strides of a slice it considers contiguous
    already (an empty slice, or a column-major scale slice of one row), and `view` then refuses it.
    """
    if t.dtype not in _FLOAT_DTYPES:
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t).view(torch.uint8)
