"""The output region's allocator (csrc/output_region.h through ep_plugin/output_region.py): offsets,
coalescing, what a reuse from another stream must wait for, and that a block returns only when the last
tensor on it is gone. Over host memory: no GPU (runs wherever ep_plugin._C imports, CI included)."""
from __future__ import annotations

import gc
import random

import pytest
import torch

from ep_plugin import tuning
from ep_plugin.config import ConfigError, as_config
from ep_plugin.output_region import OutputRegion, byte_shape

_C = pytest.importorskip("ep_plugin._C", reason="the native extension is not built here")
ALIGNMENT = _C.REGION_ALIGNMENT
RangeAllocator = _C.RegionRanges


def test_first_fit_aligned_offsets():
    ranges = RangeAllocator(10 * ALIGNMENT)
    assert ranges.allocate(1)[0] == 0
    assert ranges.allocate(ALIGNMENT + 1)[0] == ALIGNMENT
    assert ranges.allocate(ALIGNMENT)[0] == 3 * ALIGNMENT
    assert ranges.free_bytes() == 6 * ALIGNMENT


def test_full_region_returns_none():
    ranges = RangeAllocator(4 * ALIGNMENT)
    assert ranges.allocate(4 * ALIGNMENT)[0] == 0
    assert ranges.allocate(1) is None
    ranges.release(0, 4 * ALIGNMENT, stream=1, marker=0)
    assert ranges.allocate(4 * ALIGNMENT)[0] == 0


def test_frees_coalesce_into_one_range():
    ranges = RangeAllocator(8 * ALIGNMENT)
    offsets = [ranges.allocate(2 * ALIGNMENT)[0] for _ in range(4)]
    for offset in (offsets[1], offsets[3], offsets[0], offsets[2]):  # out of order
        ranges.release(offset, 2 * ALIGNMENT, stream=1, marker=offset)
    assert ranges.largest_free() == 8 * ALIGNMENT
    assert ranges.allocate(8 * ALIGNMENT)[0] == 0


def test_reuse_reports_the_latest_release_per_stream():
    ranges = RangeAllocator(4 * ALIGNMENT)
    a = ranges.allocate(ALIGNMENT)[0]
    b = ranges.allocate(ALIGNMENT)[0]
    c = ranges.allocate(2 * ALIGNMENT)[0]
    ranges.release(a, ALIGNMENT, stream=7, marker=71)
    ranges.release(b, ALIGNMENT, stream=7, marker=72)
    ranges.release(c, 2 * ALIGNMENT, stream=9, marker=91)
    offset, pending = ranges.allocate(4 * ALIGNMENT)
    assert offset == 0
    assert pending == {7: 72, 9: 91}


def test_split_range_keeps_its_pending_work():
    ranges = RangeAllocator(4 * ALIGNMENT)
    ranges.release(ranges.allocate(4 * ALIGNMENT)[0], 4 * ALIGNMENT, stream=3, marker=5)
    first = ranges.allocate(ALIGNMENT)
    second = ranges.allocate(ALIGNMENT)
    assert (first[0], second[0]) == (0, ALIGNMENT)
    assert first[1] == second[1] == {3: 5}


def test_random_allocations_never_overlap():
    rng = random.Random(0)
    size = 64 * ALIGNMENT
    ranges = RangeAllocator(size)
    live = {}
    for step in range(2000):
        if live and (rng.random() < 0.5 or len(live) > 20):
            offset = rng.choice(list(live))
            ranges.release(offset, live.pop(offset), stream=rng.randrange(3), marker=step)
        else:
            nbytes = rng.randrange(1, 8 * ALIGNMENT)
            found = ranges.allocate(nbytes)
            if found is None:
                continue
            offset = found[0]
            assert offset % ALIGNMENT == 0 and offset + nbytes <= size
            for other, other_bytes in live.items():
                assert offset + nbytes <= other or other + other_bytes <= offset
            live[offset] = nbytes
    for offset, nbytes in live.items():
        ranges.release(offset, nbytes, stream=0, marker=-1)
    assert ranges.largest_free() == size


