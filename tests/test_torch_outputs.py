"""`ep_plugin._C_torch`'s OutputGroup, as the native backend uses it (native_common.output_group): a call's
outputs in one binding call, a block's outputs in one allocation, failures raised in Python (CPU; the same
code allocates on the GPU through torch's caching allocator)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("ep_plugin._C_torch", reason="ep_plugin._C_torch is built with the CUDA extensions")
from ep_plugin.backends.native_common import output_group  # noqa: E402

CPU = torch.device("cpu")
SPECS = [((4, -1), None, torch.int32), ((2, 3), (1, 2), torch.float32), ((-1,), None, torch.bool),
         ((3, 5, 7), None, torch.float8_e4m3fn)]


def alone(specs):
    """One block per spec: an allocation each."""
    return [[spec] for spec in specs]


def check_specs_shapes(outputs):
    a, b, c, d = outputs
    assert (a.shape, a.stride(), a.dtype) == ((4, 6), (6, 1), torch.int32)
    assert (b.shape, b.stride(), b.dtype) == ((2, 3), (1, 2), torch.float32)
    assert (c.shape, c.stride(), c.dtype) == ((6,), (1,), torch.bool)
    assert (d.shape, d.dtype, d.is_contiguous()) == ((3, 5, 7), torch.float8_e4m3fn, True)
    assert all(t.device == CPU and t.requires_grad is False for t in outputs)


@pytest.mark.parametrize("blocks", [alone(SPECS), [SPECS], [SPECS[:2], SPECS[2:]]], ids=["alone", "shared", "two"])
def test_shapes_strides_and_dtypes_with_rows_filled_in(blocks):
    group = output_group(blocks, CPU)
    check_specs_shapes(group.empty(6))
    assert group.empty(0)[0].shape == (4, 0)


def byte_range(tensor):
    """[first byte, one past the last byte) of the memory `tensor` covers."""
    last = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride())) if tensor.numel() else -1
    return tensor.data_ptr(), tensor.data_ptr() + (last + 1) * tensor.element_size()


def as_bytes_or_self(tensor):
    """One-byte types as bytes (so that any small value can be written and read back)."""
    return tensor.view(torch.uint8) if tensor.dtype in (torch.float8_e4m3fn, torch.bool) else tensor


def test_a_block_shares_one_allocation_without_overlap():
    outputs = output_group([SPECS], CPU).empty(6)
    base = outputs[0].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == base for t in outputs)
    ranges = sorted(byte_range(t) for t in outputs)
    assert all((start - base) % 256 == 0 for start, _ in ranges)
    assert all(previous_end <= start for (_, previous_end), (start, _) in zip(ranges, ranges[1:]))
    for value, t in enumerate(outputs, start=1):  # writing one leaves the others as they were
        as_bytes_or_self(t).fill_(value)
    assert all(as_bytes_or_self(t).eq(value).all() for value, t in enumerate(outputs, start=1))


def test_a_blocks_tensors_are_separate_tensors_on_one_storage():
    first, second = output_group([[((-1,), None, torch.int64), ((2,), None, torch.int64)]], CPU).empty(3)
    first.add_(0)  # an in-place change bumps only its own version counter
    assert (first._version, second._version) == (1, 0)
    assert not first._is_view() and not second._is_view()
    del first
    assert second.untyped_storage().nbytes() >= 256 + 16  # the allocation lives while any of its tensors does


def test_every_call_gets_its_own_storage():
    group = output_group([[((-1, 8), None, torch.int64)], [((16,), None, torch.int64)]], CPU)
    first, second = group.empty(4), group.empty(4)
    addresses = {t.data_ptr() for t in (*first, *second)}
    assert len(addresses) == 4
    first[0].fill_(1)
    second[0].fill_(2)
    assert first[0].eq(1).all()


@pytest.mark.parametrize("blocks", [alone(SPECS[:3]), [SPECS[:3]]], ids=["alone", "shared"])
def test_global_defaults_change_nothing(blocks):
    group = output_group(blocks, CPU)
    before = [(t.shape, t.stride(), t.dtype, t.device) for t in group.empty(5)]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert [(t.shape, t.stride(), t.dtype, t.device) for t in group.empty(5)] == before
    finally:
        torch.set_default_dtype(previous)


@pytest.mark.parametrize("blocks,message", [
    ([[((-2, 3), None, torch.int32)]], "extent -2"),
    ([[((2, 3), (1,), torch.int32)]], "1 strides for 2 sizes"),
    ([[((-1, 3), (3, 1), torch.int32)]], "strided outputs have fixed sizes"),
    ([[((2, 3), (3, -1), torch.int32)]], "stride -1"),
    ([[((2,), None, torch.int32)], []], "an empty block"),
])
def test_bad_specs_are_refused(blocks, message):
    with pytest.raises(ValueError, match=message):
        output_group(blocks, CPU)


def test_negative_rows_are_refused():
    with pytest.raises(ValueError, match="rows = -1"):
        output_group([[((-1,), None, torch.int32)]], CPU).empty(-1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (torch's CUDA caching allocator)")
@pytest.mark.parametrize("blocks", [[[((-1,), None, torch.float32)]], [[((-1,), None, torch.float32)] * 2]],
                         ids=["alone", "shared"])
def test_a_cuda_allocation_too_large_raises_torchs_out_of_memory_error(blocks):
    group = output_group(blocks, torch.device("cuda", 0))
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
        group.empty(1 << 45)  # 128 TiB
    outputs = group.empty(4)
    assert all(t.device == torch.device("cuda", 0) and t.shape == (4,) for t in outputs)


# ---- LowLatencyCalls: the eager low-latency fast path's binding (backends/low_latency.py) -------------
def low_latency_calls(launchers=None):
    """The calls of a small plan on the CPU (T_max 4, hidden 16, top-2, 2 local experts, 2 ranks, bf16) with a
    runtime that is none: whatever reaches the launcher is refused there, launching nothing."""
    nvshmem = pytest.importorskip("ep_plugin._C_nvshmem")
    from ep_plugin import _C_torch
    dispatch_outputs = output_group([[((2, 8, 16), None, torch.bfloat16)],
                                     [((2,), None, torch.int32), ((2, 8), None, torch.int32),
                                      ((2, 2), None, torch.int64)]], CPU)
    combine_output = output_group([[((-1, 16), None, torch.bfloat16)]], CPU)
    return _C_torch.low_latency_calls(dispatch_outputs.group, combine_output.group,
                                      nvshmem.low_latency_launchers if launchers is None else launchers, object(),
                                      nvshmem.DispatchArgs(), nvshmem.CombineArgs(), CPU, 4, 16, 2, 2, 2, False)


def test_low_latency_calls_take_only_their_launchers_capsule():
    kind, message = low_latency_calls(torch.utils.dlpack.to_dlpack(torch.zeros(1)))
    assert kind == "value" and "ep_plugin._C_nvshmem.low_latency_launchers" in message


def test_low_latency_calls_return_none_and_raise_nothing_where_they_cannot_launch():
    calls = low_latency_calls()
    x, ids, weights = torch.zeros(3, 16, dtype=torch.bfloat16), torch.zeros(3, 2, dtype=torch.int64), torch.zeros(3, 2)
    stats = torch.zeros(2, dtype=torch.int32)
    dispatches = [(x, ids, None), (x, ids, stats),  # fit: refused by the launcher (no runtime)
                  (x.float(), ids, None), (x[:, :8], ids, None), (torch.zeros(5, 16, dtype=torch.bfloat16), ids, None),
                  (x.t().contiguous().t(), ids, None), (x, ids.int(), None), (x, ids[:, :1], None),
                  (x[:0], ids[:0], None), ("x", ids, None), (x, ids, stats[:1]), (x, ids, "stats")]
    for args in dispatches:
        assert calls.dispatch(*args, parity=0, stream=0) is None
    expert_x, src_info, layout = (torch.zeros(2, 8, 16, dtype=torch.bfloat16), torch.zeros(2, 8, dtype=torch.int32),
                                  torch.zeros(2, 2, dtype=torch.int64))
    fitting = dict(x=expert_x, source=expert_x, topk_idx=ids, topk_weights=weights, out=None, recv_src_info=src_info,
                   recv_layout=layout, num_tokens=3)
    for change in ({}, {"out": torch.zeros(3, 16, dtype=torch.bfloat16)}, {"x": expert_x.float()},
                   {"source": expert_x[:1]}, {"topk_weights": weights.double()}, {"topk_idx": ids[:2]},
                   {"out": torch.zeros(3, 8, dtype=torch.bfloat16)}, {"num_tokens": 0}, {"recv_layout": None}):
        assert calls.combine(**{**fitting, **change}, parity=1, stream=0) is None


# ---- LayoutCalls: get_dispatch_layout's fast path binding (backends/intranode.py) --------------------------
def layout_calls(launcher=None, counts_nodes: bool = False):
    """The calls of 8 experts on 2 ranks on the CPU with a runtime that is not one: whatever reaches the
    launcher is refused there, launching nothing."""
    from ep_plugin import _C, _C_torch
    from ep_plugin.tuning import MAX_TOPK
    per_node = [((1,), None, torch.int32)] if counts_nodes else []
    outputs = output_group([[((2,), None, torch.int32), *per_node, ((8,), None, torch.int32),
                             ((-1, 2), None, torch.bool)]], CPU)
    return _C_torch.layout_calls(outputs.group, _C.layout_launcher if launcher is None else launcher, object(), CPU,
                                 8, 2, 1 if counts_nodes else 2, MAX_TOPK, counts_nodes)


def test_layout_calls_take_only_their_launcher_capsule():
    nvshmem = pytest.importorskip("ep_plugin._C_nvshmem")
    kind, message = layout_calls(nvshmem.low_latency_launchers)
    assert kind == "value" and "ep_plugin._C.layout_launcher" in message


@pytest.mark.parametrize("counts_nodes", [False, True], ids=["one_node", "two_nodes"])
def test_layout_calls_return_none_and_raise_nothing_where_they_cannot_launch(counts_nodes):
    calls = layout_calls(counts_nodes=counts_nodes)
    ids = torch.zeros(5, 4, dtype=torch.int64)
    for topk_idx in [ids, ids[:0],  # fit: refused by the launcher (no runtime)
                     ids.int(), ids[0], ids[None], ids.t().contiguous().t(), ids[:, :0],
                     torch.zeros(5, 33, dtype=torch.int64), "ids", None]:
        assert calls.layout(topk_idx, 0) is None
