"""The native low-latency backend's host code, on CPU, through the public `ep_plugin.Buffer`: the outputs
it allocates and the Args each launch hands the kernels, recorded by a stand-in runtime
(tests/stand_in_native.py); bad input raises before any launch. The kernels themselves are
tests/test_native_low_latency.py's (GPU). Two spawned ranks (2 ranks' shapes; the stand-in needs
no peer); every case runs on each.
"""
from __future__ import annotations

import math
import os
import random
import re
from typing import Callable, Dict, Optional
from unittest import mock

import pytest
import torch

from case_runner import assert_case_passed, run_each
from ep_plugin import Buffer
from ep_plugin.backends.low_latency import LowLatencyMode
from ep_plugin.bench import random_routing
from ep_plugin.launch import parallel_launch

pytest.importorskip("ep_plugin._C", reason="the native extension is not built here")
_C_nvshmem = pytest.importorskip("ep_plugin._C_nvshmem", reason="ep_plugin._C_nvshmem is not built here (no NVSHMEM)")
from stand_in_native import RecordingLowLatencyRuntime, stand_in_kernels  # noqa: E402

BASE_SEED = int(os.environ.get("EP_TEST_SEED", random.SystemRandom().randrange(1 << 30)))
T_MAX, HIDDEN, NUM_EXPERTS, TOPK = 16, 640, 8, 3  # 5 FP8 scales per row, 2 UE8M0 words
SEND_RECV = _C_nvshmem.PHASE_SEND | _C_nvshmem.PHASE_RECV


class Ctx:
    def __init__(self, rank: int, num_ranks: int, buffer: Buffer, runtime: RecordingLowLatencyRuntime,
                 seed: int) -> None:
        self.rank, self.num_ranks, self.buffer, self.runtime = rank, num_ranks, buffer, runtime
        self.gen = torch.Generator().manual_seed(seed + rank)
        self.num_local = NUM_EXPERTS // num_ranks
        self.num_slots = num_ranks * T_MAX

    def inputs(self, num_tokens: int = T_MAX - 3):
        x = torch.randn(num_tokens, HIDDEN, generator=self.gen).to(torch.bfloat16)
        return x, random_routing(num_tokens, NUM_EXPERTS, TOPK, "cpu", self.gen)

    def expert_outputs(self) -> torch.Tensor:
        return torch.randn(self.num_local, self.num_slots, HIDDEN, generator=self.gen).to(torch.bfloat16)

    def launch(self, index: int = -1):
        return self.runtime.launches[index]


def _expect_fields(fields: Dict[str, object], **expected) -> None:
    for name, value in expected.items():
        assert fields[name] == value, f"Args.{name} = {fields[name]!r}, expected {value!r}"


