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


# ---- NormalInputs: the dispatch's tensors read in one binding call (backends/intranode.py) ----------------
def normal_inputs():
    from ep_plugin import _C_torch
    from ep_plugin.tuning import MAX_TOPK
    return _C_torch.NormalInputs(CPU, MAX_TOPK)


def fp8_payload(tokens: int = 5, hidden: int = 32, num_scales: int = 2, column_major: bool = False,
                dtype=torch.float32):
    data = torch.zeros(tokens, hidden, dtype=torch.float8_e4m3fn)
    scales = torch.ones(tokens, num_scales, dtype=dtype)
    return data, scales.t().contiguous().t() if column_major else scales


def address(tensor):
    return tensor.data_ptr() if tensor.numel() else 0


@pytest.mark.parametrize("column_major", [False, True], ids=["row_major", "column_major"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int32], ids=["float32", "int32"])
def test_normal_inputs_read_an_fp8_payload_as_python_would(column_major, dtype):
    data, scales = fp8_payload(column_major=column_major, dtype=dtype)
    for payload in ((data, scales), [data, scales]):
        assert normal_inputs().payload(payload, True) == (
            5, 32, data.data_ptr(), scales.data_ptr(), 2, *scales.stride(), dtype == torch.int32)


def test_normal_inputs_read_a_bf16_payload_and_a_dispatch_with_and_without_top_k():
    inputs = normal_inputs()
    x = torch.zeros(5, 16, dtype=torch.bfloat16)
    assert inputs.payload(x, True) == (5, 32, x.data_ptr(), 0, 0, 0, 0, False)
    ids, weights = torch.zeros(5, 3, dtype=torch.int64), torch.zeros(5, 3)
    per_rank, in_rank, per_expert = torch.zeros(2, dtype=torch.int32), torch.zeros(5, 2, dtype=torch.bool), \
        torch.zeros(8, dtype=torch.int32)
    read = inputs.dispatch(x, ids, weights, per_rank, in_rank, per_expert, 2, True)
    assert read == (5, 32, x.data_ptr(), 0, 0, 0, 0, False, 3, ids.data_ptr(), True, weights.data_ptr(), 8,
                    in_rank.data_ptr(), per_expert.data_ptr())
    assert inputs.dispatch(x, ids, None, None, in_rank, per_expert, 2, True)[8:12] == (3, ids.data_ptr(), False, 0)
    assert inputs.dispatch(x, None, None, per_rank, in_rank, per_expert, 2, True)[8:12] == (0, 0, False, 0)
    # No tokens: present weights have no address, as address_of gives them.
    empty = inputs.dispatch(x[:0], ids[:0], weights[:0], per_rank, in_rank[:0], per_expert, 2, True)
    assert empty[0] == 0 and empty[8:12] == (3, 0, True, 0)


def test_normal_inputs_return_none_where_the_kernels_cannot_read_an_argument_as_is():
    inputs = normal_inputs()
    data, scales = fp8_payload()
    x = torch.zeros(5, 16, dtype=torch.bfloat16)
    for payload in [x.float(), x[:, :8], x.t().contiguous().t(), x[None], (data, scales, scales), (data,),
                    (data.view(torch.uint8), scales), (data, scales.double()), (data, scales[:4]), (data, scales[:, :0]),
                    (data, scales.expand(5, 2)[:, :1].expand(5, 2)), (data[:, :8], scales), "x", None]:
        assert inputs.payload(payload, True) is None, payload
    ids, weights = torch.zeros(5, 3, dtype=torch.int64), torch.zeros(5, 3)
    per_rank, in_rank, per_expert = torch.zeros(2, dtype=torch.int32), torch.zeros(5, 2, dtype=torch.bool), \
        torch.zeros(8, dtype=torch.int32)
    good = dict(x=x, topk_idx=ids, topk_weights=weights, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert, num_ranks=2, exact=True)
    assert inputs.dispatch(**good) is not None
    for name, value in [("topk_idx", ids.int()), ("topk_idx", ids[:4]), ("topk_idx", ids.t().contiguous().t()),
                        ("topk_idx", torch.zeros(5, 33, dtype=torch.int64)), ("topk_weights", weights[:, :2]),
                        ("topk_weights", weights.double()), ("num_tokens_per_rank", per_rank[:1]),
                        ("num_tokens_per_rank", per_rank.long()), ("is_token_in_rank", in_rank[:, :1]),
                        ("is_token_in_rank", in_rank.t().contiguous().t()), ("num_tokens_per_expert", per_expert[:7]),
                        ("num_tokens_per_expert", per_expert[::2]), ("num_tokens_per_expert", per_expert[:0]),
                        ("num_ranks", 3)]:
        assert inputs.dispatch(**{**good, name: value}) is None, name
    assert inputs.dispatch(**{**good, "topk_idx": None}) is None  # weights without ids: the checked path says so


def test_normal_inputs_take_tensor_subclasses_only_when_not_exact():
    class Marked(torch.Tensor):
        pass

    x = torch.zeros(5, 16, dtype=torch.bfloat16).as_subclass(Marked)
    assert normal_inputs().payload(x, True) is None
    assert normal_inputs().payload(x, False)[:3] == (5, 32, x.data_ptr())


def test_normal_inputs_read_a_combine_and_refuse_what_the_kernels_cannot_read_as_is():
    inputs = normal_inputs()
    x, weights = torch.zeros(6, 16, dtype=torch.bfloat16), torch.zeros(6, 3)
    assert inputs.combine(x, weights, 6, True) == (x.data_ptr(), 16, 3, weights.data_ptr())
    assert inputs.combine(x, None, 6, True) == (x.data_ptr(), 16, 0, 0)
    assert inputs.combine(x[:0], weights[:0], 0, True) == (0, 16, 3, 0)
    for bad_x, bad_weights in [(x[:5], weights), (x.float(), weights), (x[:, :4], weights),
                               (x.t().contiguous().t(), None), (x, weights[:5]), (x, weights.double()),
                               (x, weights.t().contiguous().t()), (x, torch.zeros(6, 33)), (x, weights[:, :0]),
                               ("x", None)]:
        assert inputs.combine(bad_x, bad_weights, 6, True) is None
