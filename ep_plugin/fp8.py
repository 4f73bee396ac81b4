"""Per-token block FP8 (e4m3) quantisation: the definition every backend must match bit for bit.

For each token and each block b of channels `[128 b, min(128 b + 128, H))` (the last block may be
partial):

    xf        = float32(x)
    amax      = max(max |xf| over the block, 1e-4)
    scale_inv = amax / 448                      float32 division, correctly rounded
    if round_scale:                             next power of two >= scale_inv, on the float32 bits:
        bits = (bits & 0x7F800000) + 0x00800000 if bits & 0x007FFFFF else bits
    q         = float8_e4m3fn(clamp(xf / scale_inv, -448, 448))   round to nearest even

`x ~= q * scale_inv`. UE8M0 keeps only the exponent byte of each (power-of-two) `scale_inv`,
`byte_b = (bits(scale_inv_b) >> 23) & 0xFF`, four blocks per int32 word:
`word_j = byte_4j | byte_4j+1 << 8 | byte_4j+2 << 16 | byte_4j+3 << 24` (missing blocks are 0).

Implementation notes: divisions are tensor-by-tensor (`a / b` with a scalar `b` may be computed
as `a * (1 / b)` on CUDA, which rounds differently); no log2/exp2.
"""
from __future__ import annotations

from typing import Tuple

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128
AMAX_FLOOR = 1e-4

_EXPONENT_MASK = 0x7F800000
_MANTISSA_MASK = 0x007FFFFF
_EXPONENT_ONE = 0x00800000


def num_blocks(hidden: int) -> int:
    """Scale blocks per token: ceil(hidden / 128)."""
    return (hidden + BLOCK - 1) // BLOCK


def num_ue8m0_words(hidden: int) -> int:
    """int32 words of packed UE8M0 scales per token: ceil(ceil(hidden / 128) / 4)."""
    return (num_blocks(hidden) + 3) // 4


def round_up_to_power_of_two(scale_inv: torch.Tensor) -> torch.Tensor:
    """Positive normal float32 values -> the smallest power of two >= each, by integer bit ops."""
    if scale_inv.dtype != torch.float32:
        raise TypeError(f"scale_inv must be float32, got {scale_inv.dtype}")
    bits = scale_inv.contiguous().view(torch.int32)
    rounded = torch.where((bits & _MANTISSA_MASK) != 0, (bits & _EXPONENT_MASK) + _EXPONENT_ONE, bits)
    return rounded.view(torch.float32)


def block_scales(x: torch.Tensor, round_scale: bool = False) -> torch.Tensor:
    """`[..., H]` -> float32 `scale_inv` `[..., ceil(H / 128)]` per the spec above."""
    hidden = x.size(-1)
    blocks = num_blocks(hidden)
    xf = x.float()
    padded = torch.nn.functional.pad(xf.abs(), (0, blocks * BLOCK - hidden))  # |0| never raises a max
    amax = padded.reshape(*x.shape[:-1], blocks, BLOCK).amax(dim=-1).clamp_min(AMAX_FLOOR)
    scale_inv = amax / torch.full_like(amax, FP8_MAX)
    return round_up_to_power_of_two(scale_inv) if round_scale else scale_inv


def expand_blocks(scales: torch.Tensor, hidden: int) -> torch.Tensor:
    """`[..., ceil(H / 128)]` per-block values -> `[..., H]` per-channel values."""
    return scales.repeat_interleave(BLOCK, dim=-1)[..., :hidden]


def pack_ue8m0(scale_inv: torch.Tensor) -> torch.Tensor:
    """float32 power-of-two scales `[..., B]` -> int32 `[..., ceil(B / 4)]`, block 4j in the low byte."""
    if scale_inv.dtype != torch.float32:
        raise TypeError(f"scale_inv must be float32, got {scale_inv.dtype}")
    blocks = scale_inv.size(-1)
    words = (blocks + 3) // 4
    exponent = (scale_inv.contiguous().view(torch.int32) >> 23) & 0xFF
    exponent = torch.nn.functional.pad(exponent.long(), (0, words * 4 - blocks))  # missing blocks -> 0
    exponent = exponent.reshape(*scale_inv.shape[:-1], words, 4)
    word = exponent[..., 0] | (exponent[..., 1] << 8) | (exponent[..., 2] << 16) | (exponent[..., 3] << 24)
    word = torch.where(word >= 1 << 31, word - (1 << 32), word)  # the int32 with the same 32 bits
    return word.to(torch.int32)


def unpack_ue8m0(packed: torch.Tensor, blocks: int) -> torch.Tensor:
    """int32 `[..., W]` packed UE8M0 -> float32 scales `[..., blocks]` (2 ** (byte - 127))."""
    if packed.dtype != torch.int32:
        raise TypeError(f"packed UE8M0 scales must be int32, got {packed.dtype}")
    if not blocks <= packed.size(-1) * 4:
        raise ValueError(f"{packed.size(-1)} words hold at most {packed.size(-1) * 4} blocks, asked for {blocks}")
    shifts = torch.tensor([0, 8, 16, 24], dtype=torch.int64, device=packed.device)
    exponent = ((packed.long() & 0xFFFFFFFF).unsqueeze(-1) >> shifts) & 0xFF
    exponent = exponent.reshape(*packed.shape[:-1], packed.size(-1) * 4)[..., :blocks]
    return (exponent << 23).to(torch.int32).view(torch.float32)


def quantize(x: torch.Tensor, round_scale: bool = False, use_ue8m0: bool = False
             ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantise `x` `[..., H]` (bf16 or any float) per token and 128-channel block.

    Returns:
        q: float8_e4m3fn `[..., H]`.
        scales: float32 `scale_inv` `[..., ceil(H / 128)]`, or with `use_ue8m0` int32
            `[..., ceil(ceil(H / 128) / 4)]` (packed exponent bytes). Row-major.
    """
    if use_ue8m0 and not round_scale:
        raise ValueError("use_ue8m0=True needs round_scale=True (UE8M0 scales are powers of two)")
    if x.dim() < 1 or x.size(-1) < 1:
        raise ValueError(f"x must have a non-empty last dimension, got shape {tuple(x.shape)}")
    scale_inv = block_scales(x, round_scale)
    xf = x.float()
    q = (xf / expand_blocks(scale_inv, x.size(-1))).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, (pack_ue8m0(scale_inv) if use_ue8m0 else scale_inv)


def dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float8 `[..., H]` and its scales (float32 `[..., B]` or packed UE8M0 int32) -> float32 `[..., H]`."""
    hidden = q.size(-1)
    if scales.dtype == torch.int32:
        scales = unpack_ue8m0(scales, num_blocks(hidden))
    elif scales.dtype != torch.float32:
        raise TypeError(f"scales must be float32 or int32 (UE8M0), got {scales.dtype}")
    if scales.size(-1) != num_blocks(hidden):
        raise ValueError(f"hidden {hidden} needs {num_blocks(hidden)} scales per token, got {scales.size(-1)}")
    return q.float() * expand_blocks(scales, hidden)
