"""Reference backend, low-latency mode, through the public `ep_plugin.Buffer`; and `ep_plugin.fp8`.

low_latency_dispatch (bf16; FP8 with float scales, rounded scales and UE8M0), low_latency_combine
(out=, zero_copy, hooks, entries masked after dispatch), cumulative statistics, T = 0 and
T = T_max on 2, 4 and 8 ranks, compared with tests/dense_oracle.py; bad input is rejected. One
process launch per world size runs every case; each test reports one case. Shapes and data are
random every run: set EP_TEST_SEED to replay a run (failures print it).

The FP8 tests check `ep_plugin.fp8` against the written spec with scalar float32 arithmetic.
"""
from __future__ import annotations

import math
import os
import random
import struct
from typing import Callable, Dict, List, Optional

import pytest
import torch

import dense_oracle as oracle
from case_runner import assert_case_passed, run_each
import ep_plugin
from ep_plugin import fp8
from ep_plugin.launch import parallel_launch

BASE_SEED = int(os.environ.get("EP_TEST_SEED", random.SystemRandom().randrange(1 << 30)))
WORLD_SIZES = (2, 4, 8)


# ---- FP8 against the spec, with scalar float32 arithmetic ---------------------------------------------
def f32(value: float) -> float:
    """Round a Python float (double) to the nearest float32."""
    return struct.unpack("<f", struct.pack("<f", value))[0]


def f32_bits(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0]


def bits_f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def spec_scale(block: List[float], round_scale: bool) -> float:
    """scale_inv of one block, literally as written in ep_plugin/fp8.py's docstring.

    float32 division = the double quotient of two float32 values rounded once to float32 (exact:
    a double holds more than 2 * 24 + 2 bits).
    """
    amax = max([abs(v) for v in block] + [f32(1e-4)])
    scale = f32(amax / 448.0)
    if round_scale:
        bits = f32_bits(scale)
        if bits & 0x007FFFFF:
            bits = (bits & 0x7F800000) + 0x00800000
        scale = bits_f32(bits)
    return scale


def spec_quantize(x: torch.Tensor, round_scale: bool):
    """(q as uint8 bytes, float32 scales) per the spec, one scalar at a time."""
    rows, hidden = x.shape
    values = x.float().tolist()
    scales, quotients = [], []
    for row in values:
        row_scales, row_q = [], []
        for start in range(0, hidden, 128):
            block = row[start:start + 128]
            scale = spec_scale(block, round_scale)
            row_scales.append(scale)
            row_q += [min(max(f32(v / scale), -448.0), 448.0) for v in block]
        scales.append(row_scales)
        quotients.append(row_q)
    q = torch.tensor(quotients, dtype=torch.float32).reshape(rows, hidden).to(torch.float8_e4m3fn)
    return q.view(torch.uint8), torch.tensor(scales, dtype=torch.float32).reshape(rows, -1)


@pytest.mark.parametrize("hidden", [128, 200, 8, 640, 392])
@pytest.mark.parametrize("round_scale", [False, True])
def test_fp8_quantize_matches_spec(hidden, round_scale):
    gen = torch.Generator().manual_seed(BASE_SEED + hidden)
    magnitude = torch.logspace(-6, 4, 7).unsqueeze(1)
    x = (torch.randn(7, hidden, generator=gen) * magnitude).to(torch.bfloat16)
    x[0] = 0                       # all-zero token: amax floor 1e-4
    x[1, -1] = 3.0e4               # a large value in the (maybe partial) last block
    q, scales = fp8.quantize(x, round_scale=round_scale)
    want_q, want_scales = spec_quantize(x, round_scale)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == (7, math.ceil(hidden / 128))
    assert torch.equal(scales, want_scales), f"seed {BASE_SEED}"
    assert torch.equal(q.view(torch.uint8), want_q), f"seed {BASE_SEED}"
    # Dequantised values are within one e4m3 step (relative 2^-3) of x, plus the floor's absolute error.
    back = fp8.dequantize(q, scales)
    error = (back - x.float()).abs()
    limit = x.float().abs() * 2.0 ** -3 * (2 if round_scale else 1) + fp8.expand_blocks(scales, hidden) * 2.0 ** -9
    assert bool((error <= limit).all())