class HostRegion:
    """An OutputRegion over host memory (CPU tensors, no events), with its backing kept alive."""

    def __init__(self, size: int) -> None:
        self.backing = torch.empty(size + ALIGNMENT, dtype=torch.uint8)
        base = (self.backing.data_ptr() + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
        self.region = OutputRegion(base, size, torch.device("cpu"))
        self.base, self.size = base, size

    def group(self, specs):
        return self.region.empty_group(specs, 0)


def test_group_tensors_have_their_shapes_dtypes_and_aligned_places():
    host = HostRegion(64 * ALIGNMENT)
    specs = [((5, 7), torch.bfloat16), ((5, 3), torch.float32), ((5, 8), torch.int64), ((5,), torch.int32),
             ((0, 8), torch.int64), ((5, 16), torch.float8_e4m3fn)]
    tensors = host.group(specs)
    for tensor, (shape, dtype) in zip(tensors, specs):
        assert tensor.shape == shape and tensor.dtype == dtype and tensor.device.type == "cpu"
        assert tensor.is_contiguous()
        if tensor.numel():
            assert (tensor.data_ptr() - host.base) % ALIGNMENT == 0
            assert host.base <= tensor.data_ptr() and tensor.data_ptr() + tensor.nbytes <= host.base + host.size
    ends = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in tensors if t.numel())
    assert all(end <= start for (_, end), (start, _) in zip(ends, ends[1:])), "tensors of a block overlap"
    # Real storage: writes through one tensor land in the region's bytes.
    tensors[3].copy_(torch.arange(5, dtype=torch.int32))
    offset = tensors[3].data_ptr() - host.backing.data_ptr()
    assert host.backing[offset:offset + 20].view(torch.int32).tolist() == [0, 1, 2, 3, 4]


def test_block_returns_only_when_its_last_tensor_and_views_are_gone():
    host = HostRegion(8 * ALIGNMENT)
    rows, meta = host.group([((4, 64), torch.float32), ((4,), torch.int32)])  # 4 + 1 aligned units
    assert host.region.largest_free_bytes() == 3 * ALIGNMENT
    view = rows[1:3]
    del rows
    gc.collect()
    assert host.region.largest_free_bytes() == 3 * ALIGNMENT, "a view still holds the block"
    del meta
    gc.collect()
    assert host.region.largest_free_bytes() == 3 * ALIGNMENT
    del view
    gc.collect()
    assert host.region.largest_free_bytes() == 8 * ALIGNMENT


def test_full_region_gives_none_and_frees_make_room_again():
    host = HostRegion(4 * ALIGNMENT)
    (held,) = host.group([((4 * ALIGNMENT,), torch.uint8)])
    assert host.group([((1,), torch.uint8)]) is None
    assert "0 of" in host.region.describe()
    del held
    gc.collect()
    (again,) = host.group([((4 * ALIGNMENT,), torch.uint8)])
    assert again.numel() == 4 * ALIGNMENT


def test_direct_outputs_are_placed_block_by_block_with_their_addresses_set():
    """One call places a direct dispatch's outputs (rows block, metadata block) and writes their addresses
    into the Args; each block returns with its last tensor."""
    host = HostRegion(256 * ALIGNMENT)
    args = _C.DispatchArgs()
    rows = 5
    blocks = [[(0, 7168, True), (1, 56 * 4, True)], [(2, 8 * 8, True), (3, 8 * 4, True), (4, 4, False)]]
    capsules = host.region.place_direct_outputs(args, rows, blocks, 0)
    tensors = [torch._C._from_dlpack(capsule) for capsule in capsules]
    assert [tuple(t.shape) for t in tensors] == [(5, 7168), (5, 224), (5, 64), (5, 32), (20,)]
    assert [t.dtype for t in tensors] == [torch.uint8] * 5
    fields = ["recv_x", "recv_x_scales", "recv_topk_idx", "recv_topk_weights", "recv_src_idx"]
    assert [getattr(args, name) for name in fields] == [t.data_ptr() for t in tensors]
    assert all((t.data_ptr() - host.base) % ALIGNMENT == 0 for t in tensors)
    assert all(host.base <= t.data_ptr() and t.data_ptr() + t.nbytes <= host.base + host.size for t in tensors)
    rows_block, metadata_block = tensors[:2], tensors[2:]
    free_with_both = host.region.largest_free_bytes()
    del rows_block, tensors
    gc.collect()
    assert host.region.largest_free_bytes() > free_with_both, "the rows block went back alone"
    del metadata_block
    gc.collect()
    assert host.region.largest_free_bytes() == 256 * ALIGNMENT