def case_fp8_dispatch_and_combine(ctx: Ctx) -> None:
    """FP8 outputs with column-major float scales; the Args name each tensor; the combine uses the round
    of its dispatch; rounds alternate."""
    x, topk_idx = ctx.inputs()
    first = len(ctx.runtime.launches)
    (data, scales), recv_count, handle, _, hook = ctx.buffer.low_latency_dispatch(x, topk_idx, T_MAX, NUM_EXPERTS,
                                                                                   use_fp8=True)
    assert hook is None
    num_scales = math.ceil(HIDDEN / 128)
    assert data.dtype == torch.float8_e4m3fn and data.shape == (ctx.num_local, ctx.num_slots, HIDDEN)
    assert data.is_contiguous()
    assert scales.dtype == torch.float32 and scales.shape == (ctx.num_local, ctx.num_slots, num_scales)
    assert scales.stride() == (num_scales * ctx.num_slots, 1, ctx.num_slots), scales.stride()
    assert recv_count.dtype == torch.int32 and recv_count.shape == (ctx.num_local,)
    assert len(handle) == 5 and handle[2:] == (T_MAX, HIDDEN, NUM_EXPERTS)
    assert handle[1].dtype == torch.int64 and handle[1].shape == (ctx.num_local, ctx.num_ranks)
    assert handle.recv_src_info.dtype == torch.int32 and handle.recv_src_info.shape == (ctx.num_local, ctx.num_slots)
    assert len(ctx.runtime.launches) == first + 1
    operation, fields, parity = ctx.launch()
    assert operation == "dispatch"
    _expect_fields(fields, x=x.data_ptr(), topk_idx=topk_idx.data_ptr(), num_tokens=x.size(0), num_topk=TOPK,
                   hidden=HIDDEN, num_experts=NUM_EXPERTS, num_max_dispatch_tokens_per_rank=T_MAX, use_fp8=True,
                   round_scale=False, use_ue8m0=False, recv_x=data.data_ptr(), recv_scales=scales.data_ptr(),
                   recv_count=recv_count.data_ptr(), recv_src_info=handle.recv_src_info.data_ptr(),
                   recv_layout=handle[1].data_ptr(), cumulative_local_expert_recv_stats=0, topk_weights=0,
                   carry_route=False, phases=SEND_RECV, rank_mask=0)

    expert_out, weights = ctx.expert_outputs(), torch.rand(x.size(0), TOPK, generator=ctx.gen)
    combined, _, hook = ctx.buffer.low_latency_combine(expert_out, topk_idx, weights, handle)
    assert hook is None and combined.dtype == torch.bfloat16 and combined.shape == x.shape
    operation, combine_fields, combine_parity = ctx.launch()
    assert operation == "combine" and combine_parity == parity
    _expect_fields(combine_fields, x=expert_out.data_ptr(), topk_idx=topk_idx.data_ptr(),
                   topk_weights=weights.data_ptr(), out=combined.data_ptr(), num_tokens=x.size(0), num_topk=TOPK,
                   hidden=HIDDEN, num_experts=NUM_EXPERTS, num_max_dispatch_tokens_per_rank=T_MAX,
                   recv_src_info=fields["recv_src_info"], recv_layout=fields["recv_layout"], expert_sums=False,
                   phases=SEND_RECV, rank_mask=0)

    ctx.buffer.low_latency_dispatch(x, topk_idx, T_MAX, NUM_EXPERTS, use_fp8=True)
    assert ctx.launch()[2] == 1 - parity, "consecutive dispatches must use alternate rounds"


def case_ue8m0_scales(ctx: Ctx) -> None:
    """UE8M0 scales: int32 words, four per word, column-major like the float scales."""
    x, topk_idx = ctx.inputs()
    (_, scales), _, _, _, _ = ctx.buffer.low_latency_dispatch(x, topk_idx, T_MAX, NUM_EXPERTS, use_fp8=True,
                                                              round_scale=True, use_ue8m0=True)
    words = math.ceil(math.ceil(HIDDEN / 128) / 4)
    assert scales.dtype == torch.int32 and scales.shape == (ctx.num_local, ctx.num_slots, words)
    assert scales.stride() == (words * ctx.num_slots, 1, ctx.num_slots), scales.stride()
    _expect_fields(ctx.launch()[1], use_fp8=True, round_scale=True, use_ue8m0=True, recv_scales=scales.data_ptr())


def case_bf16_dispatch_with_weights_and_out(ctx: Ctx) -> None:
    """BF16: no scales; topk_weights and statistics reach the kernels; the combine writes into `out`."""
    x, topk_idx = ctx.inputs(T_MAX)
    weights = torch.rand(T_MAX, TOPK, generator=ctx.gen)
    stats = torch.zeros(ctx.num_local, dtype=torch.int32)
    recv_x, _, handle, _, _ = ctx.buffer.low_latency_dispatch(
        x, topk_idx, T_MAX, NUM_EXPERTS, cumulative_local_expert_recv_stats=stats, use_fp8=False,
        topk_weights=weights)
    assert recv_x.dtype == torch.bfloat16 and recv_x.shape == (ctx.num_local, ctx.num_slots, HIDDEN)
    _expect_fields(ctx.launch()[1], use_fp8=False, recv_x=recv_x.data_ptr(), recv_scales=0,
                   cumulative_local_expert_recv_stats=stats.data_ptr(), topk_weights=weights.data_ptr(),
                   carry_route=True)
    out = torch.empty(T_MAX, HIDDEN, dtype=torch.bfloat16)
    combined, _, _ = ctx.buffer.low_latency_combine(ctx.expert_outputs(), topk_idx, weights, handle, out=out)
    assert combined is out
    _expect_fields(ctx.launch()[1], out=out.data_ptr(), expert_sums=True)