def test_fp8_round_up_to_power_of_two():
    gen = torch.Generator().manual_seed(BASE_SEED)
    values = torch.cat([torch.exp(torch.randn(1000, generator=gen) * 20),
                        torch.tensor([1.0, 0.5, 2.0 ** -20, 3.0, 1.0 + 2.0 ** -23, 2.0 - 2.0 ** -23])]).float()
    rounded = fp8.round_up_to_power_of_two(values)
    for value, got in zip(values.tolist(), rounded.tolist()):
        mantissa, exponent = math.frexp(value)   # value = mantissa * 2**exponent, mantissa in [0.5, 1)
        want = value if mantissa == 0.5 else math.ldexp(1.0, exponent)
        assert got == want, (value, got, want)


def test_fp8_ue8m0_packing():
    scales = torch.tensor([[2.0 ** -7, 1.0, 2.0 ** 3, 2.0 ** -126, 0.5, 2.0 ** 127]], dtype=torch.float32)
    packed = fp8.pack_ue8m0(scales)
    assert packed.dtype == torch.int32 and packed.shape == (1, 2)
    exponents = [120, 127, 130, 1, 126, 254]
    word0 = exponents[0] | exponents[1] << 8 | exponents[2] << 16 | exponents[3] << 24
    word1 = exponents[4] | exponents[5] << 8                      # blocks 6 and 7 missing -> 0
    assert packed.tolist() == [[word0, word1]]
    assert torch.equal(fp8.unpack_ue8m0(packed, 6), scales)
    high = fp8.pack_ue8m0(torch.tensor([[1.0, 1.0, 1.0, 2.0 ** 100]]))  # top byte >= 128: negative int32
    assert high.tolist() == [[struct.unpack("<i", bytes([127, 127, 127, 227]))[0]]]


@pytest.mark.parametrize("hidden", [128, 200, 1152])
def test_fp8_quantize_ue8m0(hidden):
    gen = torch.Generator().manual_seed(BASE_SEED + 1)
    x = (torch.randn(5, hidden, generator=gen) * 30).to(torch.bfloat16)
    q, packed = fp8.quantize(x, round_scale=True, use_ue8m0=True)
    q_float, scales = fp8.quantize(x, round_scale=True)
    blocks = math.ceil(hidden / 128)
    assert packed.dtype == torch.int32 and packed.shape == (5, math.ceil(blocks / 4))
    assert torch.equal(q.view(torch.uint8), q_float.view(torch.uint8))
    assert torch.equal(fp8.unpack_ue8m0(packed, blocks), scales)
    assert torch.equal(fp8.dequantize(q, packed), fp8.dequantize(q_float, scales))
    with pytest.raises(ValueError, match="round_scale"):
        fp8.quantize(x, round_scale=False, use_ue8m0=True)


# ---- distributed cases -----------------------------------------------------------------------------
def route_uniform(drop: float = 0.25) -> Callable:
    def route(gen, num_tokens, top_k, num_experts):
        ids = torch.rand(num_tokens, num_experts, generator=gen).argsort(dim=1)[:, :top_k]
        return ids.masked_fill(torch.rand(num_tokens, top_k, generator=gen) < drop, -1)
    return route


def route_one_expert(expert: int) -> Callable:
    def route(gen, num_tokens, top_k, num_experts):
        ids = torch.full((num_tokens, top_k), -1, dtype=torch.int64)
        ids[torch.arange(num_tokens), torch.randint(0, top_k, (num_tokens,), generator=gen)] = expert
        return ids
    return route


def random_bf16(gen, *shape) -> torch.Tensor:
    scale = torch.rand(*shape[:-1], 1, generator=gen) * 10 + 0.01
    return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16)


