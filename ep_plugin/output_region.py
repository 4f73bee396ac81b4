"""This rank's output region: dispatch outputs that peers write directly (`buffer.dispatch_output_bytes`).

The region is part of the rank's NVLink buffer, so every peer has it mapped. A direct dispatch allocates
its outputs here and the peers' senders write their rows straight into them (no rings, no receiver
copies). The tensors are ordinary torch tensors to the user: a block returns to the region when its
tensor is freed.

Like torch's caching allocator, a freed block is reused at once by allocations on the stream it was
allocated on (work on that stream is ordered), and by another stream only after that stream waits
for the work queued on the first one before the free.
"""
from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

ALIGNMENT = 256


@dataclass
class FreeRange:
    offset: int
    size: int
    # stream id -> (release order, what a user of another stream must wait for)
    pending: Dict[int, Tuple[int, object]] = field(default_factory=dict)


def _merge_pending(a: Dict[int, Tuple[int, object]], b: Dict[int, Tuple[int, object]]) -> Dict[int, Tuple[int, object]]:
    """Per stream, the later release covers the earlier (work on one stream is ordered)."""
    merged = dict(a)
    for stream, entry in b.items():
        if stream not in merged or entry[0] > merged[stream][0]:
            merged[stream] = entry
    return merged


class RangeAllocator:
    """First-fit allocation of aligned byte ranges in [0, size), with coalescing frees (no CUDA)."""

    def __init__(self, size: int, alignment: int = ALIGNMENT) -> None:
        self.size = size
        self.alignment = alignment
        self._free: List[FreeRange] = [FreeRange(0, size)] if size > 0 else []
        self._releases = 0

    def allocate(self, nbytes: int) -> Optional[Tuple[int, Dict[int, Tuple[int, object]]]]:
        """(offset, pending of the range it came from), or None when no free range holds `nbytes`."""
        need = max(self.alignment, (nbytes + self.alignment - 1) // self.alignment * self.alignment)
        for i, free in enumerate(self._free):
            if free.size < need:
                continue
            offset, pending = free.offset, free.pending
            if free.size == need:
                del self._free[i]
            else:
                self._free[i] = FreeRange(free.offset + need, free.size - need, dict(free.pending))
            return offset, pending
        return None

    def release(self, offset: int, nbytes: int, stream: int, marker: object) -> None:
        """Frees the range allocated at `offset`; `marker` is what users of other streams wait for."""
        size = max(self.alignment, (nbytes + self.alignment - 1) // self.alignment * self.alignment)
        self._releases += 1
        new = FreeRange(offset, size, {stream: (self._releases, marker)})
        i = bisect.bisect_left([f.offset for f in self._free], offset)
        if i > 0 and self._free[i - 1].offset + self._free[i - 1].size == offset:
            prev = self._free.pop(i - 1)
            new = FreeRange(prev.offset, prev.size + new.size, _merge_pending(prev.pending, new.pending))
            i -= 1
        if i < len(self._free) and new.offset + new.size == self._free[i].offset:
            nxt = self._free.pop(i)
            new = FreeRange(new.offset, new.size + nxt.size, _merge_pending(new.pending, nxt.pending))
        self._free.insert(i, new)

    def free_bytes(self) -> int:
        return sum(f.size for f in self._free)

    def largest_free(self) -> int:
        return max((f.size for f in self._free), default=0)


class _RegionBlock:
    """A block of the region shown to torch (CUDA array interface); freed with the last tensor on it."""

    def __init__(self, region: "OutputRegion", offset: int, nbytes: int, stream: torch.cuda.Stream) -> None:
        self._region, self._offset, self._nbytes, self._stream = region, offset, nbytes, stream
        self.__cuda_array_interface__ = {"data": (region.address + offset, False), "shape": (nbytes,),
                                         "typestr": "|u1", "strides": None, "version": 3, "stream": None}

    def __del__(self) -> None:
        try:
            self._region._release(self._offset, self._nbytes, self._stream)
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing to return the block to
            pass


class OutputRegion:
    """Allocates dispatch outputs in the region at `address` (`size` bytes) of `device`."""

    def __init__(self, address: int, size: int, device: torch.device) -> None:
        self.address, self.size, self.device = address, size, device
        self._ranges = RangeAllocator(size)
        self._lock = threading.Lock()

    def empty(self, shape: Tuple[int, ...], dtype: torch.dtype) -> Optional[torch.Tensor]:
        """An uninitialised tensor in the region, or None when the region has no room for it."""
        found = self.empty_group([(tuple(shape), dtype)])
        return None if found is None else found[0]

    def empty_group(self, specs: List[Tuple[Tuple[int, ...], torch.dtype]]) -> Optional[List[torch.Tensor]]:
        """Uninitialised tensors of the given (shape, dtype) in one block of the region (one allocation;
        the block returns when the last of them is freed), or None when the region has no room."""
        sizes = [torch.Size(shape).numel() * dtype.itemsize for shape, dtype in specs]
        starts, nbytes = [], 0
        for size in sizes:
            starts.append(nbytes)
            nbytes += (size + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
        if nbytes == 0:
            return [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in specs]
        stream = torch.cuda.current_stream(self.device)
        with self._lock:
            found = self._ranges.allocate(nbytes)
        if found is None:
            return None
        offset, pending = found
        for stream_id, (_, event) in pending.items():
            if stream_id != stream.cuda_stream:
                stream.wait_event(event)
        raw = torch.as_tensor(_RegionBlock(self, offset, nbytes, stream), device=self.device)
        return [raw[start:start + size].view(dtype).view(shape)
                for (shape, dtype), start, size in zip(specs, starts, sizes)]

    def _release(self, offset: int, nbytes: int, stream: torch.cuda.Stream) -> None:
        event = torch.cuda.Event()
        event.record(stream)
        with self._lock:
            self._ranges.release(offset, nbytes, stream.cuda_stream, event)

    def largest_free_bytes(self) -> int:
        with self._lock:
            return self._ranges.largest_free()

    def describe(self) -> str:
        with self._lock:
            return (f"{self._ranges.free_bytes()} of {self.size} bytes free, the largest free block "
                    f"{self._ranges.largest_free()} bytes")
