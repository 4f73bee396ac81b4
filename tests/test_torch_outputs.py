"""`ep_plugin._C_torch.OutputGroup`: a native call's outputs in one binding call (CPU; the same code
allocates on the GPU through torch's caching allocator)."""
from __future__ import annotations

import pytest
import torch

_C_torch = pytest.importorskip("ep_plugin._C_torch", reason="ep_plugin._C_torch is built with the CUDA extensions")

CPU = torch.device("cpu")


def test_shapes_strides_and_dtypes_with_rows_filled_in():
    group = _C_torch.output_group([((4, -1), None, torch.int32), ((2, 3), (1, 2), torch.float32),
                                  ((-1,), None, torch.bool), ((3, 5, 7), None, torch.float8_e4m3fn)], CPU)
    a, b, c, d = group.empty(6)
    assert (a.shape, a.stride(), a.dtype) == ((4, 6), (6, 1), torch.int32)
    assert (b.shape, b.stride(), b.dtype) == ((2, 3), (1, 2), torch.float32)
    assert (c.shape, c.dtype) == ((6,), torch.bool)
    assert (d.shape, d.dtype, d.is_contiguous()) == ((3, 5, 7), torch.float8_e4m3fn, True)
    assert all(t.device == CPU for t in (a, b, c, d))
    assert group.empty(0)[0].shape == (4, 0)


def test_every_call_gets_its_own_storage():
    group = _C_torch.output_group([((-1, 8), None, torch.int64), ((16,), None, torch.int64)], CPU)
    first, second = group.empty(4), group.empty(4)
    addresses = {t.data_ptr() for t in (*first, *second)}
    assert len(addresses) == 4
    first[0].fill_(1)
    second[0].fill_(2)
    assert first[0].eq(1).all()


def test_global_defaults_change_nothing():
    group = _C_torch.output_group([((-1, 3), None, torch.bfloat16), ((2,), None, torch.int32)], CPU)
    before = [(t.shape, t.dtype, t.device) for t in group.empty(5)]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert [(t.shape, t.dtype, t.device) for t in group.empty(5)] == before
    finally:
        torch.set_default_dtype(previous)


@pytest.mark.parametrize("specs,message", [
    ([((-2, 3), None, torch.int32)], "extent -2"),
    ([((2, 3), (1,), torch.int32)], "1 strides for 2 sizes"),
    ([((-1, 3), (3, 1), torch.int32)], "strided outputs have fixed sizes"),
])
def test_bad_specs_are_refused(specs, message):
    with pytest.raises(RuntimeError, match=message):
        _C_torch.output_group(specs, CPU)


def test_negative_rows_are_refused():
    with pytest.raises(RuntimeError, match="rows = -1"):
        _C_torch.output_group([((-1,), None, torch.int32)], CPU).empty(-1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (torch's CUDA caching allocator)")
def test_a_cuda_allocation_too_large_raises_torchs_out_of_memory_error():
    group = _C_torch.output_group([((-1,), None, torch.float32)], torch.device("cuda", 0))
    with pytest.raises(torch.OutOfMemoryError):
        group.empty(1 << 45)  # 128 TiB
    assert group.empty(4)[0].device == torch.device("cuda", 0)