def case_receive_hooks(ctx: Ctx) -> None:
    """With return_recv_hook the call only sends; the hook's first call receives into the same outputs."""
    x, topk_idx = ctx.inputs()
    recv_x, _, handle, _, hook = ctx.buffer.low_latency_dispatch(x, topk_idx, T_MAX, NUM_EXPERTS, use_fp8=False,
                                                                 return_recv_hook=True)
    operation, send, parity = ctx.launch()
    assert operation == "dispatch" and send["phases"] == _C_nvshmem.PHASE_SEND
    count = len(ctx.runtime.launches)
    hook()
    hook()
    assert len(ctx.runtime.launches) == count + 1, "a hook receives once"
    operation, receive, receive_parity = ctx.launch()
    assert operation == "dispatch" and receive_parity == parity
    assert receive == {**send, "phases": _C_nvshmem.PHASE_RECV}

    weights = torch.rand(x.size(0), TOPK, generator=ctx.gen)
    combined, _, hook = ctx.buffer.low_latency_combine(ctx.expert_outputs(), topk_idx, weights, handle,
                                                       return_recv_hook=True)
    operation, send, _ = ctx.launch()
    assert operation == "combine" and send["phases"] == _C_nvshmem.PHASE_SEND
    hook()
    operation, receive, _ = ctx.launch()
    assert operation == "combine" and receive == {**send, "phases": _C_nvshmem.PHASE_RECV}
    assert receive["out"] == combined.data_ptr()


def case_pending_hooks_launch_with_their_own_args(ctx: Ctx) -> None:
    """A receive hook launches with the pointers of its own call after a call of the same sizes without a hook
    (whose Args are shared between such calls) ran in the other round; that call launches with its own."""
    x, topk_idx = ctx.inputs()
    weights = torch.rand(x.size(0), TOPK, generator=ctx.gen)
    (recv_x, _), _, handle, _, dispatch_hook = ctx.buffer.low_latency_dispatch(x, topk_idx, T_MAX, NUM_EXPERTS,
                                                                               return_recv_hook=True)
    _, dispatch_send, parity = ctx.launch()
    other_x, other_idx = ctx.inputs(T_MAX)
    (data, scales), count, other, _, _ = ctx.buffer.low_latency_dispatch(other_x, other_idx, T_MAX, NUM_EXPERTS)
    operation, fields, other_parity = ctx.launch()
    assert operation == "dispatch" and other_parity == 1 - parity
    _expect_fields(fields, x=other_x.data_ptr(), topk_idx=other_idx.data_ptr(), num_tokens=T_MAX, use_fp8=True,
                   recv_x=data.data_ptr(), recv_scales=scales.data_ptr(), recv_count=count.data_ptr(),
                   recv_src_info=other.recv_src_info.data_ptr(), recv_layout=other[1].data_ptr(), phases=SEND_RECV)
    dispatch_hook()
    operation, receive, receive_parity = ctx.launch()
    assert operation == "dispatch" and receive_parity == parity
    assert receive == {**dispatch_send, "phases": _C_nvshmem.PHASE_RECV}
    _expect_fields(receive, x=x.data_ptr(), recv_x=recv_x.data_ptr(), num_tokens=x.size(0))

    expert_out = ctx.expert_outputs()
    combined, _, combine_hook = ctx.buffer.low_latency_combine(expert_out, topk_idx, weights, handle,
                                                               return_recv_hook=True)
    _, combine_send, _ = ctx.launch()
    other_out = ctx.expert_outputs()
    other_combined, _, _ = ctx.buffer.low_latency_combine(other_out, other_idx,
                                                          torch.rand(T_MAX, TOPK, generator=ctx.gen), other)
    operation, fields, combine_parity = ctx.launch()
    assert operation == "combine" and combine_parity == 1 - parity
    _expect_fields(fields, x=other_out.data_ptr(), out=other_combined.data_ptr(), num_tokens=T_MAX,
                   recv_src_info=other.recv_src_info.data_ptr(), recv_layout=other[1].data_ptr(), phases=SEND_RECV)
    combine_hook()
    operation, receive, receive_parity = ctx.launch()
    assert operation == "combine" and receive_parity == parity
    assert receive == {**combine_send, "phases": _C_nvshmem.PHASE_RECV}
    _expect_fields(receive, x=expert_out.data_ptr(), out=combined.data_ptr(), num_tokens=x.size(0),
                   recv_src_info=handle.recv_src_info.data_ptr(), recv_layout=handle[1].data_ptr())


