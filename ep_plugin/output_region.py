"""This rank's output region: dispatch outputs that peers write directly (`buffer.dispatch_output_bytes`).

The region is part of the rank's NVLink buffer, so every peer has it mapped. A direct dispatch allocates
its outputs here and the peers' senders write their rows straight into them (no rings, no receiver
copies). The allocator lives in the extension (`_C.OutputRegionAllocator`, csrc/output_region.h): the
outputs are ordinary torch tensors (DLPack), and a block returns to the region when its last tensor is
freed. Like torch's caching allocator, a freed block is reused at once by allocations on the stream it
was allocated on, and by another stream only after that stream waits for the work queued on the first
one (an event recorded when the other stream allocates; a free makes no CUDA call).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

# NOTE: torch's own DLPack import, without torch.utils.dlpack.from_dlpack's Python dispatch (about 0.3 us
# per tensor, on the dispatch's critical path).
_from_dlpack = torch._C._from_dlpack

Spec = Tuple[Tuple[int, ...], torch.dtype]


def byte_shape(shape: Sequence[int], dtype: torch.dtype) -> List[int]:
    """The uint8 shape that `.view(dtype)` turns into `shape`: the last extent in bytes."""
    return [*shape[:-1], shape[-1] * dtype.itemsize] if shape else [dtype.itemsize]


class OutputRegion:
    """Allocates dispatch outputs in the region at `address` (`size` bytes) of `device` (a CUDA device,
    or the CPU for tests over host memory)."""

    def __init__(self, address: int, size: int, device: torch.device) -> None:
        from . import _C  # the extension: only where the native backend is built

        self.address, self.size, self.device = address, size, device
        self._allocator = _C.OutputRegionAllocator(address, size, device.index if device.type == "cuda" else -1)
        self._place_direct_outputs = _C.place_direct_outputs

    def empty_group(self, specs: List[Spec], stream: int) -> Optional[List[torch.Tensor]]:
        """Uninitialised tensors of the given (shape, dtype) in one block of the region, for use on
        `stream` (a CUDA stream handle; 0 on the CPU); None when the region has no room for them."""
        raw = self.empty_bytes([byte_shape(shape, dtype) for shape, dtype in specs], stream)
        return None if raw is None else [tensor.view(dtype) for tensor, (_, dtype) in zip(raw, specs)]

    def empty_bytes(self, byte_shapes: List[List[int]], stream: int) -> Optional[List[torch.Tensor]]:
        """Uninitialised uint8 tensors of `byte_shapes` in one block of the region (`.view(dtype)` types
        each, see `byte_shape`), for use on `stream`; None when the region has no room for them."""
        capsules = self._allocator.allocate(byte_shapes, stream)
        return None if capsules is None else [_from_dlpack(capsule) for capsule in capsules]

    def place_direct_outputs(self, args, rows: int, blocks: List[List[Tuple[int, int, bool]]],
                             stream: int) -> Optional[list]:
        """A direct dispatch's outputs of `rows` rows, their addresses set in `args` (`_C.DispatchArgs`):
        `blocks[b]` lists block b's outputs as (output index, bytes per row, 2-D). One uint8 DLPack
        capsule per listed output, block by block, or None when a block has no room."""
        return self._place_direct_outputs(args, self._allocator, rows, blocks, stream)

    def largest_free_bytes(self) -> int:
        return self._allocator.largest_free()

    def describe(self) -> str:
        return self._allocator.describe()
