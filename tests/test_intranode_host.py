"""The native intranode (normal-mode) host code, on CPU, through the public `ep_plugin.Buffer`: the outputs
it allocates (in the output region or not) and the Args each launch hands the kernels, recorded by a
stand-in runtime (tests/stand_in_native.py) whose `wait_notify` answers that every rank sent all its
tokens; bad input raises before any launch. The kernels themselves are tests/test_native_intranode.py's
(GPU). Two spawned ranks (2 ranks' shapes; the stand-in needs no peer); every case runs on each.
"""
from __future__ import annotations

import os
import random
from typing import Callable, Dict, List, Optional
from unittest import mock

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import DeviceContext

from case_runner import assert_case_passed, run_each
from native_helpers import copy_engines_at_any_size
from ep_plugin import Buffer, Config
from ep_plugin.backends import intranode as intranode_module
from ep_plugin.backends.intranode import IntranodeMode
from ep_plugin.bench import random_routing
from ep_plugin.handles import unwrap
from ep_plugin.launch import parallel_launch
from ep_plugin import tuning
from ep_plugin.tuning import MAX_TOPK

pytest.importorskip("ep_plugin._C", reason="the native extension is not built here")
from stand_in_native import RecordingIntranodeRuntime, StandInLowLatencyRuntime, stand_in_kernels  # noqa: E402

BASE_SEED = int(os.environ.get("EP_TEST_SEED", random.SystemRandom().randrange(1 << 30)))
T, HIDDEN, NUM_EXPERTS, TOPK = 24, 640, 8, 3  # 5 FP8 scales per row
CONFIG = Config(24, 8, 256)
# Room for one BF16 dispatch's outputs (48 rows: recv_x, top-k ids and weights, source index), not two.
SMALL_REGION_BYTES = 3 * 48 * (2 * HIDDEN + 12 * TOPK + 4) // 2