def case_args_follow_each_call(ctx: Ctx) -> None:
    """Calls without hooks of different sizes and options, in turn: each launch has its own call's fields."""
    x, topk_idx = ctx.inputs()
    weights = torch.rand(x.size(0), TOPK, generator=ctx.gen)
    _, _, routed, _, _ = ctx.buffer.low_latency_dispatch(x, topk_idx, T_MAX, NUM_EXPERTS, topk_weights=weights)
    _expect_fields(ctx.launch()[1], carry_route=True, topk_weights=weights.data_ptr(), use_fp8=True, num_topk=TOPK)
    _, _, plain, _, _ = ctx.buffer.low_latency_dispatch(x, topk_idx, T_MAX, NUM_EXPERTS)
    _expect_fields(ctx.launch()[1], carry_route=False, topk_weights=0, use_fp8=True, num_topk=TOPK)
    narrow = topk_idx[:, :2].contiguous()
    _, _, fewer, _, _ = ctx.buffer.low_latency_dispatch(x, narrow, T_MAX, NUM_EXPERTS, use_fp8=False)
    _expect_fields(ctx.launch()[1], carry_route=False, topk_weights=0, use_fp8=False, recv_scales=0, num_topk=2,
                   topk_idx=narrow.data_ptr())
    empty_x, empty_idx = ctx.inputs(0)
    _, _, empty, _, _ = ctx.buffer.low_latency_dispatch(empty_x, empty_idx, T_MAX, NUM_EXPERTS)
    _expect_fields(ctx.launch()[1], x=0, topk_idx=0, num_tokens=0)

    for handle, idx, handle_weights, expert_sums in ((routed, topk_idx, weights, True),
                                                     (plain, topk_idx, weights, False),
                                                     (fewer, narrow, weights[:, :2].contiguous(), False)):
        combined, _, _ = ctx.buffer.low_latency_combine(ctx.expert_outputs(), idx, handle_weights, handle)
        _expect_fields(ctx.launch()[1], expert_sums=expert_sums, bf16_partials=expert_sums, num_topk=idx.size(1),
                       topk_idx=idx.data_ptr(), topk_weights=handle_weights.data_ptr(), out=combined.data_ptr(),
                       num_tokens=x.size(0), recv_src_info=handle.recv_src_info.data_ptr())
    combined, _, _ = ctx.buffer.low_latency_combine(ctx.expert_outputs(), empty_idx, torch.rand(0, TOPK), empty)
    assert combined.shape == (0, HIDDEN)
    _expect_fields(ctx.launch()[1], topk_idx=0, topk_weights=0, out=0, num_tokens=0)


