"""The output region's allocator (ep_plugin/output_region.py): offsets, coalescing and what a reuse
from another stream must wait for. Pure bookkeeping, no GPU."""
from __future__ import annotations

import random

import pytest

from ep_plugin.config import ConfigError, as_config
from ep_plugin.output_region import ALIGNMENT, RangeAllocator


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
    ranges.release(0, 4 * ALIGNMENT, stream=1, marker="e")
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
    ranges.release(a, ALIGNMENT, stream=7, marker="first on 7")
    ranges.release(b, ALIGNMENT, stream=7, marker="second on 7")
    ranges.release(c, 2 * ALIGNMENT, stream=9, marker="on 9")
    offset, pending = ranges.allocate(4 * ALIGNMENT)
    assert offset == 0
    assert {stream: marker for stream, (_, marker) in pending.items()} == {7: "second on 7", 9: "on 9"}


def test_split_range_keeps_its_pending_work():
    ranges = RangeAllocator(4 * ALIGNMENT)
    ranges.release(ranges.allocate(4 * ALIGNMENT)[0], 4 * ALIGNMENT, stream=3, marker="m")
    first = ranges.allocate(ALIGNMENT)
    second = ranges.allocate(ALIGNMENT)
    assert (first[0], second[0]) == (0, ALIGNMENT)
    assert first[1] == second[1] and list(first[1]) == [3]


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
        ranges.release(offset, nbytes, stream=0, marker=None)
    assert ranges.largest_free() == size


def test_config_key_dispatch_output_bytes():
    assert as_config({"buffer": {"dispatch_output_bytes": 1 << 20}}).buffer.dispatch_output_bytes == 1 << 20
    assert as_config({}).buffer.dispatch_output_bytes == 0
    with pytest.raises(ConfigError, match="dispatch_output_bytes"):
        as_config({"buffer": {"dispatch_output_bytes": -1}})