class Ctx:
    def __init__(self, rank: int, num_ranks: int, buffers: Dict[str, Buffer], seed: int, fast: bool) -> None:
        self.rank, self.num_ranks, self.buffers, self.fast = rank, num_ranks, buffers, fast
        self.gen = torch.Generator().manual_seed(seed + rank)
        self.num_local = NUM_EXPERTS // num_ranks
        self.rows = T * num_ranks  # what the stand-in's wait_notify answers

    def runtime(self, buffer: str = "direct") -> RecordingIntranodeRuntime:
        return self.buffers[buffer]._backend._runtime

    def inputs(self, fp8: bool = False, column_major_scales: bool = False):
        x = torch.randn(T, HIDDEN, generator=self.gen).to(torch.bfloat16)
        if fp8:
            scales = torch.rand(T, HIDDEN // 128, generator=self.gen)
            x = (x.to(torch.float8_e4m3fn), scales.T.contiguous().T if column_major_scales else scales)
        topk_idx = random_routing(T, NUM_EXPERTS, TOPK, "cpu", self.gen)
        weights = torch.rand(T, TOPK, generator=self.gen)
        return x, topk_idx, weights

    def dispatch(self, buffer: str = "direct", fp8: bool = False, column_major_scales: bool = False, **kwargs):
        """A dispatch with its layout; (inputs, outputs, the calls it made to the runtime)."""
        x, topk_idx, weights = self.inputs(fp8, column_major_scales)
        target = self.buffers[buffer]
        per_rank, _, per_expert, in_rank, _ = target.get_dispatch_layout(topk_idx, NUM_EXPERTS)
        first = len(self.runtime(buffer).launches)
        outputs = target.dispatch(x, topk_idx=topk_idx, topk_weights=weights, num_tokens_per_rank=per_rank,
                                  is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, config=CONFIG, **kwargs)
        return (x, topk_idx, weights, per_expert, in_rank), outputs, self.runtime(buffer).launches[first:]

    def in_region(self, tensor: torch.Tensor, buffer: str = "direct") -> bool:
        region = self.buffers[buffer]._backend._outputs
        return region.address <= tensor.data_ptr() < region.address + region.size


def _expect_fields(fields: Dict[str, object], **expected) -> None:
    for name, value in expected.items():
        assert fields[name] == value, f"Args.{name} = {fields[name]!r}, expected {value!r}"


def _data(x):
    return x[0] if isinstance(x, tuple) else x


def _input_fields(x, topk_idx, weights, handle) -> Dict[str, object]:
    inner = unwrap(handle)
    data, scales = (x[0], x[1]) if isinstance(x, tuple) else (x, None)
    return dict(x=data.data_ptr(), x_scales=0 if scales is None else scales.data_ptr(),
                scale_token_stride=0 if scales is None else scales.stride(0),
                scale_stride=0 if scales is None else scales.stride(1), num_tokens=T,
                row_bytes=HIDDEN * data.element_size(), num_scales=0 if scales is None else scales.size(1),
                topk_idx=0 if topk_idx is None else topk_idx.data_ptr(),
                topk_weights=0 if weights is None else weights.data_ptr(), send_pos=inner.send_pos.data_ptr(),
                num_recv_tokens=inner.num_recv_device.data_ptr(), num_channels=CONFIG.num_channels,
                recv_tokens_per_channel=CONFIG.num_max_nvl_chunked_recv_tokens,
                send_chunk=CONFIG.num_max_nvl_chunked_send_tokens)


def _check_metadata(ctx: Ctx, recv_topk_idx, recv_weights, handle, in_region: bool, buffer: str = "direct") -> None:
    rows = ctx.rows if unwrap(handle).num_worst_tokens == 0 else unwrap(handle).num_worst_tokens
    assert recv_topk_idx.dtype == torch.int64 and recv_topk_idx.shape == (rows, TOPK)
    assert recv_weights.dtype == torch.float32 and recv_weights.shape == (rows, TOPK)
    src_idx = unwrap(handle).recv_src_idx
    assert src_idx.dtype == torch.int32 and src_idx.shape == (rows,)
    for tensor in (recv_topk_idx, recv_weights, src_idx):
        assert tensor.is_contiguous() and ctx.in_region(tensor, buffer) == in_region


def _last_launch(calls):
    """The last kernel launch recorded (the counts' read after a dispatch is not one)."""
    return [call for call in calls if call[0] != "notify_counts"][-1]


def case_bf16_dispatch_direct(ctx: Ctx) -> None:
    """notify, the wait for its tag, then the direct dispatch into outputs in the output region: the Args name
    every input and output; rows from the wait; the per-expert counts are the wait's."""
    (x, topk_idx, weights, per_expert, in_rank), outputs, calls = ctx.dispatch()
    recv_x, recv_topk_idx, recv_weights, per_expert_list, handle, _ = outputs
    # The counts' lists are read after the launch: nothing but the row count stands before it.
    assert [call[0] for call in calls] == ["notify", "wait_notify", "direct_dispatch", "notify_counts"]
    notify, dispatch = calls[0][1], calls[2][1]
    inner = unwrap(handle)
    _expect_fields(notify, is_token_in_rank=in_rank.data_ptr(), num_tokens_per_expert=per_expert.data_ptr(),
                   topk_idx=topk_idx.data_ptr(), num_tokens=T, num_topk=TOPK, num_experts=NUM_EXPERTS,
                   expert_alignment=1, num_worst_tokens=0, send_pos=inner.send_pos.data_ptr(),
                   recv_rank_offsets=inner.recv_rank_offsets.data_ptr(),
                   src_num_tokens=inner.src_num_tokens.data_ptr(), num_recv_tokens=inner.num_recv_device.data_ptr(),
                   row_layout=intranode_module._C.pack_row_layout(HIDDEN * 2, 0, TOPK, True))
    assert calls[1][2] == (notify["host_tag"],) and notify["host_tag"] > 0
    assert calls[3][2] == (ctx.num_local,)
    assert calls[2][2] == (ctx.rows, True)
    assert recv_x.dtype == torch.bfloat16 and recv_x.shape == (ctx.rows, HIDDEN) and ctx.in_region(recv_x)
    _check_metadata(ctx, recv_topk_idx, recv_weights, handle, in_region=True)
    _expect_fields(dispatch, **_input_fields(x, topk_idx, weights, handle), num_topk=TOPK,
                   num_local_experts=ctx.num_local, num_worst_tokens=0, recv_x=recv_x.data_ptr(), recv_x_scales=0,
                   recv_topk_idx=recv_topk_idx.data_ptr(), recv_topk_weights=recv_weights.data_ptr(),
                   recv_src_idx=inner.recv_src_idx.data_ptr())
    assert per_expert_list == ctx.runtime().received(T, ctx.num_local, 1)[2]
    assert inner.num_recv_tokens == ctx.rows and inner.num_recv_per_rank == [T] * ctx.num_ranks
    assert ctx.buffers["direct"]._backend.last_dispatch_path == "direct"


def case_fp8_dispatch_and_cached(ctx: Ctx) -> None:
    """FP8: the scales travel in the rows' block; a cached dispatch sets only the rows and scales."""
    (x, topk_idx, weights, _, _), outputs, calls = ctx.dispatch(fp8=True, expert_alignment=4)
    (recv_x, recv_scales), _, _, per_expert_list, handle, _ = outputs
    assert recv_x.dtype == torch.float8_e4m3fn and recv_x.shape == (ctx.rows, HIDDEN)
    assert recv_scales.dtype == torch.float32 and recv_scales.shape == (ctx.rows, HIDDEN // 128)
    assert ctx.in_region(recv_x) and ctx.in_region(recv_scales)
    assert all(count % 4 == 0 for count in per_expert_list) and calls[0][1]["expert_alignment"] == 4
    _expect_fields(_last_launch(calls)[1], **_input_fields(x, topk_idx, weights, handle), recv_x=recv_x.data_ptr(),
                   recv_x_scales=recv_scales.data_ptr())

    first = len(ctx.runtime().launches)
    (cached_x, cached_scales), none_idx, none_weights, none_list, none_handle, _ = ctx.buffers["direct"].dispatch(
        x, handle=handle, config=CONFIG)
    assert none_idx is none_weights is none_list is none_handle is None
    calls = ctx.runtime().launches[first:]
    assert [call[0] for call in calls] == ["direct_dispatch"] and calls[0][2] == (ctx.rows, True)
    assert cached_x.shape == recv_x.shape and cached_scales.shape == recv_scales.shape and ctx.in_region(cached_x)
    _expect_fields(calls[0][1], **_input_fields(x, None, None, handle), num_topk=0, num_local_experts=1,
                   num_worst_tokens=0, recv_x=cached_x.data_ptr(), recv_x_scales=cached_scales.data_ptr(),
                   recv_topk_idx=0, recv_topk_weights=0, recv_src_idx=0)


def case_fp8_column_major_scales_read_in_place(ctx: Ctx) -> None:
    """Column-major scales (DeepGEMM's layout) reach the kernels as they are, with their strides: no copy."""
    (x, topk_idx, weights, _, _), outputs, calls = ctx.dispatch(fp8=True, column_major_scales=True)
    (recv_x, recv_scales), _, _, _, handle, _ = outputs
    assert x[1].stride() == (1, T)
    assert recv_scales.is_contiguous() and recv_scales.shape == (ctx.rows, HIDDEN // 128)
    _expect_fields(_last_launch(calls)[1], **_input_fields(x, topk_idx, weights, handle), recv_x=recv_x.data_ptr(),
                   recv_x_scales=recv_scales.data_ptr())  # x_scales: the caller's tensor, strides (1, T)


def case_num_worst_tokens(ctx: Ctx) -> None:
    """num_worst_tokens: no wait; outputs of that many rows; no per-expert counts; the SM combine."""
    worst = 3 * T
    (x, topk_idx, weights, _, _), outputs, calls = ctx.dispatch(num_worst_tokens=worst)
    recv_x, recv_topk_idx, recv_weights, per_expert_list, handle, _ = outputs
    assert [call[0] for call in calls] == ["notify", "direct_dispatch"] and calls[1][2] == (worst, True)
    assert calls[0][1]["host_tag"] == 0 and calls[0][1]["num_worst_tokens"] == worst
    assert per_expert_list == [] and recv_x.shape == (worst, HIDDEN)
    _check_metadata(ctx, recv_topk_idx, recv_weights, handle, in_region=True)
    _expect_fields(calls[1][1], num_worst_tokens=worst, recv_x=recv_x.data_ptr())
    combined, combined_weights, _ = ctx.buffers["direct"].combine(recv_x, handle, recv_weights, config=CONFIG)
    operation, fields, _ = ctx.runtime().launches[-1]
    assert operation == "combine" and combined.shape == (T, HIDDEN) and combined_weights.shape == (T, TOPK)
    inner = unwrap(handle)
    _expect_fields(fields, x=recv_x.data_ptr(), topk_weights=recv_weights.data_ptr(), num_tokens=T, hidden=HIDDEN,
                   num_topk=TOPK, recv_src_idx=inner.recv_src_idx.data_ptr(),
                   recv_rank_offsets=inner.recv_rank_offsets.data_ptr(), src_num_tokens=inner.src_num_tokens.data_ptr(),
                   send_pos=inner.send_pos.data_ptr(), bias_0=0, bias_1=0, num_channels=CONFIG.num_channels,
                   recv_tokens_per_channel=CONFIG.num_max_nvl_chunked_recv_tokens,
                   send_chunk=CONFIG.num_max_nvl_chunked_send_tokens,
                   combined_x=combined.data_ptr(), combined_topk_weights=combined_weights.data_ptr())
    bias = torch.zeros(T, HIDDEN, dtype=torch.bfloat16), torch.ones(T, HIDDEN, dtype=torch.bfloat16)
    ctx.buffers["direct"].combine(recv_x, handle, recv_weights, bias=bias, config=CONFIG)
    _expect_fields(ctx.runtime().launches[-1][1], bias_0=bias[0].data_ptr(), bias_1=bias[1].data_ptr())


def case_copy_engine_combine(ctx: Ctx) -> None:
    """A combine after a dispatch that waited for its counts goes through the copy engines, rows per source
    from the wait."""
    _, outputs, _ = ctx.dispatch()
    recv_x, _, recv_weights, _, handle, _ = outputs
    combined, combined_weights, _ = ctx.buffers["direct"].combine(recv_x, handle, recv_weights, config=CONFIG)
    operation, fields, (rows_from, _, num_sms) = ctx.runtime().launches[-1]
    assert operation == "staged_combine" and rows_from == [T] * ctx.num_ranks and num_sms == CONFIG.num_sms
    _expect_fields(fields, x=recv_x.data_ptr(), topk_weights=recv_weights.data_ptr(), pull_rows=0, num_tokens=T,
                   hidden=HIDDEN, num_topk=TOPK, send_pos=unwrap(handle).send_pos.data_ptr(), bias_0=0, bias_1=0,
                   combined_x=combined.data_ptr(), combined_topk_weights=combined_weights.data_ptr())


def case_small_combine_takes_the_rings(ctx: Ctx) -> None:
    """A combine whose largest block (the most rows any rank sends any one rank) is below the copy engines'
    least bytes takes the rings; at that least it takes the engines."""
    _, outputs, _ = ctx.dispatch()
    recv_x, _, recv_weights, _, handle, _ = outputs
    block_bytes = unwrap(handle).largest_block_rows * 2 * HIDDEN
    paths = []
    try:
        for least in (block_bytes + 1, block_bytes):
            tuning.COPY_ENGINE_MIN_BLOCK_BYTES = least
            ctx.buffers["direct"].combine(recv_x, handle, recv_weights, config=CONFIG)
            paths.append((ctx.runtime().launches[-1][0], ctx.buffers["direct"]._backend.last_combine_path))
    finally:
        tuning.COPY_ENGINE_MIN_BLOCK_BYTES = 0
    assert paths == [("combine", "sm"), ("staged_combine", "copy_engine")], paths


def case_full_region_falls_back(ctx: Ctx) -> None:
    """A region without room for a second dispatch's outputs: ordinary tensors, and the direct dispatch told
    so (it falls back to the rings on every rank); the first dispatch's blocks come back when its
    outputs go."""
    _, first, calls = ctx.dispatch("small")
    assert _last_launch(calls)[0] == "direct_dispatch" and _last_launch(calls)[2] == (ctx.rows, True) and ctx.in_region(first[0], "small")
    (x, topk_idx, weights, _, _), second, calls = ctx.dispatch("small")
    recv_x, recv_topk_idx, recv_weights, _, handle, _ = second
    assert _last_launch(calls)[0] == "direct_dispatch" and _last_launch(calls)[2] == (ctx.rows, False)
    assert not ctx.in_region(recv_x, "small")
    _check_metadata(ctx, recv_topk_idx, recv_weights, handle, in_region=False, buffer="small")
    _expect_fields(_last_launch(calls)[1], **_input_fields(x, topk_idx, weights, handle), recv_x=recv_x.data_ptr(),
                   recv_topk_idx=recv_topk_idx.data_ptr(), recv_src_idx=unwrap(handle).recv_src_idx.data_ptr())
    assert ctx.buffers["small"]._backend.last_dispatch_path == "direct"
    del first, second, recv_x, recv_topk_idx, recv_weights, handle
    _, third, calls = ctx.dispatch("small")
    assert _last_launch(calls)[2] == (ctx.rows, True) and ctx.in_region(third[0], "small")


def case_rings_without_region(ctx: Ctx) -> None:
    """No output region: the ring dispatch into ordinary tensors."""
    (x, topk_idx, weights, _, _), outputs, calls = ctx.dispatch("rings")
    recv_x, recv_topk_idx, recv_weights, _, handle, _ = outputs
    assert [call[0] for call in calls] == ["notify", "wait_notify", "dispatch", "notify_counts"]
    assert recv_x.shape == (ctx.rows, HIDDEN) and recv_topk_idx.shape == (ctx.rows, TOPK)
    _expect_fields(_last_launch(calls)[1], **_input_fields(x, topk_idx, weights, handle), recv_x=recv_x.data_ptr(),
                   recv_topk_idx=recv_topk_idx.data_ptr(), recv_topk_weights=recv_weights.data_ptr(),
                   recv_src_idx=unwrap(handle).recv_src_idx.data_ptr())
    assert ctx.buffers["rings"]._backend.last_dispatch_path == "rings"


def case_capture_takes_the_rings(ctx: Ctx) -> None:
    """Under CUDA-graph capture (num_worst_tokens): the rings into ordinary tensors, the SM combine."""
    with mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: True):
        _, outputs, calls = ctx.dispatch(num_worst_tokens=2 * T)
        recv_x, _, recv_weights, _, handle, _ = outputs
        assert [call[0] for call in calls] == ["notify", "dispatch"] and not ctx.in_region(recv_x)
        ctx.buffers["direct"].combine(recv_x, handle, recv_weights, config=CONFIG)
    assert ctx.runtime().launches[-1][0] == "combine"


def case_bad_input_launches_nothing(ctx: Ctx) -> None:
    """Each bad argument gets its error, naming it, and no kernel is launched."""
    x, topk_idx, weights = ctx.inputs()
    buffer = ctx.buffers["direct"]
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, NUM_EXPERTS)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    _, outputs, _ = ctx.dispatch()
    handle = outputs[4]
    count = len(ctx.runtime().launches)
    bad_calls = [
        (ValueError, "topk_idx must have size", lambda: buffer.dispatch(x, topk_idx=topk_idx[1:], **layout)),
        (ValueError, "topk_weights needs topk_idx", lambda: buffer.dispatch(x, topk_weights=weights, **layout)),
        (ValueError, "num_worst_tokens", lambda: buffer.dispatch(x, topk_idx=topk_idx, num_worst_tokens=-1, **layout)),
        (ValueError, "is_token_in_rank must have size",
         lambda: buffer.dispatch(x, topk_idx=topk_idx, **{**layout, "is_token_in_rank": in_rank[1:]})),
        (ValueError, "takes no topk_idx", lambda: buffer.dispatch(x, handle=handle, topk_idx=topk_idx)),
        (ValueError, "tokens but the handle", lambda: buffer.dispatch(x[1:], handle=handle)),
        (ValueError, "x must have size", lambda: buffer.combine(x, handle)),
    ]
    for error, message, call in bad_calls:
        with pytest.raises(error, match=message):
            call()
    assert len(ctx.runtime().launches) == count, "a rejected call must launch no kernel"


class RecordingLayoutCalls:
    """An expert count's `_C_torch.LayoutCalls` on the host: it takes what the C++ side takes (contiguous
    int64 [T, K], K in [1, MAX_TOPK]; no launch) and records every call; None for the rest."""

    def __init__(self, outputs, num_experts: int, log: list) -> None:
        self.outputs, self.num_experts, self.log = outputs, num_experts, log

    def layout(self, topk_idx, stream):
        fits = (topk_idx.dtype == torch.int64 and topk_idx.dim() == 2 and topk_idx.is_contiguous()
                and 1 <= topk_idx.size(1) <= MAX_TOPK)
        self.log.append((self.num_experts, fits))
        if not fits:
            return None
        per_rank, per_expert, in_rank = self.outputs.empty(topk_idx.size(0))
        return per_rank, None, per_expert, in_rank


def case_layout_fast_path(ctx: Ctx) -> None:
    """get_dispatch_layout: after one checked call of an expert count, its plain calls take the fast path
    (backends/intranode.py) and nothing else does; what the fast path refuses runs on the checked path."""
    buffer = ctx.buffers["rings"]
    backend = buffer._backend
    log, checked = [], []
    kernel = intranode_module._C.get_dispatch_layout

    def checked_kernel(*args):
        checked.append(args[3])  # num_experts
        return kernel(*args)

    _, topk_idx, _ = ctx.inputs()
    experts = 2 * NUM_EXPERTS  # an expert count no other case plans
    steps = []
    with mock.patch.object(IntranodeMode, "_make_layout_calls",
                           lambda self, outputs, num_experts: RecordingLayoutCalls(outputs, num_experts, log)), \
            mock.patch.object(intranode_module._C, "get_dispatch_layout", checked_kernel):
        # A CPU buffer has no fast path: open it as a GPU buffer would have it.
        buffer._unchecked_layout, buffer._plain_call = backend, lambda: True
        try:
            for name, call in [
                ("first of its expert count", lambda: buffer.get_dispatch_layout(topk_idx, experts)),
                ("planned", lambda: buffer.get_dispatch_layout(topk_idx, experts)),
                ("column-major ids", lambda: buffer.get_dispatch_layout(topk_idx.t().contiguous().t(), experts)),
                ("async_finish", lambda: buffer.get_dispatch_layout(topk_idx, experts, async_finish=True)),
                ("previous_event", lambda: buffer.get_dispatch_layout(topk_idx, experts,
                                                                      previous_event=buffer.capture())),
                ("num_experts as a float", lambda: pytest.raises(ValueError, buffer.get_dispatch_layout, topk_idx,
                                                                 float(experts))),
                ("another expert count", lambda: buffer.get_dispatch_layout(topk_idx, experts // 2)),
            ]:
                before_log, before_checked = len(log), len(checked)
                result = call()
                steps.append((name, log[before_log:], checked[before_checked:]))
                if name == "planned":
                    planned = result
        finally:
            buffer._unchecked_layout = None
            if not ctx.fast:  # then host_worker opened no fast path
                del buffer._plain_call
    steps = {name: (tried, ran) for name, tried, ran in steps}
    # (fast-path calls tried, with whether they fitted; the checked path's kernel launches, by expert count)
    assert steps["first of its expert count"] == ([], [experts]), steps
    assert steps["planned"] == ([(experts, True)], []), steps
    assert steps["column-major ids"] == ([(experts, False)], [experts]), steps
    assert steps["async_finish"] == ([], [experts]), steps
    assert steps["previous_event"] == ([], [experts]), steps
    assert steps["num_experts as a float"] == ([], []), steps
    assert steps["another expert count"] == ([], [experts // 2]), steps
    per_rank, per_node, per_expert, in_rank, event = planned
    assert per_node is None and event.event is None
    assert (per_rank.shape, per_expert.shape, in_rank.shape) == ((ctx.num_ranks,), (experts,), (T, ctx.num_ranks))
    assert (per_rank.dtype, per_expert.dtype, in_rank.dtype) == (torch.int32, torch.int32, torch.bool)


def case_dispatch_fast_path(ctx: Ctx) -> None:
    """With the eager fast path open (a GPU buffer's, see host_worker), plain dispatches, cached dispatches and
    combines take it and the rest do not: an event, async_finish, num_worst_tokens, column-major ids or
    weights, a bias, a handle of another buffer's. Every case above runs with it open as well, checking the
    same Args."""
    backend = ctx.buffers["direct"]._backend
    taken = []

    def recording(name):
        method = getattr(backend, name)

        def call(*args, **kwargs):
            result = method(*args, **kwargs)
            taken.append((name, result is not None))
            return result
        return call

    with mock.patch.object(backend, "unchecked_dispatch", recording("unchecked_dispatch")), \
            mock.patch.object(backend, "unchecked_cached_dispatch", recording("unchecked_cached_dispatch")), \
            mock.patch.object(backend, "unchecked_combine", recording("unchecked_combine")):
        x, topk_idx, weights = ctx.inputs(fp8=True, column_major_scales=True)
        buffer = ctx.buffers["direct"]
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, NUM_EXPERTS)
        layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
        _, _, recv_weights, _, handle, _ = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=weights, **layout)
        buffer.dispatch(x, handle=handle)
        expert_out = torch.zeros(ctx.rows, HIDDEN, dtype=torch.bfloat16)
        buffer.combine(expert_out, handle, recv_weights)
        buffer.combine(expert_out, handle, recv_weights.t().contiguous().t())
        buffer.combine(expert_out, handle, bias=torch.zeros(T, HIDDEN, dtype=torch.bfloat16))
        buffer.dispatch(x, topk_idx=topk_idx.t().contiguous().t(), **layout)
        buffer.dispatch(x, topk_idx=topk_idx, async_finish=True, **layout)
        buffer.dispatch(x, topk_idx=topk_idx, previous_event=buffer.capture(), **layout)
        buffer.dispatch(x, topk_idx=topk_idx, num_worst_tokens=3 * T, **layout)
        other = ctx.buffers["rings"].dispatch(x, topk_idx=topk_idx, **layout)[4]
        with pytest.raises(ValueError, match="does not come from this Buffer"):
            buffer.dispatch(x, handle=other)
    if not ctx.fast:
        assert taken == [], taken
        return
    assert taken == [("unchecked_dispatch", True), ("unchecked_cached_dispatch", True), ("unchecked_combine", True),
                     ("unchecked_combine", False), ("unchecked_dispatch", False),
                     ("unchecked_cached_dispatch", False)], taken
    # Torch calls from Python on the fast path (under a default-device mode each passes through it): only the
    # address of notify's words.
    seen = []

    class Recording(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    with Recording():
        handle = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=weights, **layout)[4]
        buffer.dispatch(x, handle=handle)
    assert seen == ["data_ptr"], seen
    # Under torch.set_default_device's mode alone, the dispatch and the combine run with it off: none passes.
    seen.clear()

    def through_device_mode(mode, func, types, args=(), kwargs=None):
        seen.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))

    with mock.patch.object(DeviceContext, "__torch_function__", through_device_mode), DeviceContext("cpu"):
        _, _, recv_weights, _, handle, _ = buffer.dispatch(x, topk_idx=topk_idx, topk_weights=weights, **layout)
        buffer.dispatch(x, handle=handle)
        buffer.combine(expert_out, handle, recv_weights)
    assert seen == [], seen


CASES = [name for name in globals() if name.startswith("case_")]


def _cases(ctx: Ctx) -> Dict[str, Callable[[], None]]:
    return {name: (lambda fn=globals()[name]: fn(ctx)) for name in CASES}


def _buffer(group, dispatch_output_bytes) -> Buffer:
    num_nvl_bytes = CONFIG.get_nvl_buffer_size_hint(2 * HIDDEN, group.size())
    config = {"buffer": {"max_hidden": HIDDEN, "dispatch_output_bytes": dispatch_output_bytes}}
    buffer = Buffer(group, num_nvl_bytes, explicitly_destroy=True, config=config)
    assert buffer.backend_name == "native"
    return buffer


def host_worker(rank: int, num_ranks: int, group, seed: int, fast: bool) -> Dict[str, Optional[str]]:
    """Every case on each rank; `fast`: the dispatch's eager fast path open, as on a GPU (a CPU buffer has none)."""
    copy_engines_at_any_size()
    with stand_in_kernels(StandInLowLatencyRuntime(), intranode=RecordingIntranodeRuntime):
        buffers = {"direct": _buffer(group, "auto"), "small": _buffer(group, SMALL_REGION_BYTES),
                   "rings": _buffer(group, 0)}
        if fast:
            for buffer in buffers.values():
                buffer._unchecked_normal, buffer._plain_call = buffer._backend, lambda: True
        try:
            return run_each(_cases(Ctx(rank, num_ranks, buffers, seed, fast)), CASES)
        finally:
            for buffer in buffers.values():
                buffer.destroy()


@pytest.fixture(scope="module", params=[False, True], ids=["checked", "fast_path"])
def results(request):
    return parallel_launch(2, host_worker, BASE_SEED, request.param, backend="gloo", timeout_s=120)


@pytest.mark.parametrize("case", CASES)
def test_intranode_host(results, case):
    assert_case_passed(results, case, f"EP_TEST_SEED={BASE_SEED}")


def pulled_combine_worker(rank: int, num_ranks: int, group, seed: int) -> List[object]:
    """At 4 ranks: the combine after a dispatch that waited for its counts pulls the rows (pull_rows set) where
    the most rows any rank sends any owner fit the staging area and make at least the pull's least bytes, and
    takes the rings where they do not (the stand-in's notify then reports one row more than the area holds,
    or one row fewer than the least, as it would on every rank)."""
    seen = []
    least_rows = 8
    tuning.PULL_MIN_BLOCK_BYTES = least_rows * 2 * HIDDEN
    with stand_in_kernels(StandInLowLatencyRuntime(), intranode=RecordingIntranodeRuntime):
        buffer = _buffer(group, "auto")
        try:
            ctx = Ctx(rank, num_ranks, {"direct": buffer}, seed, fast=False)
            area_rows = ctx.runtime().staging_rows(buffer._backend._staging_bytes, HIDDEN)
            counts = RecordingIntranodeRuntime.notify_counts
            for largest in (None, area_rows + 1, least_rows - 1):
                if largest is not None:
                    ctx.runtime().notify_counts = lambda n, largest=largest: counts(ctx.runtime(), n)[:2] + (largest,)
                _, outputs, _ = ctx.dispatch()
                recv_x, _, recv_weights, _, handle, _ = outputs
                buffer.combine(recv_x, handle, recv_weights, config=CONFIG)
                operation, fields, extra = ctx.runtime().launches[-1]
                seen.append((operation, buffer._backend.last_combine_path, fields.get("pull_rows"),
                             extra[0] if operation == "staged_combine" else None))
        finally:
            buffer.destroy()
    return seen


def test_pulled_combine_at_four_ranks():
    for seen in parallel_launch(4, pulled_combine_worker, BASE_SEED, backend="gloo", timeout_s=120):
        assert seen == [("staged_combine", "pull", 1, [T] * 4), ("combine", "sm", None, None),
                        ("combine", "sm", None, None)], seen


def _constructor_parameters(cls) -> List[str]:
    """The parameter names of the binding's constructor that takes the most (pybind's signature)."""
    import re
    signatures = re.findall(r"__init__\(self: [\w.]+((?:, \w+: [^,)]+)*)\)", cls.__init__.__doc__)
    return max((re.findall(r", (\w+): ", params) for params in signatures), key=len)


@pytest.mark.parametrize("name", ["NotifyArgs", "DispatchArgs", "CombineArgs", "StagedReduceArgs"])
def test_positional_args_constructors_fill_the_fields_their_parameters_name(name):
    """The eager paths build their Args positionally: each argument lands in the field of its parameter's name
    (distinct values, so a crossed pair shows)."""
    from ep_plugin.backends.native_common import _C
    cls = getattr(_C, name)
    parameters = _constructor_parameters(cls)
    values = [1024 + 16 * i for i in range(len(parameters))]
    args = cls(*values)
    assert len(parameters) >= 11 and {p: getattr(args, p) for p in parameters} == dict(zip(parameters, values))