def case_bad_input_launches_nothing(ctx: Ctx) -> None:
    """Each bad argument gets its error, naming it, and no kernel is launched."""
    x, topk_idx = ctx.inputs()
    _, _, handle, _, _ = ctx.buffer.low_latency_dispatch(x, topk_idx, T_MAX, NUM_EXPERTS)
    weights = torch.rand(x.size(0), TOPK, generator=ctx.gen)
    expert_out = ctx.expert_outputs()
    count = len(ctx.runtime.launches)
    dispatch = ctx.buffer.low_latency_dispatch
    combine = ctx.buffer.low_latency_combine
    bad_calls = [
        (TypeError, "x must have dtype", lambda: dispatch(x.float(), topk_idx, T_MAX, NUM_EXPERTS)),
        (ValueError, "x must be 2-D", lambda: dispatch(x[0], topk_idx, T_MAX, NUM_EXPERTS)),
        (ValueError, "multiple of 16 bytes", lambda: dispatch(x[:, :4], topk_idx, T_MAX, NUM_EXPERTS)),
        (ValueError, f"topk_idx must have size {x.size(0)} in dimension 0",
         lambda: dispatch(x, topk_idx[1:], T_MAX, NUM_EXPERTS)),
        (TypeError, "topk_idx must have dtype", lambda: dispatch(x, topk_idx.int(), T_MAX, NUM_EXPERTS)),
        (ValueError, "more than num_max_dispatch_tokens_per_rank", lambda: dispatch(x, topk_idx, 2, NUM_EXPERTS)),
        (ValueError, "num_experts", lambda: dispatch(x, topk_idx, T_MAX, NUM_EXPERTS + 1)),
        (ValueError, "topk_weights must have size", lambda: dispatch(x, topk_idx, T_MAX, NUM_EXPERTS,
                                                                    topk_weights=weights[:, :1])),
        (ValueError, "x must have size", lambda: combine(expert_out[:, 1:], topk_idx, weights, handle)),
        (ValueError, "topk_idx must have size", lambda: combine(expert_out, topk_idx[1:], weights, handle)),
        (TypeError, "topk_weights must have dtype", lambda: combine(expert_out, topk_idx, weights.double(), handle)),
        (ValueError, "topk_weights must have size", lambda: combine(expert_out, topk_idx, weights[:, 1:], handle)),
        (ValueError, "out must have size", lambda: combine(expert_out, topk_idx, weights, handle,
                                                          out=torch.empty(1, HIDDEN, dtype=torch.bfloat16))),
        (ValueError, "handle does not come from this Buffer", lambda: combine(expert_out, topk_idx, weights, None)),
    ]
    for error, message, call in bad_calls:
        with pytest.raises(error, match=message):
            call()
    assert len(ctx.runtime.launches) == count, "a rejected call must launch no kernel"


def case_recorded_bad_expert_id_raises_at_next_dispatch(ctx: Ctx) -> None:
    """An expert id out of range that a dispatch kernel recorded: the next dispatch raises it (ValueError),
    launches nothing and keeps the round; the Buffer stays usable and the call after it runs there."""
    x, topk_idx = ctx.inputs()
    ctx.buffer.low_latency_dispatch(x, topk_idx, T_MAX, NUM_EXPERTS)
    parity = ctx.launch()[2]
    report = f"rank {ctx.rank}: topk_idx[0, 1] = {NUM_EXPERTS} in its previous low_latency_dispatch"
    ctx.runtime.bad_input = report  # what the dispatch kernel left in the status
    count = len(ctx.runtime.launches)
    with pytest.raises(ValueError, match=re.escape(report)):
        ctx.buffer.low_latency_dispatch(x, topk_idx, T_MAX, NUM_EXPERTS, return_recv_hook=True)
    assert len(ctx.runtime.launches) == count, "the rejected dispatch must launch nothing"
    assert ctx.buffer._backend.failure is None, "bad input must not fail the Buffer"
    _, _, handle, _, _ = ctx.buffer.low_latency_dispatch(x, topk_idx, T_MAX, NUM_EXPERTS)
    operation, fields, retry_parity = ctx.launch()
    assert operation == "dispatch" and fields["phases"] == SEND_RECV
    assert retry_parity == 1 - parity, "the rejected dispatch must keep the round"
    ctx.buffer.low_latency_combine(ctx.expert_outputs(), topk_idx, torch.rand(x.size(0), TOPK, generator=ctx.gen),
                                   handle)
    assert ctx.launch()[0] == "combine" and ctx.launch()[2] == retry_parity


CASES = [name for name in globals() if name.startswith("case_")]


def _cases(ctx: Ctx) -> Dict[str, Callable[[], None]]:
    return {name: (lambda fn=globals()[name]: fn(ctx)) for name in CASES}


