"""The native backend: the csrc kernels over CUDA-IPC-mapped NVLink buffers (one NVLink domain), and
in low-latency mode the NVSHMEM kernels of `ep_plugin._C_nvshmem` (any NVSHMEM transport).

Across nodes (normal mode) a dispatch runs in two stages (docs/internode.md): the network leg
(`_C_nvshmem.InternodeRuntime`) sends each token once per destination node to the rank with the
same local index there (the forwarder), then the intranode kernels (`_C.IntranodeRuntime` over the
node's ranks) forward it over NVLink. Combine runs the stages in reverse.

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
from ..errors import raises_structured_errors
from ..tuning import (INTERNODE_MAX_CHANNELS, Config, default_combine_config, default_dispatch_config, output_region_bytes,
                      staging_bytes)
from ..output_region import OutputRegion
from .base import Backend, DispatchRoute, GroupInfo

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

# Whether the native low-latency kernels have passed tests/test_native_low_latency.py on GPUs
# (2x H200, 2026-11-22: all 48). While False, `backend: auto` keeps the reference backend for
# low-latency mode and only `backend: native` selects them.
LOW_LATENCY_VERIFIED = True

# Whether `backend: auto` picks the native internode kernels. They pass tests/test_native_internode.py
# on 2 emulated nodes of 1 GPU (2x H200, 2026-11-22), but the 2x2 emulation has not run (4 GPUs) and
# on the emulated nodes they are slower than the reference backend (docs/benchmarks.md), so `auto`
# keeps the reference across nodes; `backend: native` selects them.
INTERNODE_BY_DEFAULT = False

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
        return _internode_unsupported_reason(info, num_nvl_bytes, requested)
    if info.num_ranks > _C.MAX_NVL_PEERS:
        return f"{info.num_ranks} ranks in one NVLink domain; the intranode kernels take at most {_C.MAX_NVL_PEERS}"
    if num_nvl_bytes < _C.NVL_HEADER_BYTES:
        return (f"num_nvl_bytes = {num_nvl_bytes} is below the minimum {_C.NVL_HEADER_BYTES}; size it with "
                "Config.get_nvl_buffer_size_hint")
    return ""


def _internode_unsupported_reason(info: GroupInfo, num_nvl_bytes: int, requested: str) -> str:
    if _C_nvshmem is None:
        return f"the NVSHMEM extension ep_plugin._C_nvshmem is not built ({_NVSHMEM_IMPORT_ERROR})"
    if info.ranks_per_node > _C.MAX_NVL_PEERS:
        return (f"{info.ranks_per_node} ranks per node; the intranode stage takes at most {_C.MAX_NVL_PEERS} "
                "(set topology.ranks_per_node)")
    if info.num_nodes > _C_nvshmem.INTERNODE_MAX_NODES:
        return f"{info.num_nodes} nodes; the internode kernels take at most {_C_nvshmem.INTERNODE_MAX_NODES}"
    if num_nvl_bytes < _C.NVL_HEADER_BYTES:
        return (f"num_nvl_bytes = {num_nvl_bytes} is below the minimum {_C.NVL_HEADER_BYTES} that the intranode "
                "stage needs; size it with Config.get_nvl_buffer_size_hint")
    if not INTERNODE_BY_DEFAULT and requested != "native":
        return ("native internode kernels are built and pass their tests on emulated nodes, but are not yet "
                "faster than the reference there (select them with backend: native)")
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
    expert_sums: bool = False            # the payloads carried routes: the combine sums on the expert side
    bf16_partials: bool = False          # ... and sends its partials to peers as bf16 (else fp32)
    combine_buffer: Optional[torch.Tensor] = field(default=None)
    dispatch_route: Optional[DispatchRoute] = field(default=None)  # set by the Buffer

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
    num_recv_per_rank: Optional[List[int]] = None  # rows from each source rank, when known on the host


@dataclass(eq=False)
class InternodeHandle:
    """Layout of one dispatch across nodes (opaque to users): both stages.

    Network leg: token t goes to node n iff is_token_in_node[t, n]; it is slot send_pos[t, n] of
    the (channel, n) stream. Forwarder rows are ordered by source node, channel, token
    (recv_offsets). Intranode stage: `node` (a NativeHandle over the node's ranks, whose "tokens"
    are the forwarder rows). With several ranks per node, final rows are permuted into source-rank
    order: final row i is intranode row perm[i].
    """
    owner: "NativeBackend"
    num_tokens: int                  # T of this rank
    num_recv_rows: int               # rows of recv_x (received tokens, or num_worst_tokens)
    num_worst_tokens: int
    num_channels: int                # channels of the network leg (fixed by the dispatch)
    num_blocks: int                  # blocks per half of its launches (each serves num_channels / num_blocks)
    dispatch_slot_bytes: int         # slot size of the dispatch's network leg
    is_token_in_node: torch.Tensor   # [T, N] bool
    send_pos: torch.Tensor           # [T, N] int32
    send_counts: torch.Tensor        # [N * C] int32
    recv_offsets: torch.Tensor       # [N * C + 1] int32
    num_forward_rows: int            # forwarder rows (received over the network, or the graph capacity)
    node: Optional["NativeHandle"]   # the intranode stage; None with one rank per node (no stage)
    perm: Optional[torch.Tensor]     # [rows] int64, or None (one rank per node)
    inv_perm: Optional[torch.Tensor]


_NET_DISPATCH, _NET_COMBINE = 0, 1  # ring kinds of the network leg
NET_WARPS_PER_BLOCK = 16  # = internode kWarps (csrc/kernels/internode_layout.cuh)


def network_geometry(num_blocks: int, ring_slots: int, num_nodes: int) -> Tuple[int, int]:
    """(channels, slots per ring) of the network leg on `num_blocks` sender (and receiver) blocks.

    Each ring (channel, node) has one warp on each side, so with few nodes most warps of a block
    would idle: a block serves G channels (sub-channels), G = min(warps / nodes,
    INTERNODE_MAX_CHANNELS / blocks, ring_slots), and the config's `ring_slots` are split among
    them, so the rings take no more memory than `num_blocks` channels of `ring_slots` would.
    """
    group = max(1, min(NET_WARPS_PER_BLOCK // num_nodes, INTERNODE_MAX_CHANNELS // num_blocks, ring_slots))
    return num_blocks * group, split_ring_slots(ring_slots, group)


def split_ring_slots(ring_slots: int, group: int) -> int:
    """A config's `ring_slots` per channel when a block serves `group` channels (at least 1)."""
    return max(1, ring_slots // group)



def _address(tensor: Optional[torch.Tensor]) -> int:
    return 0 if tensor is None or tensor.numel() == 0 else tensor.data_ptr()


@raises_structured_errors
class NativeBackend(Backend):
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
        self._copy_engine_dispatch = False
        self._side_stream: Optional[torch.cuda.Stream] = None
        self.last_combine_path = ""  # "copy_engine" or "sm" (intranode combine; for tests and logs)
        self.last_dispatch_path = ""  # "direct" or "rings" (intranode dispatch; for tests and logs)
        # How many of this rank's tokens (its last ones) had their rows of the last direct dispatch cross NVLink
        # by copy engine; the SMs stored the others' rows.
        self.last_dispatch_staged_tokens = 0
        self._ll = None
        self._ll_parity = 0
        self._ll_split = False  # launch send and receive as two kernels even without a hook (_start_low_latency)
        self._net = None
        self._net_tag = 0
        self._net_geometry = {_NET_DISPATCH: None, _NET_COMBINE: None}
        if not low_latency_mode and not info.is_intranode:
            self._runtime = self._start_node_runtime(num_nvl_bytes)
            self._net = self._start_internode(num_rdma_bytes)
        elif not low_latency_mode or self._normal_mode_possible(num_nvl_bytes):
            # The copy-engine combine's staging area: only for buffers made for normal mode.
            staging = 0 if low_latency_mode else staging_bytes(settings.buffer, info.num_ranks)
            output_bytes = 0 if low_latency_mode else output_region_bytes(settings.buffer, info.num_ranks)
            self._runtime = _C.IntranodeRuntime(info.rank, info.num_ranks, num_nvl_bytes, settings.timeout_s, staging,
                                                output_bytes)
            peers: List[Optional[Tuple[bytes, int]]] = [None] * info.num_ranks
            dist.all_gather_object(peers, (self._runtime.ipc_handle(), staging), group=info.group)
            self._runtime.connect([handle for handle, _ in peers])
            # Every rank carves its peers' staging areas alike: by the smallest of them.
            self._staging_bytes = min(size for _, size in peers)
            if output_bytes > 0:
                self._outputs = OutputRegion(self._runtime.output_region_address, output_bytes, info.device)
        # Copy-engine rows for the direct dispatch (buffer.dispatch_copy_engine): through the staging area.
        self._copy_engine_dispatch = (settings.buffer.dispatch_copy_engine and self._outputs is not None
                                      and self._staging_bytes > 0 and info.num_ranks > 1)
        if low_latency_mode:
            self._ll = self._start_low_latency(num_rdma_bytes)
        self._num_device_sms = torch.cuda.get_device_properties(info.device).multi_processor_count
        self._notify_tag = 0

    def _normal_mode_possible(self, num_nvl_bytes: int) -> bool:
        """In low-latency mode, whether normal-mode kernels can run on this buffer as well."""
        return _C is not None and self.info.is_intranode and unsupported_reason(self.info, False, num_nvl_bytes) == ""

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

    def _start_low_latency(self, num_rdma_bytes: int):
        """NVSHMEM over the process group (unique id from rank 0, every rank a PE) and the symmetric buffer."""
        if num_rdma_bytes <= _C_nvshmem.HEADER_BYTES:
            raise ValueError(f"num_rdma_bytes = {num_rdma_bytes} is too small for native low-latency mode; size it "
                             "with Buffer.get_low_latency_rdma_size_hint")
        unique_id = self._prepare_nvshmem(num_rdma_bytes)
        runtime = _C_nvshmem.LowLatencyRuntime(self.info.rank, self.info.num_ranks, num_rdma_bytes,
                                               self.settings.timeout_s, unique_id)
        direct = runtime.direct_peers()
        logger.info("ep_plugin rank %d: low-latency symmetric buffer of %d bytes; peers over NVLink: %s, over the "
                    "network: %s", self.info.rank, num_rdma_bytes, [r for r, d in enumerate(direct) if d],
                    [r for r, d in enumerate(direct) if not d])
        # NOTE: a fused send + receive launch finishes only once every block of every rank's launch has
        # been resident at the same time (each block's receive waits for blocks of all ranks), and it
        # launches one block per SM the process sees. Ranks that share a GPU (CUDA MPS) have no such
        # guarantee: MPS limits each client's SMs but reserves none. A send launch never waits, so two
        # launches (send, then receive) need no co-residency; that costs one launch per call.
        sharing = _ranks_on_this_gpu(self.info)
        self._ll_split = sharing > 1
        if self._ll_split:
            logger.info("ep_plugin rank %d: %d ranks share this GPU; low-latency send and receive run as separate "
                        "launches", self.info.rank, sharing)
        return runtime

    def _start_node_runtime(self, num_nvl_bytes: int):
        """The intranode runtime over this rank's node (local rank, ranks_per_node ranks)."""
        L = self.info.ranks_per_node
        node, local = divmod(self.info.rank, L)
        runtime = _C.IntranodeRuntime(local, L, num_nvl_bytes, self.settings.timeout_s)
        handles: List[Optional[bytes]] = [None] * self.info.num_ranks
        dist.all_gather_object(handles, runtime.ipc_handle(), group=self.info.group)
        runtime.connect(handles[node * L:(node + 1) * L])
        return runtime

    def _default_rdma_bytes(self) -> int:
        """Symmetric bytes for the configured sizes (buffer.max_hidden, dispatch/combine sections)."""
        R, L = self.info.num_ranks, self.info.ranks_per_node
        hidden_bytes = self.settings.buffer.max_hidden * 2
        sizes = []
        for base, section in ((default_dispatch_config(self.settings.num_sms, R), self.settings.dispatch),
                              (default_combine_config(self.settings.num_sms, R), self.settings.combine)):
            recv = section.rdma_chunked_recv_tokens or base.num_max_rdma_chunked_recv_tokens
            config = Config(base.num_sms, 1, max(1, base.num_max_nvl_chunked_recv_tokens), 1, recv)
            sizes.append(config.get_rdma_buffer_size_hint(hidden_bytes, R, L))
        return max(sizes)

    def _start_internode(self, num_rdma_bytes: int):
        """NVSHMEM over the process group (unique id from rank 0, every rank a PE) and the network leg's buffer."""
        if num_rdma_bytes == 0:
            num_rdma_bytes = self._default_rdma_bytes()
            logger.info("ep_plugin rank %d: num_rdma_bytes = 0 across %d nodes; using %d bytes (buffer.max_hidden = "
                        "%d)", self.info.rank, self.info.num_nodes, num_rdma_bytes, self.settings.buffer.max_hidden)
            self.num_rdma_bytes = num_rdma_bytes
        if num_rdma_bytes <= _C_nvshmem.INTERNODE_HEADER_BYTES:
            raise ValueError(f"num_rdma_bytes = {num_rdma_bytes} is too small for native internode mode; size it with "
                             f"Config.get_rdma_buffer_size_hint(hidden_bytes, {self.info.num_ranks}, "
                             f"ranks_per_node={self.info.ranks_per_node})")
        unique_id = self._prepare_nvshmem(num_rdma_bytes)
        runtime = _C_nvshmem.InternodeRuntime(self.info.rank, self.info.num_ranks, self.info.ranks_per_node,
                                              num_rdma_bytes, self.settings.timeout_s, unique_id)
        direct = runtime.direct_peers()
        logger.info("ep_plugin rank %d: internode mode, %d nodes x %d ranks; symmetric buffer of %d bytes; PEs over "
                    "NVLink: %s, over the network: %s", self.info.rank, self.info.num_nodes,
                    self.info.ranks_per_node, num_rdma_bytes, [r for r, d in enumerate(direct) if d],
                    [r for r, d in enumerate(direct) if not d])
        return runtime

    # ---- helpers -------------------------------------------------------------------------------
    def _stream(self) -> int:
        # NOTE: by device index: with no argument torch looks the current device up (a few us per call).
        return torch.cuda.current_stream(self.info.device.index).cuda_stream

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
        if self._net is not None:
            return self._internode_dispatch(x, x_scales, topk_idx, topk_weights, is_token_in_rank,
                                            num_tokens_per_expert, expert_alignment, num_worst_tokens, config)
        self._check_sms(config)
        return self._node_dispatch(x, x_scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert,
                                   expert_alignment, num_worst_tokens, config)

    def _node_dispatch(self, x, x_scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert,
                       expert_alignment, num_worst_tokens, config: Config):
        """The intranode kernels among the ranks of this node: notify, the host's wait for the received
        count (unless `num_worst_tokens`), outputs, dispatch. `is_token_in_rank` is `[T, ranks of the
        node]` and expert ids count from the node's first expert. Returns DeepEP's dispatch outputs."""
        T, K = topk_idx.shape
        R = is_token_in_rank.size(1)
        num_experts = num_tokens_per_expert.size(0)
        num_local_experts = _local_experts(num_experts, R)
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
                                 num_worst_tokens=num_worst_tokens, row_bytes=x.size(1) * x.element_size(),
                                 num_scales=0 if x_scales is None else x_scales.size(1),
                                 has_weights=topk_weights is not None, send_pos=_address(send_pos),
                                 recv_rank_offsets=_address(recv_rank_offsets),
                                 src_num_tokens=_address(src_num_tokens), num_recv_tokens=_address(num_recv_device),
                                 host_tag=host_tag, stream=stream)
        if num_worst_tokens == 0:
            num_recv, per_rank, per_expert = self._intranode().wait_notify(
                tag=host_tag, num_local_experts=num_local_experts, stream=stream)
            rows = num_recv
        else:
            num_recv, per_rank, per_expert, rows = None, None, [], num_worst_tokens

        direct = self._direct_dispatch_possible()
        (recv_x, recv_scales, recv_topk_idx, recv_topk_weights, recv_src_idx), has_room = self._recv_outputs(
            direct, [((rows, x.size(1)), x.dtype),
                     None if x_scales is None else ((rows, x_scales.size(1)), torch.float32),
                     ((rows, K), torch.int64),
                     None if topk_weights is None else ((rows, K), torch.float32),
                     ((rows,), torch.int32)])
        self._launch_dispatch(x, x_scales, topk_idx, topk_weights, send_pos, recv_x, recv_scales, recv_topk_idx,
                              recv_topk_weights, recv_src_idx, num_local_experts, num_worst_tokens, num_recv_device,
                              config, direct_rows=rows if direct else None, has_room=has_room,
                              recv_rank_offsets=recv_rank_offsets)
        handle = NativeHandle(owner=self, num_tokens=T, num_recv_rows=rows, num_recv_tokens=num_recv,
                              num_worst_tokens=num_worst_tokens, is_token_in_rank=is_token_in_rank,
                              send_pos=send_pos, recv_rank_offsets=recv_rank_offsets, src_num_tokens=src_num_tokens,
                              recv_src_idx=recv_src_idx, num_recv_device=num_recv_device,
                              num_recv_per_rank=per_rank)
        return recv_x, recv_scales, recv_topk_idx, recv_topk_weights, list(per_expert), handle

    def _direct_dispatch_possible(self) -> bool:
        """Whether this intranode dispatch writes straight into the ranks' output regions. Every rank decides
        alike: all have the region (same config) and capture graphs together."""
        return self._outputs is not None and self._net is None and not torch.cuda.is_current_stream_capturing()

    def _recv_outputs(self, direct: bool, specs) -> Tuple[List[Optional[torch.Tensor]], bool]:
        """The dispatch's outputs for `specs` ((shape, dtype) or None each; the rows and their scales
        first, then the metadata), and whether they are in the output region. They are there when
        `direct` and the region has room (two blocks: the rows go back with recv_x, the metadata with
        the handle); else ordinary tensors, and a direct dispatch then falls back to the rings on every
        rank (the kernels agree on it; no rank raises)."""
        if direct:
            stream = self._stream()
            rows = self._region_outputs(specs[:2], stream)
            metadata = self._region_outputs(specs[2:], stream) if rows is not None else None
            if metadata is not None:
                return rows + metadata, True
        return [None if spec is None else self._empty(*spec[0], dtype=spec[1]) for spec in specs], False

    def _region_outputs(self, specs, stream: int) -> Optional[List[Optional[torch.Tensor]]]:
        """Tensors for `specs` (None entries stay None) in one block of the output region, or None
        when it has no room."""
        present = [spec for spec in specs if spec is not None]
        if not present:
            return [None] * len(specs)
        tensors = self._outputs.empty_group(present, stream)
        if tensors is None:
            return None
        found = iter(tensors)
        return [None if spec is None else next(found) for spec in specs]

    @property
    def last_dispatch_copy_engine(self) -> bool:
        """Whether some of this rank's rows of the last direct dispatch crossed NVLink by copy engine."""
        return self.last_dispatch_staged_tokens > 0

    def direct_fell_back(self) -> bool:
        """Whether this rank's last direct dispatch found a rank without room in its output region and
        moved the rows through the rings instead (synchronises with the device; for tests and logs)."""
        return self._intranode().direct_fell_back()

    def _launch_dispatch(self, x, x_scales, topk_idx, topk_weights, send_pos, recv_x, recv_scales, recv_topk_idx,
                         recv_topk_weights, recv_src_idx, num_local_experts, num_worst_tokens, num_recv_device,
                         config: Config, direct_rows: Optional[int] = None, has_room: bool = True,
                         recv_rank_offsets: Optional[torch.Tensor] = None,
                         cached_src_idx: Optional[torch.Tensor] = None) -> None:
        # "direct": the direct kernel ran (and may have fallen back: direct_fell_back).
        self.last_dispatch_path = "rings" if direct_rows is None else "direct"
        staged = direct_rows is not None and self._copy_engine_dispatch
        if staged and self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device=self.info.device)
        self.last_dispatch_staged_tokens = self._intranode().dispatch(
            num_channels=config.num_channels, recv_tokens_per_channel=config.num_max_nvl_chunked_recv_tokens,
            send_chunk=config.num_max_nvl_chunked_send_tokens, num_tokens=x.size(0), row_bytes=x.size(1) * x.element_size(),
            num_scales=0 if x_scales is None else x_scales.size(1),
            num_topk=0 if topk_idx is None else topk_idx.size(1), num_local_experts=num_local_experts,
            x=_address(x), x_scales=_address(x_scales), topk_idx=_address(topk_idx),
            topk_weights=_address(topk_weights), send_pos=_address(send_pos), recv_x=_address(recv_x),
            recv_x_scales=_address(recv_scales), recv_topk_idx=_address(recv_topk_idx),
            recv_topk_weights=_address(recv_topk_weights), recv_src_idx=_address(recv_src_idx),
            num_worst_tokens=num_worst_tokens, num_recv_tokens=_address(num_recv_device), stream=self._stream(),
            direct=direct_rows is not None, num_recv_rows=direct_rows or 0, has_room=has_room,
            staging_bytes=self._staging_bytes if staged else 0,
            side_stream=self._side_stream.cuda_stream if staged else 0,
            recv_rank_offsets=_address(recv_rank_offsets) if staged else 0,
            cached_src_idx=_address(cached_src_idx) if staged else 0)

    def cached_dispatch(self, x, x_scales, handle: NativeHandle, config: Config):
        if isinstance(handle, InternodeHandle):
            return self._internode_cached_dispatch(x, x_scales, handle, config)
        self._check_sms(config)
        rows = handle.num_recv_rows
        direct = self._direct_dispatch_possible()
        (recv_x, recv_scales), has_room = self._recv_outputs(
            direct, [((rows, x.size(1)), x.dtype), None if x_scales is None else ((rows, x_scales.size(1)), torch.float32)])
        self._launch_dispatch(x, x_scales, None, None, handle.send_pos, recv_x, recv_scales, None, None, None, 1,
                              handle.num_worst_tokens, handle.num_recv_device, config,
                              direct_rows=rows if direct else None, has_room=has_room,
                              recv_rank_offsets=handle.recv_rank_offsets, cached_src_idx=handle.recv_src_idx)
        return recv_x, recv_scales

    def combine(self, x, handle: NativeHandle, topk_weights, bias_0, bias_1, config: Config):
        if isinstance(handle, InternodeHandle):
            return self._internode_combine(x, handle, topk_weights, bias_0, bias_1, config)
        self._check_sms(config)
        T = handle.num_tokens
        combined_x = self._empty(T, x.size(1), dtype=torch.bfloat16)
        combined_weights = None if topk_weights is None else self._empty(T, topk_weights.size(1), dtype=torch.float32)
        if self._copy_engine_combine_possible(handle, x.size(1)):
            self._staged_combine(x, handle, topk_weights, bias_0, bias_1, combined_x, combined_weights, config)
            self.last_combine_path = "copy_engine"
            return combined_x, combined_weights
        self.last_combine_path = "sm"
        self._intranode().combine(
            num_channels=config.num_channels, recv_tokens_per_channel=config.num_max_nvl_chunked_recv_tokens,
            send_chunk=config.num_max_nvl_chunked_send_tokens, num_tokens=T, hidden=x.size(1), num_topk=0 if topk_weights is None else topk_weights.size(1),
            x=_address(x), topk_weights=_address(topk_weights), recv_src_idx=_address(handle.recv_src_idx),
            recv_rank_offsets=_address(handle.recv_rank_offsets), src_num_tokens=_address(handle.src_num_tokens),
            send_pos=_address(handle.send_pos), bias_0=_address(bias_0), bias_1=_address(bias_1),
            combined_x=_address(combined_x), combined_topk_weights=_address(combined_weights),
            stream=self._stream())
        return combined_x, combined_weights

    def _copy_engine_combine_possible(self, handle: NativeHandle, hidden: int) -> bool:
        """Whether this combine goes through the copy engines (the same answer on every rank).

        It needs the received rows per source on the host (a dispatch that waited for its counts,
        not `num_worst_tokens`), a staging area that holds two pieces of rows, and no graph capture:
        the host numbers each combine, and a replayed graph would repeat the numbers.
        """
        return (self._staging_bytes > 0 and handle.num_recv_per_rank is not None and self.info.num_ranks > 1
                and self._intranode().staging_rows(self._staging_bytes, hidden) > 0
                and not torch.cuda.is_current_stream_capturing())

    def _staged_combine(self, x, handle: NativeHandle, topk_weights, bias_0, bias_1, combined_x, combined_weights,
                        config: Config) -> None:
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device=self.info.device)
        # The reduction uses the config's SMs but leaves one per peer free: each copy stream waits for
        # its owner in a one-thread kernel beside the reduction. The copies use no SM.
        num_sms = min(config.num_sms, self._num_device_sms - (self.info.num_ranks - 1))
        self._intranode().staged_combine(
            num_tokens=handle.num_tokens, hidden=x.size(1), num_topk=0 if topk_weights is None else topk_weights.size(1),
            x=_address(x), topk_weights=_address(topk_weights), send_pos=_address(handle.send_pos),
            bias_0=_address(bias_0), bias_1=_address(bias_1), combined_x=_address(combined_x),
            combined_topk_weights=_address(combined_weights), rows_from=handle.num_recv_per_rank,
            staging_bytes=self._staging_bytes, num_sms=num_sms, stream=self._stream(),
            side_stream=self._side_stream.cuda_stream)

    # ---- internode normal mode (network leg + intranode stage) ------------------------------------
    def _check_internode_sms(self, num_channels: int) -> None:
        if 2 * num_channels > self._num_device_sms:
            raise ValueError(f"the network leg needs {2 * num_channels} SMs (2 per channel), more than the "
                             f"{self._num_device_sms} of this GPU")

    def _handle_network_geometry(self, handle: "InternodeHandle", config: Config) -> Tuple[int, int, int]:
        """(channels, blocks, slots per ring) of a cached dispatch or combine: the dispatch's channels
        and blocks, with `config`'s ring slots split among a block's channels."""
        B = handle.num_blocks
        self._check_internode_sms(B)
        return (handle.num_channels, B,
                split_ring_slots(config.num_max_rdma_chunked_recv_tokens, handle.num_channels // B))

    def _prepare_rings(self, kind: int, geometry: Tuple[int, int, int], after_notify: bool) -> None:
        """Keep the network leg's rings consistent when a call changes their geometry.

        Rings are carved per call from (channels, slots, slot bytes). A notify step is a column
        barrier (every peer has finished its earlier kernels), so after it any geometry is safe. A
        combine or cached dispatch whose geometry differs from the last call of its kind could
        overwrite slots a peer has not consumed yet: a barrier of every PE first. Every rank makes
        the same calls with the same configs, so every rank takes the same decision.
        """
        if after_notify:
            self._net_geometry = {_NET_DISPATCH: None, _NET_COMBINE: None}
        last = self._net_geometry[kind]
        if last is not None and last != geometry:
            self._net.barrier(stream=self._stream())
            self._net_geometry = {_NET_DISPATCH: None, _NET_COMBINE: None}
        self._net_geometry[kind] = geometry

    def _node_relative_ids(self, global_ids: torch.Tensor, num_local_experts: int) -> torch.Tensor:
        """Global expert ids -> ids among this node's experts (-1 for experts on other nodes)."""
        span = self.info.ranks_per_node * num_local_experts
        first = (self.info.rank // self.info.ranks_per_node) * span
        relative = global_ids - first
        keep = (global_ids >= 0) & (relative >= 0) & (relative < span)
        return torch.where(keep, relative, torch.full_like(relative, -1))

    def _internode_dispatch(self, x, x_scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert,
                            expert_alignment, num_worst_tokens, config: Config):
        self._check_sms(config)
        net = self._net
        R, L, N = self.info.num_ranks, self.info.ranks_per_node, self.info.num_nodes
        T, K = topk_idx.shape
        num_experts = num_tokens_per_expert.size(0)
        num_local_experts = _local_experts(num_experts, R)
        B = config.num_channels
        self._check_internode_sms(B)
        C, S = network_geometry(B, config.num_max_rdma_chunked_recv_tokens, N)
        row_bytes = x.size(1) * x.element_size()
        num_scales = 0 if x_scales is None else x_scales.size(1)
        has_weights = topk_weights is not None
        stream = self._stream()

        # Network leg, notify: counts per (node, channel); forwarder rows of every source.
        is_token_in_node = is_token_in_rank.view(T, N, L).any(dim=2).contiguous()
        send_counts = self._empty(N * C, dtype=torch.int32)
        recv_offsets = self._empty(N * C + 1, dtype=torch.int32)
        num_forward_device = self._empty(1, dtype=torch.int32)
        graph = num_worst_tokens > 0
        # A forwarder row reaches at least one rank of the node: at most L * num_worst_tokens of them.
        capacity = num_worst_tokens * L if graph else 0
        tag = 0
        if not graph:
            self._net_tag += 1
            tag = self._net_tag
        net.notify(num_channels=C, num_tokens=T, is_token_in_node=_address(is_token_in_node), row_bytes=row_bytes,
                   num_scales=num_scales, num_topk=K, has_weights=has_weights, send_counts=_address(send_counts),
                   recv_offsets=_address(recv_offsets), num_recv=_address(num_forward_device), capacity=capacity,
                   host_tag=tag, stream=stream)
        F = capacity if graph else net.wait_notify(tag=tag, stream=stream)

        # Network leg, data: one row per (token, destination node) into the forwarders' rows.
        fwd_x = self._empty(F, x.size(1), dtype=x.dtype)
        fwd_scales = None if x_scales is None else self._empty(F, num_scales, dtype=torch.float32)
        fwd_topk = self._empty(F, K, dtype=torch.int64)
        fwd_weights = None if topk_weights is None else self._empty(F, K, dtype=torch.float32)
        send_pos = self._empty(T, N, dtype=torch.int32)
        slot_bytes = _C_nvshmem.internode_dispatch_slot_bytes(row_bytes, num_scales, K, has_weights)
        self._prepare_rings(_NET_DISPATCH, (C, S, slot_bytes), after_notify=True)
        net.dispatch(num_channels=C, num_blocks=B, ring_slots=S,
                     send_chunk=config.num_max_rdma_chunked_send_tokens, slot_bytes=slot_bytes, num_tokens=T,
                     row_bytes=row_bytes, num_scales=num_scales, num_topk=K, has_weights=has_weights, x=_address(x),
                     x_scales=_address(x_scales), topk_idx=_address(topk_idx), topk_weights=_address(topk_weights),
                     is_token_in_node=_address(is_token_in_node), send_pos=_address(send_pos),
                     recv_offsets=_address(recv_offsets), capacity=F, recv_x=_address(fwd_x),
                     recv_x_scales=_address(fwd_scales), recv_topk_idx=_address(fwd_topk),
                     recv_topk_weights=_address(fwd_weights), recv_src_idx=0, stream=stream)

        # Intranode stage: the forwarder rows are this rank's "tokens" inside the node.
        node_topk = self._node_relative_ids(fwd_topk, num_local_experts)
        if L == 1:
            recv_topk_weights, per_expert = self._lone_rank_outputs(node_topk, fwd_weights, num_local_experts,
                                                                    expert_alignment, graph)
            handle = InternodeHandle(owner=self, num_tokens=T, num_recv_rows=F, num_worst_tokens=num_worst_tokens,
                                     num_channels=C, num_blocks=B, dispatch_slot_bytes=slot_bytes,
                                     is_token_in_node=is_token_in_node, send_pos=send_pos, send_counts=send_counts,
                                     recv_offsets=recv_offsets, num_forward_rows=F, node=None, perm=None,
                                     inv_perm=None)
            return fwd_x, fwd_scales, node_topk, recv_topk_weights, per_expert, handle
        node_experts = L * num_local_experts
        node_per_rank = self._empty(L, dtype=torch.int32)
        node_per_expert = self._empty(node_experts, dtype=torch.int32)
        node_in_rank = self._empty(F, L, dtype=torch.bool)
        _C.get_dispatch_layout(topk_idx=_address(node_topk), num_tokens=F, num_topk=K, num_experts=node_experts,
                               num_ranks=L, ranks_per_node=L, num_tokens_per_rank=_address(node_per_rank),
                               num_tokens_per_node=0, num_tokens_per_expert=_address(node_per_expert),
                               is_token_in_rank=_address(node_in_rank), stream=stream)
        recv_x, recv_scales, recv_topk_idx, recv_topk_weights, per_expert, node = self._node_dispatch(
            fwd_x, fwd_scales, node_topk, fwd_weights, node_in_rank, node_per_expert, expert_alignment,
            num_worst_tokens, config)
        rows = node.num_recv_rows

        perm = inv_perm = None
        if L > 1:
            perm, inv_perm = self._source_order(recv_offsets, F, C, node, config)
            recv_x = _take(recv_x, perm)
            recv_scales = _take(recv_scales, perm)
            recv_topk_idx = _take(recv_topk_idx, perm)
            recv_topk_weights = _take(recv_topk_weights, perm)
        handle = InternodeHandle(owner=self, num_tokens=T, num_recv_rows=rows, num_worst_tokens=num_worst_tokens,
                                 num_channels=C, num_blocks=B, dispatch_slot_bytes=slot_bytes,
                                 is_token_in_node=is_token_in_node,
                                 send_pos=send_pos, send_counts=send_counts, recv_offsets=recv_offsets,
                                 num_forward_rows=F, node=node, perm=perm, inv_perm=inv_perm)
        return recv_x, recv_scales, recv_topk_idx, recv_topk_weights, list(per_expert), handle

    def _lone_rank_outputs(self, local_topk: torch.Tensor, weights: Optional[torch.Tensor], num_local_experts: int,
                           expert_alignment: int, graph: bool):
        """One rank per node: the forwarder rows already are this rank's received rows, in the
        reference order, so the intranode stage (which would copy them unchanged) is skipped. What it
        would add: weights of other ranks' experts (and of padding rows) become 0, and the aligned
        per-expert counts (host mode only, as there)."""
        recv_weights = None if weights is None else torch.where(local_topk >= 0, weights, torch.zeros_like(weights))
        if graph:
            return recv_weights, []
        # Ids of other ranks' experts count into an extra bucket; one host sync (the list), as DeepEP's.
        ids = torch.where(local_topk >= 0, local_topk, num_local_experts).flatten()
        buckets = torch.zeros(num_local_experts + 1, dtype=torch.int64, device=ids.device)
        counts = buckets.scatter_add_(0, ids, torch.ones_like(ids))[:num_local_experts].tolist()
        return recv_weights, [(c + expert_alignment - 1) // expert_alignment * expert_alignment for c in counts]

    def _source_order(self, recv_offsets: torch.Tensor, F: int, C: int, node: "NativeHandle", config: Config):
        """Permutation that puts the intranode stage's rows (by forwarder, then source node, then token)
        into the reference order (source rank = source node * L + forwarder, then token); padding last.

        The source node of each forwarder row travels to its final rank through a cached intranode
        dispatch of a 16-byte tag per row. Graph-capturable (no host synchronisation).
        """
        device = self.info.device
        src_node = forwarder_source_nodes(recv_offsets, F, C, self.info.num_nodes)
        tag = torch.zeros(F, 4, dtype=torch.int32, device=device)
        tag[:, 0] = src_node
        tag_bf16 = tag.view(torch.bfloat16)  # [F, 8]: one 16-byte row per forwarder row
        rows = node.num_recv_rows
        recv_tag = self._empty(rows, 8, dtype=torch.bfloat16)
        self._launch_dispatch(tag_bf16, None, None, None, node.send_pos, recv_tag, None, None, None, None, 1,
                              node.num_worst_tokens, node.num_recv_device, config)
        final_src_node = recv_tag.view(torch.int32)[:, 0]
        return source_order(final_src_node, node.recv_rank_offsets, node.num_recv_device, self.info.ranks_per_node,
                            self.info.num_ranks)

    def _internode_cached_dispatch(self, x, x_scales, handle: "InternodeHandle", config: Config):
        self._check_sms(config)
        net = self._net
        C, B, S = self._handle_network_geometry(handle, config)
        T, F = handle.num_tokens, handle.num_forward_rows
        row_bytes = x.size(1) * x.element_size()
        num_scales = 0 if x_scales is None else x_scales.size(1)
        # The dispatch's slot size when the row fits it, so that the rings keep their geometry.
        slot_bytes = max(handle.dispatch_slot_bytes,
                         _C_nvshmem.internode_dispatch_slot_bytes(row_bytes, num_scales, 0, False))
        self._prepare_rings(_NET_DISPATCH, (C, S, slot_bytes), after_notify=False)
        fwd_x = self._empty(F, x.size(1), dtype=x.dtype)
        fwd_scales = None if x_scales is None else self._empty(F, num_scales, dtype=torch.float32)
        net.dispatch(num_channels=C, num_blocks=B, ring_slots=S,
                     send_chunk=config.num_max_rdma_chunked_send_tokens, slot_bytes=slot_bytes, num_tokens=T,
                     row_bytes=row_bytes, num_scales=num_scales, num_topk=0, has_weights=False, x=_address(x),
                     x_scales=_address(x_scales),
                     topk_idx=0, topk_weights=0, is_token_in_node=_address(handle.is_token_in_node), send_pos=0,
                     recv_offsets=_address(handle.recv_offsets), capacity=F, recv_x=_address(fwd_x),
                     recv_x_scales=_address(fwd_scales), recv_topk_idx=0, recv_topk_weights=0, recv_src_idx=0,
                     stream=self._stream())
        node = handle.node
        if node is None:  # one rank per node: the forwarder rows are the received rows
            return fwd_x, fwd_scales
        rows = node.num_recv_rows
        recv_x = self._empty(rows, x.size(1), dtype=x.dtype)
        recv_scales = None if x_scales is None else self._empty(rows, num_scales, dtype=torch.float32)
        self._launch_dispatch(fwd_x, fwd_scales, None, None, node.send_pos, recv_x, recv_scales, None, None, None, 1,
                              node.num_worst_tokens, node.num_recv_device, config)
        if handle.perm is not None:
            recv_x, recv_scales = _take(recv_x, handle.perm), _take(recv_scales, handle.perm)
        return recv_x, recv_scales

    def _internode_combine(self, x, handle: "InternodeHandle", topk_weights, bias_0, bias_1, config: Config):
        self._check_sms(config)
        net = self._net
        C, B, S = self._handle_network_geometry(handle, config)
        T, F, H = handle.num_tokens, handle.num_forward_rows, x.size(1)
        K = 0 if topk_weights is None else topk_weights.size(1)
        if handle.inv_perm is not None:  # back to the intranode stage's row order
            x = _take(x, handle.inv_perm)
            topk_weights = _take(topk_weights, handle.inv_perm)
        node = handle.node
        if node is None:  # one rank per node: the rows are the forwarder rows' partial sums already
            partial_x = x.contiguous()
            partial_weights = None if topk_weights is None else topk_weights.float().contiguous()
        else:
            partial_x, partial_weights = self._node_combine(x, topk_weights, node, F, config)
        # Network leg: one row per (token, node) back to the source, summed there with the biases.
        slot_bytes = _C_nvshmem.internode_combine_slot_bytes(H, K)
        self._prepare_rings(_NET_COMBINE, (C, S, slot_bytes), after_notify=False)
        combined_x = self._empty(T, H, dtype=torch.bfloat16)
        combined_weights = None if topk_weights is None else self._empty(T, K, dtype=torch.float32)
        net.combine(num_channels=C, num_blocks=B, ring_slots=S,
                    send_chunk=config.num_max_rdma_chunked_send_tokens, slot_bytes=slot_bytes, hidden=H, num_topk=K,
                    capacity=F,
                    partial_x=_address(partial_x), partial_weights=_address(partial_weights),
                    recv_offsets=_address(handle.recv_offsets), num_tokens=T,
                    is_token_in_node=_address(handle.is_token_in_node), send_pos=_address(handle.send_pos),
                    send_counts=_address(handle.send_counts), bias_0=_address(bias_0), bias_1=_address(bias_1),
                    combined_x=_address(combined_x), combined_weights=_address(combined_weights),
                    stream=self._stream())
        return combined_x, combined_weights

    def _node_combine(self, x, topk_weights, node: NativeHandle, F: int, config: Config):
        """Intranode stage of combine: one partial row per forwarder row, reduced over the node's ranks."""
        H = x.size(1)
        K = 0 if topk_weights is None else topk_weights.size(1)
        partial_x = self._empty(F, H, dtype=torch.bfloat16)
        partial_weights = None if topk_weights is None else self._empty(F, K, dtype=torch.float32)
        self._intranode().combine(
            num_channels=config.num_channels, recv_tokens_per_channel=config.num_max_nvl_chunked_recv_tokens,
            send_chunk=config.num_max_nvl_chunked_send_tokens, num_tokens=F, hidden=H, num_topk=K, x=_address(x),
            topk_weights=_address(topk_weights), recv_src_idx=_address(node.recv_src_idx),
            recv_rank_offsets=_address(node.recv_rank_offsets), src_num_tokens=_address(node.src_num_tokens),
            send_pos=_address(node.send_pos), bias_0=0, bias_1=0, combined_x=_address(partial_x),
            combined_topk_weights=_address(partial_weights), stream=self._stream())
        return partial_x, partial_weights

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
                             return_recv_hook, topk_weights):
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
        # Expert-side sums where the weights come with the dispatch and every peer is on NVLink (the
        # same answer on every rank of one NVLink domain; a rank that disagrees gets a device error).
        expert_sums = topk_weights is not None and runtime.supports_expert_sums(
            num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank, hidden=H, num_experts=num_experts)
        # Fixed here, so that the dispatch announces it (ranks must agree) and its combine follows it.
        bf16_partials = expert_sums and self.settings.low_latency.expert_sums_partials == "bf16"

        def launch(phases: int) -> None:
            runtime.dispatch(parity=parity, phases=phases,
                             num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank, hidden=H,
                             num_experts=num_experts, x=_address(x), topk_idx=_address(topk_idx), num_tokens=T,
                             num_topk=K, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0,
                             recv_x=_address(data), recv_scales=_address(scales), recv_count=_address(recv_count),
                             recv_src_info=_address(recv_src_info), recv_layout=_address(recv_layout),
                             cumulative_local_expert_recv_stats=_address(cumulative_local_expert_recv_stats),
                             carry_route=expert_sums, bf16_partials=bf16_partials,
                             route_weights=_address(topk_weights) if expert_sums else 0,
                             stream=self._stream())

        self._launch_phases(launch, return_recv_hook)
        handle = LowLatencyHandle(owner=self, num_tokens=T, recv_shape=(num_local, num_slots, H), parity=parity,
                                  num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
                                  num_experts=num_experts, num_topk=K, recv_src_info=recv_src_info,
                                  recv_layout=recv_layout, expert_sums=expert_sums,
                                  bf16_partials=bf16_partials)
        hook = _receive_hook(lambda: launch(_C_nvshmem.PHASE_RECV)) if return_recv_hook else None
        return recv_x, recv_count, handle, hook

    def _launch_phases(self, launch: Callable[[int], None], return_recv_hook: bool) -> None:
        """Send only (the hook receives), send + receive in one launch, or as two when ranks share the GPU."""
        send, recv = _C_nvshmem.PHASE_SEND, _C_nvshmem.PHASE_RECV
        if return_recv_hook:
            launch(send)
        elif self._ll_split:
            launch(send)
            launch(recv)
        else:
            launch(send | recv)

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, zero_copy, return_recv_hook, out):
        runtime = self._low_latency()
        handle = self._low_latency_handle(handle)
        if tuple(topk_idx.shape) != (handle.num_tokens, handle.num_topk):
            raise ValueError(f"low_latency_combine: topk_idx has shape {tuple(topk_idx.shape)} but the dispatch's had "
                             f"{(handle.num_tokens, handle.num_topk)}")
        # NOTE: the staging tensor only when zero_copy (the caller filled it, so it exists): wrapping
        # the symmetric buffer asks CUDA for the pointer's device, which a graph capture need not allow.
        if zero_copy and x.data_ptr() != self.get_next_low_latency_combine_buffer(handle).data_ptr():
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
                            num_topk=K, out=_address(combined), expert_sums=handle.expert_sums,
                            bf16_partials=handle.bf16_partials,
                            stream=self._stream())

        self._launch_phases(launch, return_recv_hook)
        hook = _receive_hook(lambda: launch(_C_nvshmem.PHASE_RECV)) if return_recv_hook else None
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
        if self._net is not None:
            self._net.destroy(collective=collective)
        if self._ll is not None:
            self._ll.destroy(collective=collective)


def forwarder_source_nodes(recv_offsets: torch.Tensor, num_rows: int, num_channels: int,
                           num_nodes: int) -> torch.Tensor:
    """int32 [num_rows]: the source node of each forwarder row.

    recv_offsets: int32 [N * C + 1], first forwarder row of (source node, channel), source-major.
    Rows past the received count get the last node (they are padding and never forwarded).
    """
    node_starts = recv_offsets[0:num_nodes * num_channels:num_channels].contiguous()
    rows = torch.arange(num_rows, dtype=recv_offsets.dtype, device=recv_offsets.device)
    return (torch.searchsorted(node_starts, rows, right=True) - 1).to(torch.int32)


def source_order(final_src_node: torch.Tensor, recv_rank_offsets: torch.Tensor, num_recv: torch.Tensor,
                 ranks_per_node: int, num_ranks: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(perm, inv_perm), int64 [rows]: final row i is intranode-stage row perm[i].

    The intranode stage yields rows by forwarder (its local rank l, blocks at recv_rank_offsets
    [L + 1]), then by the forwarder's row order (source node m, then source token). The reference
    order is by source rank m * L + l, then source token: a stable sort by that key. Rows at or
    past num_recv ([1] int32, on the device) are padding and stay last.
    """
    rows = final_src_node.size(0)
    device = final_src_node.device
    index = torch.arange(rows, dtype=torch.int64, device=device)
    forwarder = torch.searchsorted(recv_rank_offsets[1:].contiguous(), index.to(recv_rank_offsets.dtype),
                                   right=True).to(torch.int64)
    key = final_src_node.to(torch.int64) * ranks_per_node + forwarder
    key = torch.where(index < num_recv.to(torch.int64), key, torch.full_like(key, num_ranks))
    perm = torch.sort(key, stable=True).indices
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = index
    return perm, inv_perm


def _ranks_on_this_gpu(info: GroupInfo) -> int:
    """Ranks of the group (this one included) that run on this rank's GPU (several only under CUDA MPS)."""
    props = torch.cuda.get_device_properties(info.device)
    key = str(getattr(props, "uuid", "") or "") or f"{os.uname().nodename}:{info.device.index}"
    keys: List[Optional[str]] = [None] * info.num_ranks
    dist.all_gather_object(keys, key, group=info.group)
    return keys.count(key)


def _local_experts(num_experts: int, num_ranks: int) -> int:
    """Experts per rank, within what the intranode kernels hold."""
    num_local_experts = num_experts // num_ranks
    if num_local_experts > _C.MAX_LOCAL_EXPERTS:
        raise ValueError(f"{num_local_experts} experts per rank; the native kernels take at most "
                         f"{_C.MAX_LOCAL_EXPERTS}")
    return num_local_experts


def _take(tensor: Optional[torch.Tensor], index: torch.Tensor) -> Optional[torch.Tensor]:
    """tensor[index] along dim 0 for any dtype (FP8 through its bytes); None stays None."""
    if tensor is None:
        return None
    if tensor.element_size() == 1 and tensor.dtype != torch.uint8:
        return tensor.view(torch.uint8)[index].view(tensor.dtype)
    return tensor[index]


def _receive_hook(receive: Callable[[], None]) -> Callable[[], None]:
    """A receive hook: the first call launches the receive on the current stream, later calls do nothing."""
    state = {"done": False}

    def hook() -> None:
        if not state["done"]:
            state["done"] = True
            receive()

    return hook
