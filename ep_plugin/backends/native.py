"""The native backend: the csrc kernels over CUDA-IPC-mapped NVLink buffers (one NVLink domain), and
in low-latency mode the NVSHMEM kernels of `ep_plugin._C_nvshmem` (any NVSHMEM transport).

`NativeBackend` chooses what this buffer can run and owns its lifetime; the host code of each mode
lives with its handles: intranode.py (normal mode in one NVLink domain), internode.py (the network
leg and the forwarding across nodes, docs/internode.md), low_latency.py. Tensors go to the
extensions as device addresses; every output is allocated with torch on the current stream (Buffer
makes its communication stream current).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..errors import device_failure, raises_structured_errors, runtimes_of
from ..output_region import OutputRegion
from ..tuning import MAX_TOPK
from .base import GroupInfo
from .intranode import NativeHandle
from .internode import (INTERNODE_BY_DEFAULT, NET_WARPS_PER_BLOCK, InternodeHandle, InternodeMode,
                        forwarder_source_nodes, internode_unsupported_reason, network_geometry, source_order,
                        split_ring_slots, _NET_COMBINE, _NET_DISPATCH)
from .low_latency import LOW_LATENCY_VERIFIED, LowLatencyHandle, LowLatencyMode, low_latency_unsupported_reason
from .native_common import IMPORT_ERROR, _C, _C_torch

__all__ = ["INTERNODE_BY_DEFAULT", "LOW_LATENCY_VERIFIED", "NET_WARPS_PER_BLOCK", "InternodeHandle", "LowLatencyHandle",
           "NativeBackend", "NativeHandle", "forwarder_source_nodes", "network_geometry", "source_order",
           "split_ring_slots", "unsupported_reason"]


def unsupported_reason(info: GroupInfo, low_latency_mode: bool, num_nvl_bytes: int, requested: str = "auto") -> str:
    """Why the native backend cannot serve this buffer ('' if it can).

    `requested`: the configured backend ('auto' or 'native'); unverified kernels are only used when
    asked for by name.
    """
    if low_latency_mode:
        return low_latency_unsupported_reason(info, requested)
    if _C is None:
        return f"the extension ep_plugin._C is not built ({IMPORT_ERROR})"
    if info.device.type != "cuda":
        return "no CUDA device in this process"
    if not info.is_intranode:
        return internode_unsupported_reason(info, num_nvl_bytes, requested)
    if info.num_ranks > _C.MAX_NVL_PEERS:
        return f"{info.num_ranks} ranks in one NVLink domain; the intranode kernels take at most {_C.MAX_NVL_PEERS}"
    if num_nvl_bytes < _C.NVL_HEADER_BYTES:
        return (f"num_nvl_bytes = {num_nvl_bytes} is below the minimum {_C.NVL_HEADER_BYTES}; size it with "
                "Config.get_nvl_buffer_size_hint")
    return ""


@raises_structured_errors
class NativeBackend(InternodeMode, LowLatencyMode):
    name = "native"

    def __init__(self, info: GroupInfo, settings, num_nvl_bytes: int, num_rdma_bytes: int,
                 low_latency_mode: bool) -> None:
        super().__init__(info, settings, num_nvl_bytes, num_rdma_bytes, low_latency_mode)
        reason = unsupported_reason(info, low_latency_mode, num_nvl_bytes, requested="native")
        if reason:
            raise RuntimeError(f"native backend unavailable: {reason}")
        self._runtime = None
        self._staging_bytes = 0
        self._outputs: Optional[OutputRegion] = None  # direct dispatch (buffer.dispatch_output_bytes)
        self._side_stream: Optional[torch.cuda.Stream] = None
        self.last_combine_path = ""  # "copy_engine", "pull" or "sm" (intranode combine; for tests and logs)
        self.last_dispatch_path = ""  # "direct" or "rings" (intranode dispatch; for tests and logs)
        self._ll = None
        self._ll_parity = 0
        self._ll_plans = {}
        self._ll_unchecked_plans = {}
        self._output_groups = {}  # _output_group's
        self._layout_calls = {}  # get_dispatch_layout's fast path: _C_torch.LayoutCalls per expert count
        self._inputs = _C_torch.NormalInputs(info.device, MAX_TOPK)  # the dispatch's tensors read in C++
        self._dispatch_outputs = {}  # DispatchOutputs per kind of dispatch (intranode.py)
        self._combine_outputs = {}  # the intranode combine's output group per (hidden, top-k) (intranode.py)
        self._ll_split = False  # launch send and receive as two kernels even without a hook (_start_low_latency)
        self._net = None
        self._net_tag = 0
        self._net_geometry = {_NET_DISPATCH: None, _NET_COMBINE: None}
        if not low_latency_mode and not info.is_intranode:
            self._runtime = self._start_node_runtime(num_nvl_bytes)
            self._net = self._start_internode(num_rdma_bytes)
        elif not low_latency_mode or self._normal_mode_possible(num_nvl_bytes):
            self._start_intranode(num_nvl_bytes, low_latency_mode)
        if low_latency_mode:
            self._ll = self._start_low_latency(num_rdma_bytes)
        self._num_device_sms = torch.cuda.get_device_properties(info.device).multi_processor_count
        self._notify_tag = 0

    def _normal_mode_possible(self, num_nvl_bytes: int) -> bool:
        """In low-latency mode, whether normal-mode kernels can run on this buffer as well."""
        return _C is not None and self.info.is_intranode and unsupported_reason(self.info, False, num_nvl_bytes) == ""

    # ---- normal mode: intranode (intranode.py) or across nodes (internode.py) --------------------
    def dispatch(self, x, x_scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
                 num_tokens_per_expert, expert_alignment, num_worst_tokens, config):
        if self._net is not None:
            if topk_idx is None:
                raise NotImplementedError("dispatch without topk_idx across nodes is not supported by the native "
                                          "backend (its intranode stage routes forwarded rows by their expert ids); "
                                          "pass topk_idx, or use backend: reference")
            return self._internode_dispatch(x, x_scales, topk_idx, topk_weights, is_token_in_rank,
                                            num_tokens_per_expert, expert_alignment, num_worst_tokens, config)
        self._check_sms(config)
        return self._node_dispatch(x, x_scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert,
                                   expert_alignment, num_worst_tokens, config)

    def cached_dispatch(self, x, x_scales, handle: NativeHandle, config):
        if isinstance(handle, InternodeHandle):
            return self._internode_cached_dispatch(x, x_scales, handle, config)
        return self._intranode_cached_dispatch(x, x_scales, handle, config)

    def combine(self, x, handle: NativeHandle, topk_weights, bias_0, bias_1, config):
        if isinstance(handle, InternodeHandle):
            return self._internode_combine(x, handle, topk_weights, bias_0, bias_1, config)
        return self._intranode_combine(x, handle, topk_weights, bias_0, bias_1, config)

    def handle_num_recv_rows(self, handle: NativeHandle) -> int:
        return handle.num_recv_rows

    def handle_num_tokens(self, handle: NativeHandle) -> int:
        return handle.num_tokens

    def destroy(self, collective: bool = True) -> None:
        torch.cuda.synchronize(self.info.device)
        if self.failure is None:
            self.failure = device_failure(runtimes_of(self))
        # NOTE: no rank may free its buffer while a peer's kernel could still write into it. A failed
        # Buffer's peers may be gone: no barrier (a live peer's kernels end within timeout_s).
        if collective and self.failure is None:
            dist.barrier(group=self.info.group)
        self._layout_calls.clear()  # they hold the runtime
        if self._runtime is not None:
            self._runtime.destroy()
        if self._net is not None:
            self._net.destroy(collective=collective)
        if self._ll is not None:
            self._ll.destroy(collective=collective)