def host_worker(rank: int, num_ranks: int, group, seed: int) -> Dict[str, Optional[str]]:
    runtime = RecordingLowLatencyRuntime()
    with stand_in_kernels(runtime):
        rdma = Buffer.get_low_latency_rdma_size_hint(T_MAX, HIDDEN, num_ranks, NUM_EXPERTS)
        buffer = Buffer(group, 0, rdma, low_latency_mode=True, explicitly_destroy=True)
        assert buffer.backend_name == "native"
        try:
            return run_each(_cases(Ctx(rank, num_ranks, buffer, runtime, seed)), CASES)
        finally:
            buffer.destroy()


@pytest.fixture(scope="module")
def results():
    return parallel_launch(2, host_worker, BASE_SEED, backend="gloo", timeout_s=120)


@pytest.mark.parametrize("case", CASES)
def test_low_latency_host(results, case):
    assert_case_passed(results, case, f"EP_TEST_SEED={BASE_SEED}")


# ---- shrink mode: the kernels get the Buffer's mask ---------------------------------------------------
def shrink_worker(rank: int, num_ranks: int, group, seed: int) -> Dict[str, object]:
    """With enable_shrink, every launch (send, receive, hook) carries the address of the backend's [R] int32
    mask, which update / query / clean read and write."""
    runtime = RecordingLowLatencyRuntime()
    with stand_in_kernels(runtime):
        rdma = Buffer.get_low_latency_rdma_size_hint(T_MAX, HIDDEN, num_ranks, NUM_EXPERTS)
        buffer = Buffer(group, 0, rdma, low_latency_mode=True, explicitly_destroy=True, enable_shrink=True)
        try:
            ctx = Ctx(rank, num_ranks, buffer, runtime, seed)
            flags = buffer._backend.device_rank_mask.flags
            assert flags.dtype == torch.int32 and flags.shape == (num_ranks,)
            other = 1 - rank
            buffer.low_latency_update_mask_buffer(other, True)
            status = torch.full((num_ranks,), 7, dtype=torch.int32)
            buffer.low_latency_query_mask_buffer(status)
            masked = status.tolist()
            x, topk_idx = ctx.inputs()
            recv_x, _, handle, _, hook = buffer.low_latency_dispatch(x, topk_idx, T_MAX, NUM_EXPERTS,
                                                                     return_recv_hook=True)
            hook()
            weights = torch.rand(x.size(0), TOPK, generator=ctx.gen)
            buffer.low_latency_combine(ctx.expert_outputs(), topk_idx, weights, handle)
            launches = [(operation, fields["phases"], fields["rank_mask"]) for operation, fields, _ in runtime.launches]
            buffer.low_latency_clean_mask_buffer()
            buffer.low_latency_query_mask_buffer(status)
            errors = []
            for call in (lambda: buffer.low_latency_update_mask_buffer(num_ranks, True),
                         lambda: buffer.low_latency_update_mask_buffer(rank, True),
                         lambda: buffer.low_latency_query_mask_buffer(torch.zeros(num_ranks, dtype=torch.int64))):
                try:
                    call()
                    errors.append("no error")
                except (TypeError, ValueError) as error:
                    errors.append(str(error))
            return dict(address=flags.data_ptr(), launches=launches, masked=masked, cleaned=status.tolist(),
                        errors=errors, other=other)
        finally:
            buffer.destroy()


def test_shrink_mode_hands_the_kernels_its_mask():
    results = parallel_launch(2, shrink_worker, BASE_SEED, backend="gloo", timeout_s=120)
    send, recv = _C_nvshmem.PHASE_SEND, _C_nvshmem.PHASE_RECV
    for rank, result in enumerate(results):
        assert result["launches"] == [("dispatch", send, result["address"]), ("dispatch", recv, result["address"]),
                                      ("combine", SEND_RECV, result["address"])], result
        assert result["masked"] == [int(r == result["other"]) for r in range(2)], result
        assert result["cleaned"] == [0, 0], result
        bad_rank, itself, bad_status = result["errors"]
        assert "rank_to_mask" in bad_rank and "cannot mask itself" in itself and "mask_status" in bad_status, result


