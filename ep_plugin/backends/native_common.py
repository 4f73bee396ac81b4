"""What the native backend's modes share: the extensions, device addresses, and the helpers every
mode's host code uses (streams, outputs, SM checks, NVSHMEM start-up)."""
from __future__ import annotations

import logging
import os
from typing import List, NoReturn, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..tuning import Config
from .base import Backend

try:
    from .. import _C
    IMPORT_ERROR = ""
except ImportError as error:  # built without a CUDA toolkit
    _C = None
    IMPORT_ERROR = str(error)

try:
    from .. import _C_nvshmem
    NVSHMEM_IMPORT_ERROR = ""
except ImportError as error:  # built without NVSHMEM (or without a CUDA toolkit)
    _C_nvshmem = None
    NVSHMEM_IMPORT_ERROR = str(error)

try:  # the outputs of every native call, allocated by torch from C++ (built against the installed torch)
    from .. import _C_torch
except ImportError as error:  # then no native mode runs: each says why
    _C_torch = _C = _C_nvshmem = None
    IMPORT_ERROR = NVSHMEM_IMPORT_ERROR = f"ep_plugin._C_torch: {error} (rebuild ep_plugin after a torch upgrade)"

logger = logging.getLogger("ep_plugin")

# Symmetric heap requested from NVSHMEM beyond the buffer itself (its own allocations), unless the
# user sets NVSHMEM_SYMMETRIC_SIZE.
NVSHMEM_HEAP_MARGIN_BYTES = 256 << 20


def address_of(tensor: Optional[torch.Tensor]) -> int:
    """The device address the extensions take for `tensor` (0: None or empty)."""
    return 0 if tensor is None or tensor.numel() == 0 else tensor.data_ptr()


def local_experts(num_experts: int, num_ranks: int) -> int:
    """Experts per rank, within what the intranode kernels hold."""
    num_local_experts = num_experts // num_ranks
    if num_local_experts > _C.MAX_LOCAL_EXPERTS:
        raise ValueError(f"{num_local_experts} experts per rank; the native kernels take at most "
                         f"{_C.MAX_LOCAL_EXPERTS}")
    return num_local_experts


OutputSpec = Tuple[Tuple[int, ...], Optional[Tuple[int, ...]], torch.dtype]  # sizes, strides or None, dtype

_FAILURES = {"value": ValueError, "out_of_memory": torch.OutOfMemoryError}


def raise_failure(failure: Tuple[str, str]) -> NoReturn:
    """Raise what `_C_torch` reported: it returns its failures (kind, message) and never throws."""
    kind, message = failure
    raise _FAILURES.get(kind, RuntimeError)(message)


class OutputGroup:
    """A call's outputs on one device, allocated by torch's caching allocator from C++ in one binding call
    (csrc/torch_outputs.cpp); see `output_group`."""

    __slots__ = ("group",)

    def __init__(self, group) -> None:
        self.group = group  # _C_torch's

    def empty(self, rows: int = 0) -> List[torch.Tensor]:
        """Uninitialised tensors, one per spec in block order, every -1 extent set to `rows`, on the current
        stream; ValueError for negative rows, torch.OutOfMemoryError where the device has no room."""
        outputs = self.group.empty(rows)
        if outputs.__class__ is list:
            return outputs
        raise_failure(outputs)

    def __repr__(self) -> str:
        return repr(self.group)


def output_group(blocks: Sequence[Sequence[OutputSpec]], device: torch.device) -> OutputGroup:
    """The OutputGroup of `blocks` on `device`: a block is a sequence of specs (sizes, strides or None,
    dtype), an extent of -1 being the row count given to `empty(rows)`; a block's outputs share one
    allocation (for outputs that live and die together). ValueError for a bad spec."""
    group = _C_torch.output_group([list(block) for block in blocks], device)
    if group.__class__ is tuple:
        raise_failure(group)
    return OutputGroup(group)


# torch's current CUDA stream as a raw handle (the same call Triton's launchers make); CUDA builds only.
_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


class NativeBase(Backend):
    """State and helpers of NativeBackend that every mode uses (native.py sets the state up)."""

    def _stream(self) -> int:
        # NOTE: by device index (with no argument torch looks the current device up), and the raw handle
        # where torch has it: a Stream object costs a few us per call, felt in eager low-latency calls.
        if _current_raw_stream is not None:
            return _current_raw_stream(self.info.device.index)
        return torch.cuda.current_stream(self.info.device.index).cuda_stream

    def _check_sms(self, config: Config) -> None:
        if config.num_sms > self._num_device_sms:
            raise ValueError(f"config.num_sms = {config.num_sms} exceeds the {self._num_device_sms} SMs of this GPU")

    def _output_group(self, *blocks: Tuple[OutputSpec, ...]) -> OutputGroup:
        """The `output_group` of `blocks` on this buffer's device, made once per buffer. One binding call
        allocates a call's outputs: each torch.empty from Python costs about 4.5 us of host time on an
        H100 host, and C++ allocations ignore torch's global default device and dtype."""
        group = self._output_groups.get(blocks)
        if group is None:
            group = self._output_groups[blocks] = output_group(blocks, self.info.device)
        return group

    def _empty(self, *shape: int, dtype: torch.dtype) -> torch.Tensor:
        """An output on this buffer's device (at least one dimension)."""
        # NOTE: sizes as separate ints: torch parses them about 0.35 us faster than one tuple (per output).
        return torch.empty(*shape, dtype=dtype, device=self.info.device)

    def _prepare_nvshmem(self, num_rdma_bytes: int) -> bytes:
        """Before a runtime starts NVSHMEM: bind this device, size the symmetric heap (unless the user set
        NVSHMEM_SYMMETRIC_SIZE) and share rank 0's unique id over the group (a collective); returns the id."""
        torch.cuda.set_device(self.info.device)  # NVSHMEM binds each PE to the current device
        heap = (num_rdma_bytes + NVSHMEM_HEAP_MARGIN_BYTES + (2 << 20) - 1) // (2 << 20) * (2 << 20)
        if os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(heap)) != str(heap):
            logger.info("ep_plugin: keeping NVSHMEM_SYMMETRIC_SIZE=%s (the buffer needs %d bytes)",
                        os.environ["NVSHMEM_SYMMETRIC_SIZE"], num_rdma_bytes)
        unique_id = _C_nvshmem.create_unique_id() if self.info.rank == 0 else None
        ids: List[Optional[bytes]] = [None] * self.info.num_ranks
        dist.all_gather_object(ids, unique_id, group=self.info.group)
        return ids[0]
