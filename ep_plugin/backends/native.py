"""The native backend: the csrc kernels over CUDA-IPC-mapped NVLink buffers (one NVLink domain).

Tensors go to the extension as device addresses; this module allocates every output with torch
on the current stream (Buffer makes its communication stream current) and keeps the layout of a
dispatch in a `NativeHandle` for combine and cached dispatch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from ..tuning import Config
from .base import Backend, GroupInfo

try:
    from .. import _C
    _IMPORT_ERROR = ""
except ImportError as error:  # built without a CUDA toolkit
    _C = None
    _IMPORT_ERROR = str(error)


def unsupported_reason(info: GroupInfo, low_latency_mode: bool, num_nvl_bytes: int) -> str:
    """Why the native backend cannot serve this buffer ('' if it can)."""
    if _C is None:
        return f"the extension ep_plugin._C is not built ({_IMPORT_ERROR})"
    if info.device.type != "cuda":
        return "no CUDA device in this process"
    if low_latency_mode:
        return "native low-latency kernels are not part of this build yet"
    if not info.is_intranode:
        return "native internode kernels are not part of this build yet"
    if info.num_ranks > _C.MAX_NVL_PEERS:
        return f"{info.num_ranks} ranks in one NVLink domain; the intranode kernels take at most {_C.MAX_NVL_PEERS}"
    if num_nvl_bytes < _C.NVL_HEADER_BYTES:
        return (f"num_nvl_bytes = {num_nvl_bytes} is below the minimum {_C.NVL_HEADER_BYTES}; size it with "
                "Config.get_nvl_buffer_size_hint")
    return ""


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
        reason = unsupported_reason(info, low_latency_mode, num_nvl_bytes)
        if reason:
            raise RuntimeError(f"native backend unavailable: {reason}")
        self._runtime = _C.IntranodeRuntime(info.rank, info.num_ranks, num_nvl_bytes, settings.timeout_s)
        handles: List[Optional[bytes]] = [None] * info.num_ranks
        dist.all_gather_object(handles, self._runtime.ipc_handle(), group=info.group)
        self._runtime.connect(handles)
        self._num_device_sms = torch.cuda.get_device_properties(info.device).multi_processor_count
        self._notify_tag = 0

    # ---- helpers -------------------------------------------------------------------------------
    @staticmethod
    def _stream() -> int:
        return torch.cuda.current_stream().cuda_stream

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
        self._runtime.notify(is_token_in_rank=_address(is_token_in_rank),
                             num_tokens_per_expert=_address(num_tokens_per_expert), topk_idx=_address(topk_idx),
                             num_tokens=T, num_topk=K, num_experts=num_experts, expert_alignment=expert_alignment,
                             num_worst_tokens=num_worst_tokens, send_pos=_address(send_pos),
                             recv_rank_offsets=_address(recv_rank_offsets), src_num_tokens=_address(src_num_tokens),
                             num_recv_tokens=_address(num_recv_device), host_tag=host_tag, stream=stream)
        if num_worst_tokens == 0:
            num_recv, per_expert = self._runtime.wait_notify(tag=host_tag, num_local_experts=num_local_experts,
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
        self._runtime.dispatch(
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
        self._runtime.combine(
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

    # ---- low-latency mode (selected only once its kernels exist; see unsupported_reason) -------
    def _no_low_latency(self):
        raise RuntimeError("the native backend has no low-latency kernels in this build")

    def low_latency_dispatch(self, *args, **kwargs):
        self._no_low_latency()

    def low_latency_combine(self, *args, **kwargs):
        self._no_low_latency()

    def get_next_low_latency_combine_buffer(self, handle):
        self._no_low_latency()

    def clean_low_latency_buffer(self, *args, **kwargs):
        self._no_low_latency()

    def destroy(self, collective: bool = True) -> None:
        torch.cuda.synchronize(self.info.device)
        if collective:
            # NOTE: no rank may free its buffer while a peer's kernel could still write into it.
            dist.barrier(group=self.info.group)
        self._runtime.destroy()