# ---- the eager fast path's Python side: which calls take it, what it hands the C++ calls -------------
class RecordingCalls:
    """A plan's `_C_torch.LowLatencyCalls` on the host: it takes what fits its plan (as the C++ side
    compares: dtype, shape and contiguity; no launch) and records every call; None for the rest."""

    def __init__(self, plan, log: list) -> None:
        self.plan, self.log = plan, log

    def dispatch(self, x, topk_idx, stats, parity, stream):
        fits = (x.dtype == torch.bfloat16 and x.dim() == 2 and 1 <= x.size(0) <= self.plan.num_max_dispatch_tokens_per_rank
                and x.size(1) == self.plan.hidden and x.is_contiguous() and topk_idx.is_contiguous()
                and tuple(topk_idx.shape) == (x.size(0), self.plan.num_topk) and topk_idx.dtype == torch.int64)
        self.log.append(("dispatch", fits, parity))
        return (self.plan.dispatch_outputs.empty(), x.size(0)) if fits else None

    def combine(self, x, source, topk_idx, topk_weights, out, recv_src_info, recv_layout, num_tokens, parity, stream):
        fits = x.shape == self.plan.recv_shape and topk_weights.dtype == torch.float32 and x.is_contiguous()
        self.log.append(("combine", fits, parity, num_tokens, source is x))
        if not fits:
            return None
        return out if out is not None else self.plan.combine_output.empty(num_tokens)[0]


