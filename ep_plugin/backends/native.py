"""The native backend: the csrc kernels over CUDA-IPC-mapped NVLink buffers (one NVLink domain), and
in low-latency mode the NVSHMEM kernels of `ep_plugin._C_nvshmem` (any NVSHMEM transport).

Tensors go to the extensions as device addresses; this module allocates every output with torch
on the current stream (Buffer makes its communication stream current) and keeps the layout of a
dispatch in a `NativeHandle` (normal mode) or a `LowLatencyHandle` for combine.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import fp8
from ..tuning import Config
from .base import Backend, GroupInfo

try:
    from .. import _C
    _IMPORT_ERROR = ""
except ImportError as error:  # built without a CUDA toolkit
    _C = None
    _IMPORT_ERROR = str(error)

try:
    from .. import _C_nvshmem
    _NVSHMEM_IMPORT_ERROR = ""
except ImportError as error:  # built without NVSHMEM (or without a CUDA toolkit)
    _C_nvshmem = None
    _NVSHMEM_IMPORT_ERROR = str(error)

logger = logging.getLogger("ep_plugin")

# Whether the native low-latency kernels have passed tests/test_native_low_latency.py on GPUs. Until
# then `backend: auto` keeps the reference backend for low-latency mode and only `backend: native`
# selects them. Flip to True once they pass.
LOW_LATENCY_VERIFIED = False

# Symmetric heap requested from NVSHMEM beyond the buffer itself (its own allocations), unless the
# user sets NVSHMEM_SYMMETRIC_SIZE.
NVSHMEM_HEAP_MARGIN_BYTES = 256 << 20


def unsupported_reason(info: GroupInfo, low_latency_mode: bool, num_nvl_bytes: int, requested: str = "auto") -> str:
    """Why the native backend cannot serve this buffer ('' if it can).

    `requested`: the configured backend ('auto' or 'native'); unverified kernels are only used when
    asked for by name.
    """
    if low_latency_mode:
        return _low_latency_unsupported_reason(info, requested)
    if _C is None:
        return f"the extension ep_plugin._C is not built ({_IMPORT_ERROR})"
    if info.device.type != "cuda":
        return "no CUDA device in this process"
    if not info.is_intranode:
        return "native internode kernels are not part of this build yet"
    if info.num_ranks > _C.MAX_NVL_PEERS:
        return f"{info.num_ranks} ranks in one NVLink domain; the intranode kernels take at most {_C.MAX_NVL_PEERS}"
    if num_nvl_bytes < _C.NVL_HEADER_BYTES:
        return (f"num_nvl_bytes = {num_nvl_bytes} is below the minimum {_C.NVL_HEADER_BYTES}; size it with "
                "Config.get_nvl_buffer_size_hint")
    return ""


def _low_latency_unsupported_reason(info: GroupInfo, requested: str) -> str:
    if _C_nvshmem is None:
        return f"the NVSHMEM extension ep_plugin._C_nvshmem is not built ({_NVSHMEM_IMPORT_ERROR})"
    if info.device.type != "cuda":
        return "no CUDA device in this process"
    if info.num_ranks > _C_nvshmem.MAX_RANKS:
        return f"{info.num_ranks} ranks; the low-latency kernels take at most {_C_nvshmem.MAX_RANKS}"
    if not LOW_LATENCY_VERIFIED and requested != "native":
        return ("native low-latency kernels are built but not yet verified on GPU "
                "(select them with backend: native)")
    return ""


@dataclass(eq=False)
class LowLatencyHandle:
    """Layout of one low-latency dispatch (opaque to users), for `low_latency_combine`."""
    owner: "NativeBackend"
    num_tokens: int                      # T of the dispatch
    recv_shape: Tuple[int, int, int]     # (E_local, R * T_max, H)
    parity: int                          # the round (0 or 1) of symmetric buffer it used
    num_max_dispatch_tokens_per_rank: int
    num_experts: int
    num_topk: int
    recv_src_info: torch.Tensor          # [E_local, R * T_max] int32: src_rank << 21 | (t * 32 + k)
    recv_layout: torch.Tensor            # [E_local, R] int64: first slot << 32 | count, per source rank
    combine_buffer: Optional[torch.Tensor] = field(default=None)

    @property
    def hidden(self) -> int:
        return self.recv_shape[2]


class _SymmetricArray:
    """A device array in NVSHMEM memory, shown to torch through the CUDA array interface (zero-copy)."""

    def __init__(self, address: int, shape: Tuple[int, ...], typestr: str) -> None:
        self.__cuda_array_interface__ = {"data": (address, False), "shape": shape, "typestr": typestr,
                                         "strides": None, "version": 3, "stream": None}


@dataclass
class NativeHandle:
    """Layout of one dispatch (opaque to users)."""
    owner: "NativeBackend"
    num_tokens: int                  # T of this rank
    num_recv_rows: int               # rows of recv_x (received tokens, or num_worst_tokens)
    num_recv_tokens: Optional[int]   # received tokens when known on the host (None in graph mode)
    num_worst_tokens: int
    is_token_in_rank: torch.Tensor   # [T, R] bool
    send_pos: torch.Tensor           # [T, R] int32: row of token t on rank r, or -1
    recv_rank_offsets: torch.Tensor  # [R + 1] int32: first row of each source rank
    src_num_tokens: torch.Tensor     # [R] int32: T of every rank
    recv_src_idx: torch.Tensor       # [rows] int32: source token of each received row (-1 padding)
    num_recv_device: torch.Tensor    # [1] int32


def _address(tensor: Optional[torch.Tensor]) -> int:
    return 0 if tensor is None or tensor.numel() == 0 else tensor.data_ptr()


class NativeBackend(Backend):
    name = "native"

    def __init__(self, info: GroupInfo, settings, num_nvl_bytes: int, num_rdma_bytes: int,
                 low_latency_mode: bool) -> None:
        super().__init__(info, settings, num_nvl_bytes, num_rdma_bytes, low_latency_mode)
        reason = unsupported_reason(info, low_latency_mode, num_nvl_bytes, requested="native")
        if reason:
            raise RuntimeError(f"native backend unavailable: {reason}")
        self._runtime = None
        self._ll = None
        self._ll_parity = 0
        if not low_latency_mode or self._normal_mode_possible(num_nvl_bytes):
            self._runtime = _C.IntranodeRuntime(info.rank, info.num_ranks, num_nvl_bytes, settings.timeout_s)
            handles: List[Optional[bytes]] = [None] * info.num_ranks
            dist.all_gather_object(handles, self._runtime.ipc_handle(), group=info.group)
            self._runtime.connect(handles)
        if low_latency_mode:
            self._ll = self._start_low_latency(num_rdma_bytes)
        self._num_device_sms = torch.cuda.get_device_properties(info.device).multi_processor_count
        self._notify_tag = 0

    def _normal_mode_possible(self, num_nvl_bytes: int) -> bool:
        """In low-latency mode, whether normal-mode kernels can run on this buffer as well."""
        return _C is not None and unsupported_reason(self.info, False, num_nvl_bytes) == ""

    def _start_low_latency(self, num_rdma_bytes: int):
        """NVSHMEM over the process group (unique id from rank 0, every rank a PE) and the symmetric buffer."""
        if num_rdma_bytes <= _C_nvshmem.HEADER_BYTES:
            raise ValueError(f"num_rdma_bytes = {num_rdma_bytes} is too small for native low-latency mode; size it "
                             "with Buffer.get_low_latency_rdma_size_hint")
        torch.cuda.set_device(self.info.device)  # NVSHMEM binds each PE to the current device
        heap = (num_rdma_bytes + NVSHMEM_HEAP_MARGIN_BYTES + (2 << 20) - 1) // (2 << 20) * (2 << 20)
        if os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(heap)) != str(heap):
            logger.info("ep_plugin: keeping NVSHMEM_SYMMETRIC_SIZE=%s (the buffer needs %d bytes)",
                        os.environ["NVSHMEM_SYMMETRIC_SIZE"], num_rdma_bytes)
        unique_id = _C_nvshmem.create_unique_id() if self.info.rank == 0 else None
        ids: List[Optional[bytes]] = [None] * self.info.num_ranks
        dist.all_gather_object(ids, unique_id, group=self.info.group)
        runtime = _C_nvshmem.LowLatencyRuntime(self.info.rank, self.info.num_ranks, num_rdma_bytes,
                                               self.settings.timeout_s, ids[0])
        direct = runtime.direct_peers()
        logger.info("ep_plugin rank %d: low-latency symmetric buffer of %d bytes; peers over NVLink: %s, over the "
                    "network: %s", self.info.rank, num_rdma_bytes, [r for r, d in enumerate(direct) if d],
                    [r for r, d in enumerate(direct) if not d])
        return runtime

    # ---- helpers -------------------------------------------------------------------------------
    @staticmethod
    def _stream() -> int:
        return torch.cuda.current_stream().cuda_stream

    def _intranode(self):
        if self._runtime is None:
            raise RuntimeError("normal-mode kernels need num_nvl_bytes (Config.get_nvl_buffer_size_hint) on a "
                               "native buffer; this one was created for low-latency mode only")
        return self._runtime

    def _check_sms(self, config: Config) -> None:
        if config.num_sms > self._num_device_sms:
            raise ValueError(f"config.num_sms = {config.num_sms} exceeds the {self._num_device_sms} SMs of this GPU")

    def _empty(self, *shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.info.device)

    # ---- normal mode ---------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int):
        T, K = topk_idx.shape
        R = self.info.num_ranks
        per_rank = self._empty(R, dtype=torch.int32)
        per_node = None if self.info.is_intranode else self._empty(self.info.num_nodes, dtype=torch.int32)
        per_expert = self._empty(num_experts, dtype=torch.int32)
        in_rank = self._empty(T, R, dtype=torch.bool)
        _C.get_dispatch_layout(topk_idx=_address(topk_idx), num_tokens=T, num_topk=K, num_experts=num_experts,
                               num_ranks=R, ranks_per_node=self.info.ranks_per_node,
                               num_tokens_per_rank=_address(per_rank), num_tokens_per_node=_address(per_node),
                               num_tokens_per_expert=_address(per_expert), is_token_in_rank=_address(in_rank),
                               stream=self._stream())
        return per_rank, per_node, per_expert, in_rank

    def dispatch(self, x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
                 num_tokens_per_expert, expert_alignment, num_worst_tokens, config):
        self._check_sms(config)
        T, K = topk_idx.shape
        R = self.info.num_ranks
        num_experts = num_tokens_per_expert.size(0)
        num_local_experts = num_experts // R
        if num_local_experts > _C.MAX_LOCAL_EXPERTS:
            raise ValueError(f"{num_local_experts} experts per rank; the native kernels take at most "
                             f"{_C.MAX_LOCAL_EXPERTS}")
        send_pos = self._empty(T, R, dtype=torch.int32)
        recv_rank_offsets = self._empty(R + 1, dtype=torch.int32)
        src_num_tokens = self._empty(R, dtype=torch.int32)
        num_recv_device = self._empty(1, dtype=torch.int32)
        host_tag = 0
        if num_worst_tokens == 0:
            self._notify_tag += 1
            host_tag = self._notify_tag
        stream = self._stream()
        self._intranode().notify(is_token_in_rank=_address(is_token_in_rank),
                             num_tokens_per_expert=_address(num_tokens_per_expert), topk_idx=_address(topk_idx),
                             num_tokens=T, num_topk=K, num_experts=num_experts, expert_alignment=expert_alignment,
                             num_worst_tokens=num_worst_tokens, send_pos=_address(send_pos),
                             recv_rank_offsets=_address(recv_rank_offsets), src_num_tokens=_address(src_num_tokens),
                             num_recv_tokens=_address(num_recv_device), host_tag=host_tag, stream=stream)
        if num_worst_tokens == 0:
            num_recv, per_expert = self._intranode().wait_notify(tag=host_tag, num_local_experts=num_local_experts,
                                                             stream=stream)
            rows = num_recv
        else:
            num_recv, per_expert, rows = None, [], num_worst_tokens

        recv_x = self._empty(rows, x.size(1), dtype=x.dtype)
        recv_scales = None if x_scales is None else self._empty(rows, x_scales.size(1), dtype=torch.float32)
        recv_topk_idx = self._empty(rows, K, dtype=torch.int64)
        recv_topk_weights = None if topk_weights is None else self._empty(rows, K, dtype=torch.float32)
        recv_src_idx = self._empty(rows, dtype=torch.int32)
        self._launch_dispatch(x, x_scales, topk_idx, topk_weights, send_pos, recv_x, recv_scales, recv_topk_idx,
                              recv_topk_weights, recv_src_idx, num_local_experts, num_worst_tokens, num_recv_device,
                              config)
        handle = NativeHandle(owner=self, num_tokens=T, num_recv_rows=rows, num_recv_tokens=num_recv,
                              num_worst_tokens=num_worst_tokens, is_token_in_rank=is_token_in_rank,
                              send_pos=send_pos, recv_rank_offsets=recv_rank_offsets, src_num_tokens=src_num_tokens,
                              recv_src_idx=recv_src_idx, num_recv_device=num_recv_device)
        return recv_x, recv_scales, recv_topk_idx, recv_topk_weights, list(per_expert), handle

    def _launch_dispatch(self, x, x_scales, topk_idx, topk_weights, send_pos, recv_x, recv_scales, recv_topk_idx,
                         recv_topk_weights, recv_src_idx, num_local_experts, num_worst_tokens, num_recv_device,
                         config: Config) -> None:
        self._intranode().dispatch(
            num_channels=config.num_channels, recv_tokens_per_channel=config.num_max_nvl_chunked_recv_tokens,
            send_chunk=config.num_max_nvl_chunked_send_tokens, num_tokens=x.size(0), row_bytes=x.size(1) * x.element_size(),
            num_scales=0 if x_scales is None else x_scales.size(1),
            num_topk=0 if topk_idx is None else topk_idx.size(1), num_local_experts=num_local_experts,
            x=_address(x), x_scales=_address(x_scales), topk_idx=_address(topk_idx),
            topk_weights=_address(topk_weights), send_pos=_address(send_pos), recv_x=_address(recv_x),
            recv_x_scales=_address(recv_scales), recv_topk_idx=_address(recv_topk_idx),
            recv_topk_weights=_address(recv_topk_weights), recv_src_idx=_address(recv_src_idx),
            num_worst_tokens=num_worst_tokens, num_recv_tokens=_address(num_recv_device), stream=self._stream())

    def cached_dispatch(self, x, x_scales, handle: NativeHandle, config: Config):
        self._check_sms(config)
        rows = handle.num_recv_rows
        recv_x = self._empty(rows, x.size(1), dtype=x.dtype)
        recv_scales = None if x_scales is None else self._empty(rows, x_scales.size(1), dtype=torch.float32)
        self._launch_dispatch(x, x_scales, None, None, handle.send_pos, recv_x, recv_scales, None, None, None, 1,
                              handle.num_worst_tokens, handle.num_recv_device, config)
        return recv_x, recv_scales

    def combine(self, x, handle: NativeHandle, topk_weights, bias_0, bias_1, config: Config):
        self._check_sms(config)
        T = handle.num_tokens
        combined_x = self._empty(T, x.size(1), dtype=torch.bfloat16)
        combined_weights = None if topk_weights is None else self._empty(T, topk_weights.size(1), dtype=torch.float32)
        self._intranode().combine(
            num_channels=config.num_channels, recv_tokens_per_channel=config.num_max_nvl_chunked_recv_tokens,
            send_chunk=config.num_max_nvl_chunked_send_tokens, num_tokens=T, hidden=x.size(1), num_topk=0 if topk_weights is None else topk_weights.size(1),
            x=_address(x), topk_weights=_address(topk_weights), recv_src_idx=_address(handle.recv_src_idx),
            recv_rank_offsets=_address(handle.recv_rank_offsets), src_num_tokens=_address(handle.src_num_tokens),
            send_pos=_address(handle.send_pos), bias_0=_address(bias_0), bias_1=_address(bias_1),
            combined_x=_address(combined_x), combined_topk_weights=_address(combined_weights),
            stream=self._stream())
        return combined_x, combined_weights

    def handle_num_recv_rows(self, handle: NativeHandle) -> int:
        return handle.num_recv_rows

    def handle_num_tokens(self, handle: NativeHandle) -> int:
        return handle.num_tokens

    # ---- low-latency mode ------------------------------------------------------------------------
    def _low_latency(self):
        if self._ll is None:
            raise RuntimeError("this native buffer was not created with low_latency_mode=True")
        return self._ll

    def _check_low_latency_shapes(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int,
                                  num_topk: int) -> None:
        """What Buffer does not check but these kernels need; raised before anything runs."""
        if num_max_dispatch_tokens_per_rank > _C_nvshmem.MAX_TOKENS:
            raise ValueError(f"num_max_dispatch_tokens_per_rank = {num_max_dispatch_tokens_per_rank} exceeds the "
                             f"native low-latency limit of {_C_nvshmem.MAX_TOKENS}")
        if num_experts > _C_nvshmem.MAX_EXPERTS:
            raise ValueError(f"num_experts = {num_experts} exceeds the native low-latency limit of "
                             f"{_C_nvshmem.MAX_EXPERTS}")
        if num_topk > _C_nvshmem.MAX_TOPK:
            raise ValueError(f"topk_idx: top-k = {num_topk} exceeds the native low-latency limit of "
                             f"{_C_nvshmem.MAX_TOPK}")
        needed = _C_nvshmem.size_hint(num_max_dispatch_tokens_per_rank, hidden, self.info.num_ranks, num_experts)
        if needed > self.num_rdma_bytes:
            raise ValueError(f"num_rdma_bytes = {self.num_rdma_bytes} is too small for T_max="
                             f"{num_max_dispatch_tokens_per_rank}, hidden={hidden}, num_experts={num_experts}: "
                             f"need {needed} (Buffer.get_low_latency_rdma_size_hint)")

    def _next_parity(self) -> int:
        """The round of this dispatch: rounds alternate, so two dispatch/combine rounds can be in flight.

        Every rank makes the same sequence of calls, so every rank picks the same round. Under CUDA-graph
        capture the round is fixed into the graph (each replay repeats the captured sequence).
        """
        parity = self._ll_parity
        self._ll_parity ^= 1
        return parity

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                             cumulative_local_expert_recv_stats, use_fp8, round_scale, use_ue8m0,
                             return_recv_hook):
        runtime = self._low_latency()
        T, K = topk_idx.shape
        H = x.size(1)
        R = self.info.num_ranks
        self._check_low_latency_shapes(num_max_dispatch_tokens_per_rank, H, num_experts, K)
        num_local = num_experts // R
        num_slots = R * num_max_dispatch_tokens_per_rank
        if use_fp8:
            data = self._empty(num_local, num_slots, H, dtype=torch.uint8).view(fp8.FP8_DTYPE)
            # Column-major in the last two dimensions: allocate [E_local, S, slots], view transposed.
            width = fp8.num_ue8m0_words(H) if use_ue8m0 else fp8.num_blocks(H)
            scales = self._empty(num_local, width, num_slots, dtype=torch.int32 if use_ue8m0 else torch.float32)
            scales = scales.transpose(1, 2)
            recv_x = (data, scales)
        else:
            data = self._empty(num_local, num_slots, H, dtype=torch.bfloat16)
            scales = None
            recv_x = data
        recv_count = self._empty(num_local, dtype=torch.int32)
        recv_src_info = self._empty(num_local, num_slots, dtype=torch.int32)
        recv_layout = self._empty(num_local, R, dtype=torch.int64)
        parity = self._next_parity()

        def launch(phases: int) -> None:
            runtime.dispatch(parity=parity, phases=phases,
                             num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank, hidden=H,
                             num_experts=num_experts, x=_address(x), topk_idx=_address(topk_idx), num_tokens=T,
                             num_topk=K, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0,
                             recv_x=_address(data), recv_scales=_address(scales), recv_count=_address(recv_count),
                             recv_src_info=_address(recv_src_info), recv_layout=_address(recv_layout),
                             cumulative_local_expert_recv_stats=_address(cumulative_local_expert_recv_stats),
                             stream=self._stream())

        send, recv = _C_nvshmem.PHASE_SEND, _C_nvshmem.PHASE_RECV
        launch(send if return_recv_hook else send | recv)
        handle = LowLatencyHandle(owner=self, num_tokens=T, recv_shape=(num_local, num_slots, H), parity=parity,
                                  num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
                                  num_experts=num_experts, num_topk=K, recv_src_info=recv_src_info,
                                  recv_layout=recv_layout)
        hook = _receive_hook(lambda: launch(recv)) if return_recv_hook else None
        return recv_x, recv_count, handle, hook

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, zero_copy, return_recv_hook, out):
        runtime = self._low_latency()
        handle = self._low_latency_handle(handle)
        if tuple(topk_idx.shape) != (handle.num_tokens, handle.num_topk):
            raise ValueError(f"low_latency_combine: topk_idx has shape {tuple(topk_idx.shape)} but the dispatch's had "
                             f"{(handle.num_tokens, handle.num_topk)}")
        staging = self.get_next_low_latency_combine_buffer(handle)
        if zero_copy and x.data_ptr() != staging.data_ptr():
            raise ValueError("low_latency_combine(zero_copy=True): x must be the tensor returned by "
                             "get_next_low_latency_combine_buffer(handle), filled with the expert outputs")
        T, K = topk_idx.shape
        combined = out if out is not None else self._empty(T, handle.hidden, dtype=torch.bfloat16)

        def launch(phases: int) -> None:
            runtime.combine(parity=handle.parity, phases=phases,
                            num_max_dispatch_tokens_per_rank=handle.num_max_dispatch_tokens_per_rank,
                            hidden=handle.hidden, num_experts=handle.num_experts, x=_address(x),
                            recv_src_info=_address(handle.recv_src_info), recv_layout=_address(handle.recv_layout),
                            topk_idx=_address(topk_idx), topk_weights=_address(topk_weights), num_tokens=T,
                            num_topk=K, out=_address(combined), stream=self._stream())

        send, recv = _C_nvshmem.PHASE_SEND, _C_nvshmem.PHASE_RECV
        launch(send if return_recv_hook else send | recv)
        hook = _receive_hook(lambda: launch(recv)) if return_recv_hook else None
        return combined, hook

    def get_next_low_latency_combine_buffer(self, handle):
        handle = self._low_latency_handle(handle)
        if handle.combine_buffer is None:
            address = self._low_latency().combine_buffer_address(
                parity=handle.parity, num_max_dispatch_tokens_per_rank=handle.num_max_dispatch_tokens_per_rank,
                hidden=handle.hidden, num_experts=handle.num_experts)
            array = _SymmetricArray(address, handle.recv_shape, "<i2")  # bf16 has no typestr: view int16 bits
            handle.combine_buffer = torch.as_tensor(array, device=self.info.device).view(torch.bfloat16)
        return handle.combine_buffer

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        """Zero every signal word on every rank (a collective, as in DeepEP)."""
        runtime = self._low_latency()
        self._check_low_latency_shapes(num_max_dispatch_tokens_per_rank, hidden, num_experts, 1)
        torch.cuda.synchronize(self.info.device)
        dist.barrier(group=self.info.group)  # no peer is still writing into this buffer
        runtime.clean(stream=self._stream())
        self._ll_parity = 0
        dist.barrier(group=self.info.group)  # no peer writes before every buffer is clean

    def _low_latency_handle(self, handle: object) -> LowLatencyHandle:
        if not isinstance(handle, LowLatencyHandle):
            raise ValueError(f"expected a handle from low_latency_dispatch, got {type(handle).__name__}")
        return handle

    def destroy(self, collective: bool = True) -> None:
        torch.cuda.synchronize(self.info.device)
        if collective:
            # NOTE: no rank may free its buffer while a peer's kernel could still write into it.
            dist.barrier(group=self.info.group)
        if self._runtime is not None:
            self._runtime.destroy()
        if self._ll is not None:
            self._ll.destroy(collective=collective)


def _receive_hook(receive: Callable[[], None]) -> Callable[[], None]:
    """A receive hook: the first call launches the receive on the current stream, later calls do nothing."""
    state = {"done": False}

    def hook() -> None:
        if not state["done"]:
            state["done"] = True
            receive()

    return hook