def assert_equal(name: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Exact equality of dtype, shape and bits (FP8 compared through its bytes), on the CPU (either
    side may be a GPU tensor)."""
    actual, expected = actual.cpu(), expected.cpu()
    assert actual.dtype == expected.dtype, f"{name}: dtype {actual.dtype}, expected {expected.dtype}"
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    if actual.element_size() == 1:
        actual, expected = actual.view(torch.uint8), expected.view(torch.uint8)
    if not torch.equal(actual, expected):
        bad = (actual != expected).nonzero()[:5].tolist()
        raise AssertionError(f"{name}: differs at {bad} (first 5)")


class Ctx:
    """One rank's view of a launch: rank, group, buffers, device and the run's seed."""

    def __init__(self, rank: int, num_ranks: int, group, seed: int) -> None:
        self.rank, self.num_ranks, self.group, self.seed = rank, num_ranks, group, seed
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        checked = {"backend": "reference", "check_inputs": True}  # bad_inputs expects the host check
        self.buffer = ep_plugin.Buffer(group, 0, 0, low_latency_mode=True, config=checked)
        self.other = ep_plugin.Buffer(group, 0, 0, low_latency_mode=True, config=checked)
        self.normal = ep_plugin.Buffer(group, config=checked)

    def rngs(self, case_id: int):
        seed = self.seed * 1000 + case_id
        return random.Random(seed), torch.Generator().manual_seed(seed)


def ll_round(ctx: Ctx, case_id: int, *, use_fp8: bool = False, round_scale: bool = False, use_ue8m0: bool = False,
             tokens: Optional[List[int]] = None, t_max: Optional[int] = None, route: Optional[Callable] = None,
             hook: bool = False, stats: bool = True, zero_copy: bool = False, use_out: bool = False,
             mask_after: bool = False, repeats: int = 1) -> None:
    """low_latency_dispatch then low_latency_combine on every rank, then the checks.

    Every rank generates every rank's inputs from the case's seed, so the oracle sees them all.
    All communication happens before any check, so a failed check never leaves a rank waiting.
    """
    py, gen = ctx.rngs(case_id)
    rank, num_ranks, dev, buf = ctx.rank, ctx.num_ranks, ctx.device, ctx.buffer
    hidden = 8 * py.randint(1, 100)
    num_local = py.randint(1, 5)
    num_experts = num_ranks * num_local
    top_k = py.randint(1, min(num_experts, 8))
    t_max = t_max or py.randint(1, 40)
    tokens = tokens if tokens is not None else [py.randint(0, t_max) for _ in range(num_ranks)]
    route = route or route_uniform()
    slots = num_ranks * t_max

    topk_idxs = [route(gen, tokens[r], top_k, num_experts) for r in range(num_ranks)]
    top_k = topk_idxs[0].size(1)
    xs = [random_bf16(gen, tokens[r], hidden) for r in range(num_ranks)]
    weights = [torch.rand(tokens[r], top_k, generator=gen) for r in range(num_ranks)]
    counts = [oracle.low_latency_dispatch(d, num_experts, xs, topk_idxs, False)["recv_count"]
              for d in range(num_ranks)]
    # Expert outputs; slots past each expert's count are poisoned and must be ignored.
    cxs = []
    for d in range(num_ranks):
        cx = random_bf16(gen, num_local, slots, hidden)
        for j, count in enumerate(counts[d]):
            cx[j, count:] = float("nan")
        cxs.append(cx)
    combine_idx = topk_idxs[rank].clone()
    if mask_after:
        combine_idx[torch.rand(combine_idx.shape, generator=gen) < 0.4] = -1
    initial_stats = torch.randint(0, 100, (num_local,), dtype=torch.int32, generator=gen)

    # ---- communication ----
    stats_tensor = initial_stats.clone().to(dev) if stats else None
    x, topk_idx = xs[rank].to(dev), topk_idxs[rank].to(dev)
    for _ in range(repeats):
        recv_x, recv_count, handle, _, recv_hook = buf.low_latency_dispatch(
            x, topk_idx, t_max, num_experts, cumulative_local_expert_recv_stats=stats_tensor, use_fp8=use_fp8,
            round_scale=round_scale, use_ue8m0=use_ue8m0, return_recv_hook=hook)
        if hook:
            recv_hook()
            recv_hook()  # idempotent
    combine_x = cxs[rank].to(dev)
    if zero_copy:
        combine_buffer = buf.get_next_low_latency_combine_buffer(handle)
        assert buf.get_next_low_latency_combine_buffer(handle) is combine_buffer
        assert combine_buffer.shape == (num_local, slots, hidden) and combine_buffer.dtype == torch.bfloat16
        combine_buffer.copy_(combine_x)
        combine_x = combine_buffer
    out = torch.full((tokens[rank], hidden), float("nan"), dtype=torch.bfloat16, device=dev) if use_out else None
    combined, _, combine_hook = buf.low_latency_combine(combine_x, combine_idx.to(dev), weights[rank].to(dev),
                                                        handle, zero_copy=zero_copy, return_recv_hook=hook, out=out)
    if hook:
        combine_hook()
        combine_hook()

    # ---- checks ----
    assert (recv_hook is not None) == hook and (combine_hook is not None) == hook
    exp = oracle.low_latency_dispatch(rank, num_experts, xs, topk_idxs, use_fp8, round_scale, use_ue8m0)
    assert_equal("recv_count", recv_count, torch.tensor(exp["recv_count"], dtype=torch.int32))
    if stats:
        want_stats = initial_stats + repeats * torch.tensor(exp["recv_count"], dtype=torch.int32)
        assert_equal("cumulative_local_expert_recv_stats", stats_tensor, want_stats)
    if use_fp8:
        assert isinstance(recv_x, tuple) and len(recv_x) == 2
        data, scales = recv_x
        width = math.ceil(math.ceil(hidden / 128) / 4) if use_ue8m0 else math.ceil(hidden / 128)
        assert data.dtype == torch.float8_e4m3fn and data.shape == (num_local, slots, hidden)
        assert scales.dtype == (torch.int32 if use_ue8m0 else torch.float32)
        assert scales.shape == (num_local, slots, width), scales.shape
        assert scales.transpose(1, 2).is_contiguous(), f"scales must be column-major, strides {scales.stride()}"
        for j, count in enumerate(exp["recv_count"]):
            assert_equal(f"recv_x[{j}]", data[j, :count], exp["rows"][j])
            assert_equal(f"recv_scales[{j}]", scales[j, :count], exp["scales"][j])
    else:
        assert isinstance(recv_x, torch.Tensor)
        assert recv_x.dtype == torch.bfloat16 and recv_x.shape == (num_local, slots, hidden)
        for j, count in enumerate(exp["recv_count"]):
            assert_equal(f"recv_x[{j}]", recv_x[j, :count], exp["rows"][j])

    want = oracle.low_latency_combine(rank, num_experts, topk_idxs, combine_idx, weights[rank], cxs)
    assert combined.dtype == torch.bfloat16 and combined.shape == (tokens[rank], hidden)
    if use_out:
        assert combined is out, "low_latency_combine must return `out` when given"
    torch.testing.assert_close(combined.cpu(), want, msg=lambda m: f"combined: {m}")


def case_bad_inputs(ctx: Ctx) -> None:
    """Bad arguments are rejected before anything runs (every rank makes the same bad call)."""
    dev, buf = ctx.device, ctx.buffer
    num_experts = 2 * ctx.num_ranks
    topk = torch.tensor([[0, 1], [num_experts - 1, -1], [2, 3]], device=dev)
    x = torch.randn(3, 64, device=dev).to(torch.bfloat16)
    with pytest.raises(ValueError, match="more than num_max_dispatch_tokens_per_rank"):
        buf.low_latency_dispatch(x, topk, 2, num_experts)
    with pytest.raises(TypeError, match="x must have dtype"):
        buf.low_latency_dispatch(x.float(), topk, 8, num_experts)
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        buf.low_latency_dispatch(x[:, :60], topk, 8, num_experts)
    with pytest.raises(ValueError, match="topk_idx must have size 3"):
        buf.low_latency_dispatch(x, topk[:2], 8, num_experts)
    with pytest.raises(TypeError, match="topk_idx must have dtype"):
        buf.low_latency_dispatch(x, topk.int(), 8, num_experts)
    with pytest.raises(ValueError, match=r"topk_idx\[1, 0\] = %d is not an expert id" % num_experts):
        buf.low_latency_dispatch(x, topk + 1, 8, num_experts)
    with pytest.raises(ValueError, match="divisible"):
        buf.low_latency_dispatch(x, topk, 8, num_experts + 1)
    with pytest.raises(ValueError, match="needs round_scale=True"):
        buf.low_latency_dispatch(x, topk, 8, num_experts, use_fp8=True, use_ue8m0=True)
    with pytest.raises(ValueError, match="cumulative_local_expert_recv_stats must have size"):
        buf.low_latency_dispatch(x, topk, 8, num_experts,
                                 cumulative_local_expert_recv_stats=torch.zeros(5, dtype=torch.int32, device=dev))
    with pytest.raises(ValueError, match="must be contiguous"):
        buf.low_latency_dispatch(x, topk, 8, num_experts,
                                 cumulative_local_expert_recv_stats=torch.zeros(
                                     2 * num_experts // ctx.num_ranks, dtype=torch.int32, device=dev)[::2])
    with pytest.raises(ValueError, match="cannot be combined"):
        buf.low_latency_dispatch(x, topk, 8, num_experts, async_finish=True, return_recv_hook=True)
    with pytest.raises(NotImplementedError, match="dispatch_wait_recv_cost_stats"):
        buf.low_latency_dispatch(x, topk, 8, num_experts,
                                 dispatch_wait_recv_cost_stats=torch.zeros(2, dtype=torch.int64, device=dev))
    with pytest.raises(RuntimeError, match="low-latency kernels need"):
        ctx.normal.low_latency_dispatch(x, topk, 8, num_experts)
    # Handles: from another Buffer, of the wrong kind, or not a handle.
    weights = torch.rand(3, 2, device=dev)
    recv, _, handle, _, _ = buf.low_latency_dispatch(x, topk, 8, num_experts, use_fp8=False)
    _, _, foreign, _, _ = ctx.other.low_latency_dispatch(x, topk, 8, num_experts, use_fp8=False)
    layout = ctx.buffer.get_dispatch_layout(topk, num_experts)
    _, _, _, _, normal_handle, _ = buf.dispatch(x, topk_idx=topk, num_tokens_per_rank=layout[0],
                                                is_token_in_rank=layout[3], num_tokens_per_expert=layout[2])
    with pytest.raises(ValueError, match="cannot be combined"):
        buf.low_latency_combine(recv, topk, weights, handle, async_finish=True, return_recv_hook=True)
    with pytest.raises(ValueError, match="handle does not come from this Buffer"):
        buf.low_latency_combine(recv, topk, weights, foreign)
    with pytest.raises(ValueError, match="handle does not come from this Buffer"):
        buf.get_next_low_latency_combine_buffer(foreign)
    with pytest.raises(ValueError, match="expected a handle from low_latency_dispatch, got DispatchHandle"):
        buf.low_latency_combine(recv, topk, weights, normal_handle)
    with pytest.raises(ValueError, match="expected a handle from low_latency_dispatch"):
        buf.get_next_low_latency_combine_buffer(normal_handle)
    with pytest.raises(ValueError, match="expected a handle from"):
        buf.combine(torch.zeros(3, 64, dtype=torch.bfloat16, device=dev), handle)
    with pytest.raises(ValueError, match="x must have size"):
        buf.low_latency_combine(recv[:, :-1], topk, weights, handle)
    with pytest.raises(TypeError, match="topk_weights must have dtype"):
        buf.low_latency_combine(recv, topk, weights.double(), handle)
    with pytest.raises(ValueError, match="out must have size"):
        buf.low_latency_combine(recv, topk, weights, handle, out=torch.empty(2, 64, dtype=torch.bfloat16, device=dev))
    with pytest.raises(NotImplementedError, match="use_logfmt"):
        buf.low_latency_combine(recv, topk, weights, handle, use_logfmt=True)
    # A changed (not -1) expert id is caught after the exchange, so no rank waits.
    changed = topk.clone()
    changed[0, 0] = 1 if ctx.rank == 0 else 0
    if ctx.rank == 0:
        changed[0, 1] = 0
        with pytest.raises(ValueError, match=r"topk_idx\[0, 0\] = 1 but the dispatch had 0"):
            buf.low_latency_combine(recv, changed, weights, handle)
    else:
        buf.low_latency_combine(recv, changed, weights, handle)
    # Ranks disagreeing on T_max or the FP8 options: rejected on every rank.
    with pytest.raises(ValueError, match="ranks disagree"):
        buf.low_latency_dispatch(x, topk, 8 + ctx.rank, num_experts)
    with pytest.raises(ValueError, match="ranks disagree"):
        buf.low_latency_dispatch(x, topk, 8, num_experts, use_fp8=True, round_scale=ctx.rank == 0)
    buf.clean_low_latency_buffer(8, 64, num_experts)  # a valid no-op in the reference
    combined, _, _ = buf.low_latency_combine(recv, topk, weights, handle)
    assert combined.shape == (3, 64)


def case_dispatch_weights_bind_the_combine(ctx: Ctx) -> None:
    """topk_weights given to the dispatch: the same result as without; the combine must then get the
    dispatch's own topk_idx and topk_weights tensors, unmodified (checked before anything runs)."""
    dev, buf = ctx.device, ctx.buffer
    gen = torch.Generator().manual_seed(ctx.seed + ctx.rank)
    num_experts = 2 * ctx.num_ranks
    topk = torch.tensor([[0, 1], [num_experts - 1, -1], [2, 3]], device=dev)
    x = random_bf16(gen, 3, 64).to(dev)
    weights = torch.rand(3, 2, generator=gen).to(dev)
    plain = buf.low_latency_dispatch(x, topk, 8, num_experts, use_fp8=False)
    routed = buf.low_latency_dispatch(x, topk, 8, num_experts, use_fp8=False, topk_weights=weights)
    assert_equal("recv_x", routed[0], plain[0])
    expert_out = random_bf16(gen, *plain[0].shape).to(dev)
    want = buf.low_latency_combine(expert_out, topk, weights, plain[2])[0]
    with pytest.raises(TypeError, match="topk_weights must have dtype"):
        buf.low_latency_dispatch(x, topk, 8, num_experts, topk_weights=weights.double())
    with pytest.raises(ValueError, match="dispatch's own topk_weights"):
        buf.low_latency_combine(expert_out, topk, weights.clone(), routed[2])
    with pytest.raises(ValueError, match="dispatch's own topk_idx"):
        buf.low_latency_combine(expert_out, topk.clone(), weights, routed[2])
    assert_equal("combined", buf.low_latency_combine(expert_out, topk, weights, routed[2])[0], want)
    weights.mul_(1.0)
    with pytest.raises(ValueError, match="topk_weights was modified in place"):
        buf.low_latency_combine(expert_out, topk, weights, routed[2])


def _cases(ctx: Ctx) -> Dict[str, Callable[[], None]]:
    num_ranks = ctx.num_ranks
    return {
        "bf16_hook_out": lambda: ll_round(ctx, 1, hook=True, use_out=True),
        "fp8_float_scales": lambda: ll_round(ctx, 2, use_fp8=True),
        "fp8_round_scale": lambda: ll_round(ctx, 3, use_fp8=True, round_scale=True, use_out=True),
        "fp8_ue8m0": lambda: ll_round(ctx, 4, use_fp8=True, round_scale=True, use_ue8m0=True, hook=True),
        "zero_copy_bf16": lambda: ll_round(ctx, 5, zero_copy=True),
        "zero_copy_fp8_out": lambda: ll_round(ctx, 6, zero_copy=True, use_fp8=True, use_out=True, hook=True),
        "rank_with_zero_tokens": lambda: ll_round(ctx, 7, tokens=[0] + [5] * (num_ranks - 1), t_max=5,
                                                  use_fp8=True, use_out=True),
        "zero_tokens_everywhere": lambda: ll_round(ctx, 8, tokens=[0] * num_ranks, t_max=3, use_out=True, hook=True),
        "full_t_max": lambda: ll_round(ctx, 9, tokens=[24] * num_ranks, t_max=24, route=route_uniform(0.0),
                                       use_fp8=True, round_scale=True),
        "all_to_one_expert": lambda: ll_round(ctx, 10, tokens=[16] * num_ranks, t_max=16,
                                              route=route_one_expert(num_ranks - 1), use_out=True),
        "masked_after_dispatch": lambda: ll_round(ctx, 11, mask_after=True, use_fp8=True),
        "no_stats_repeated": lambda: ll_round(ctx, 12, stats=False, repeats=2),
        "stats_accumulate": lambda: ll_round(ctx, 13, repeats=3, use_fp8=True, round_scale=True, use_ue8m0=True),
        "bad_inputs": lambda: case_bad_inputs(ctx),
        "dispatch_weights_bind_the_combine": lambda: case_dispatch_weights_bind_the_combine(ctx),
    }


CASES = ("bf16_hook_out", "fp8_float_scales", "fp8_round_scale", "fp8_ue8m0", "zero_copy_bf16",
         "zero_copy_fp8_out", "rank_with_zero_tokens", "zero_tokens_everywhere", "full_t_max",
         "all_to_one_expert", "masked_after_dispatch", "no_stats_repeated", "stats_accumulate", "bad_inputs",
         "dispatch_weights_bind_the_combine")


def low_latency_worker(rank: int, num_ranks: int, group, seed: int) -> Dict[str, Optional[str]]:
    """Run every case on this rank; returns case -> None (passed) or the failure's traceback."""
    return run_each(_cases(Ctx(rank, num_ranks, group, seed)), CASES)


# ---- pytest ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"{n}ranks")
def launch(request):
    seed = BASE_SEED + request.param
    return request.param, seed, parallel_launch(request.param, low_latency_worker, seed, timeout_s=60)


@pytest.mark.parametrize("case", CASES)
def test_low_latency(launch, case):
    num_ranks, seed, results = launch
    assert_case_passed(results, case, f"EP_TEST_SEED={BASE_SEED} (seed {seed}), {num_ranks} ranks")