def fast_path_worker(rank: int, num_ranks: int, group, seed: int) -> Dict[str, object]:
    """Calls one by one, each with what it tried on the fast path (and whether that fitted), the launches
    of the checked path (the recording runtime's) and whether the round moved."""
    runtime, log = RecordingLowLatencyRuntime(), []
    with stand_in_kernels(runtime), mock.patch.object(LowLatencyMode, "_unchecked_calls",
                                                      lambda backend, plan: RecordingCalls(plan, log)):
        rdma = Buffer.get_low_latency_rdma_size_hint(T_MAX, HIDDEN, num_ranks, NUM_EXPERTS)
        buffer = Buffer(group, 0, rdma, low_latency_mode=True, explicitly_destroy=True)
        # A CPU buffer has no fast path: open it as a GPU buffer would have it.
        buffer._unchecked_low_latency, buffer._plain_call = buffer._backend, lambda: True
        try:
            ctx = Ctx(rank, num_ranks, buffer, runtime, seed)
            x, topk_idx = ctx.inputs()
            weights = torch.rand(x.size(0), TOPK, generator=ctx.gen)

            steps = []
            for name, call in [
                ("first of its sizes", lambda: buffer.low_latency_dispatch(x, topk_idx, T_MAX, NUM_EXPERTS)),
                ("planned", lambda: buffer.low_latency_dispatch(x, topk_idx, T_MAX, NUM_EXPERTS)),
                ("planned, with stats", lambda: buffer.low_latency_dispatch(
                    x, topk_idx, T_MAX, NUM_EXPERTS, torch.zeros(ctx.num_local, dtype=torch.int32))),
                ("T_max as a float", lambda: pytest.raises(ValueError, buffer.low_latency_dispatch, x, topk_idx,
                                                           float(T_MAX), NUM_EXPERTS)),
                ("column-major x", lambda: buffer.low_latency_dispatch(x.t().contiguous().t(), topk_idx, T_MAX,
                                                                       NUM_EXPERTS)),
                ("hook", lambda: buffer.low_latency_dispatch(x, topk_idx, T_MAX, NUM_EXPERTS,
                                                             return_recv_hook=True)[4]()),
                ("async_finish", lambda: buffer.low_latency_dispatch(x, topk_idx, T_MAX, NUM_EXPERTS,
                                                                     async_finish=True)),
                ("weights at dispatch", lambda: buffer.low_latency_dispatch(x, topk_idx, T_MAX, NUM_EXPERTS,
                                                                            topk_weights=weights)),
                ("another hidden", lambda: buffer.low_latency_dispatch(x[:, :HIDDEN // 2].contiguous(), topk_idx,
                                                                       T_MAX, NUM_EXPERTS)),
                ("another hidden, planned", lambda: buffer.low_latency_dispatch(
                    x[:, :HIDDEN // 2].contiguous(), topk_idx, T_MAX, NUM_EXPERTS)),
            ]:
                before_log, before_launches, parity = len(log), len(runtime.launches), buffer._backend._ll_parity
                call()
                steps.append((name, [entry[:2] for entry in log[before_log:]], len(runtime.launches) - before_launches,
                              buffer._backend._ll_parity != parity))
            recv_x, recv_count, handle, event, hook = buffer.low_latency_dispatch(x, topk_idx, T_MAX, NUM_EXPERTS)
            dispatch_facts = dict(handle_positions=handle[2:], num_tokens=handle.inner.num_tokens,
                                  parity=handle.inner.parity, event=event.event, hook=hook,
                                  recv_x=(recv_x[0].dtype, tuple(recv_x[0].shape), tuple(recv_x[1].shape)),
                                  count=tuple(recv_count.shape))
            expert_x = ctx.expert_outputs()
            before_log, before_launches = len(log), len(runtime.launches)
            combined, event, hook = buffer.low_latency_combine(expert_x, topk_idx, weights, handle)
            fast_combine = (log[before_log:], len(runtime.launches) - before_launches, tuple(combined.shape), hook)
            before_log, before_launches = len(log), len(runtime.launches)
            buffer.low_latency_combine(expert_x, topk_idx, weights, handle, async_finish=True)
            checked_combine = (log[before_log:], len(runtime.launches) - before_launches)
            return dict(steps=steps, dispatch=dispatch_facts, fast_combine=fast_combine,
                        checked_combine=checked_combine, hidden=HIDDEN, num_local=ctx.num_local)
        finally:
            buffer.destroy()


def test_eager_fast_path_takes_the_planned_plain_calls_and_nothing_else():
    results = parallel_launch(2, fast_path_worker, BASE_SEED, backend="gloo", timeout_s=120)
    for result in results:
        steps = {name: (tried, launched, flipped) for name, tried, launched, flipped in result["steps"]}
        # (fast-path calls tried, with whether they fitted; checked-path launches; whether the round moved)
        assert steps["first of its sizes"] == ([], 1, True), steps
        assert steps["planned"] == ([("dispatch", True)], 0, True), steps
        assert steps["planned, with stats"] == ([("dispatch", True)], 0, True), steps
        assert steps["T_max as a float"] == ([], 0, False), steps
        assert steps["column-major x"] == ([("dispatch", False)], 1, True), steps
        assert steps["hook"] == ([], 2, True), steps
        assert steps["async_finish"] == ([], 1, True), steps
        assert steps["weights at dispatch"] == ([], 1, True), steps
        assert steps["another hidden"] == ([("dispatch", False)], 1, True), steps
        assert steps["another hidden, planned"] == ([("dispatch", True)], 0, True), steps
        facts = result["dispatch"]
        assert facts["handle_positions"] == (T_MAX, result["hidden"], NUM_EXPERTS), facts
        assert facts["num_tokens"] == T_MAX - 3 and facts["event"] is None and facts["hook"] is None, facts
        rows = (result["num_local"], 2 * T_MAX)
        assert facts["recv_x"] == (torch.float8_e4m3fn, (*rows, result["hidden"]), (*rows, math.ceil(HIDDEN / 128))), facts
        assert facts["count"] == (result["num_local"],), facts
        log, launches, shape, hook = result["fast_combine"]
        assert [entry[:2] for entry in log] == [("combine", True)] and launches == 0, result["fast_combine"]
        assert log[0][2] == facts["parity"] and log[0][3] == T_MAX - 3 and log[0][4] is True, log
        assert shape == (T_MAX - 3, result["hidden"]) and hook is None
        assert result["checked_combine"] == ([], 1), result["checked_combine"]