def test_direct_outputs_without_room_give_none_and_leave_the_args_alone():
    """A second block without room: None; the first block goes back, and the Args keep no address."""
    host = HostRegion(4 * ALIGNMENT)
    args = _C.DispatchArgs()
    blocks = [[(0, 2 * ALIGNMENT, True)], [(2, 4 * ALIGNMENT, True)]]
    assert host.region.place_direct_outputs(args, 1, blocks, 0) is None
    assert args.recv_x == 0 and args.recv_topk_idx == 0
    gc.collect()
    assert host.region.largest_free_bytes() == 4 * ALIGNMENT
    with pytest.raises(ValueError, match="output index"):
        host.region.place_direct_outputs(args, 1, [[(5, 16, True)]], 0)


def test_byte_shape():
    assert byte_shape((3, 7), torch.bfloat16) == [3, 14]
    assert byte_shape((6,), torch.int32) == [24]
    assert byte_shape((0, 8), torch.int64) == [0, 64]


def test_config_key_dispatch_output_bytes():
    assert as_config({"buffer": {"dispatch_output_bytes": 1 << 20}}).buffer.dispatch_output_bytes == 1 << 20
    assert as_config({}).buffer.dispatch_output_bytes == "auto"
    assert as_config({"buffer": {"dispatch_output_bytes": 0}}).buffer.dispatch_output_bytes == 0
    with pytest.raises(ConfigError, match="dispatch_output_bytes"):
        as_config({"buffer": {"dispatch_output_bytes": -1}})


def test_auto_output_region_holds_two_dispatches_up_to_four_ranks():
    buffer = as_config({"buffer": {"max_hidden": 7168}}).buffer
    row = 2 * 7168 + 4 * 56 + 12 * tuning.MAX_TOPK + 4
    assert tuning.output_row_bytes(7168) == row
    # Two dispatches of 4096 tokens per rank from every rank (at least two ranks' worth).
    assert tuning.output_region_bytes(buffer, 1) == tuning.output_region_bytes(buffer, 2) == 16384 * row
    assert tuning.output_region_bytes(buffer, 3) == 24576 * row
    assert tuning.output_region_bytes(buffer, 4) == 32768 * row
    assert tuning.output_region_bytes(buffer, 5) == tuning.output_region_bytes(buffer, 8) == 0
    fixed = as_config({"buffer": {"dispatch_output_bytes": 12345}}).buffer
    assert tuning.output_region_bytes(fixed, 8) == 12345


def test_region_tensors_consume_capsules_with_their_dtypes_and_return_the_block_with_the_last():
    """_C_torch.region_tensors: the direct dispatch's outputs as tensors of their dtypes in one call, each
    capsule consumed as torch.from_dlpack consumes one; bad arguments are failures, consuming nothing."""
    _C_torch = pytest.importorskip("ep_plugin._C_torch")
    host = HostRegion(256 * ALIGNMENT)
    args = _C.DispatchArgs()
    blocks = [[(0, 64, True), (1, 8, True)], [(4, 4, False)]]
    capsules = host.region.place_direct_outputs(args, 5, blocks, 0)
    dtypes = [torch.bfloat16, torch.float32, torch.int32]
    assert _C_torch.region_tensors(capsules, dtypes[:2])[0] == "value"
    rows, scales, src = _C_torch.region_tensors(capsules, dtypes)
    assert [(tuple(t.shape), t.dtype) for t in (rows, scales, src)] == [((5, 32), torch.bfloat16),
                                                                         ((5, 2), torch.float32), ((5,), torch.int32)]
    assert rows.data_ptr() == args.recv_x and scales.data_ptr() == args.recv_x_scales
    assert src.data_ptr() == args.recv_src_idx
    assert _C_torch.region_tensors(capsules[:1], dtypes[:1])[0] == "value", "a consumed capsule is refused"
    del capsules, rows, scales
    gc.collect()
    assert host.region.largest_free_bytes() < 256 * ALIGNMENT, "src still holds its block"
    del src
    gc.collect()
    assert host.region.largest_free_bytes() == 256 * ALIGNMENT
