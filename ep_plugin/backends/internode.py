"""Internode normal mode: the network leg over NVSHMEM (`_C_nvshmem.InternodeRuntime`) and the
forwarding through the intranode stage (docs/internode.md).

A dispatch sends each token once per destination node to the rank with the same local index there
(the forwarder), then the intranode kernels (`_C.IntranodeRuntime` over the node's ranks) forward it
over NVLink. Combine runs the stages in reverse."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..tuning import INTERNODE_MAX_CHANNELS, Config, default_combine_config, default_dispatch_config
from .base import GroupInfo
from .intranode import IntranodeMode, NativeHandle
from .native_common import NVSHMEM_IMPORT_ERROR, _C, _C_nvshmem, address_of, local_experts, logger

if TYPE_CHECKING:
    from .native import NativeBackend

# Whether `backend: auto` picks the native internode kernels. They pass tests/test_native_internode.py
# on 2 emulated nodes of 1 GPU (2x H200), but the 2x2 emulation has not run (4 GPUs) and on the
# emulated nodes they are slower than the reference backend (docs/performance.md), so `auto` keeps the
# reference across nodes; `backend: native` selects them.
INTERNODE_BY_DEFAULT = False


def internode_unsupported_reason(info: GroupInfo, num_nvl_bytes: int, requested: str) -> str:
    if _C_nvshmem is None:
        return f"the NVSHMEM extension ep_plugin._C_nvshmem is not built ({NVSHMEM_IMPORT_ERROR})"
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


def _take(tensor: Optional[torch.Tensor], index: torch.Tensor) -> Optional[torch.Tensor]:
    """tensor[index] along dim 0 for any dtype (FP8 through its bytes); None stays None."""
    if tensor is None:
        return None
    if tensor.element_size() == 1 and tensor.dtype != torch.uint8:
        return tensor.view(torch.uint8)[index].view(tensor.dtype)
    return tensor[index]


def _ring_args(args, geometry: Tuple[int, int, int, int], config: Config):
    """`args` (a network-leg Args struct) with its ring geometry: (channels, blocks, slots per ring, slot
    bytes), and the config's send chunk."""
    args.num_channels, args.num_blocks, args.ring_slots, args.slot_bytes = geometry
    args.send_chunk = config.num_max_rdma_chunked_send_tokens
    return args


class InternodeMode(IntranodeMode):
    """NativeBackend's normal mode across nodes: the network leg, then the intranode stage."""

    def _start_node_runtime(self, num_nvl_bytes: int):
        """The intranode runtime over this rank's node (local rank, ranks_per_node ranks)."""
        L = self.info.ranks_per_node
        node, local = divmod(self.info.rank, L)
        runtime = _C.IntranodeRuntime(local, L, num_nvl_bytes, self.settings.timeout_s)  # no direct dispatch
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
                                              num_rdma_bytes, self.settings.timeout_s, unique_id,
                                              self.settings.network.force_puts)
        direct = runtime.direct_peers()
        logger.info("ep_plugin rank %d: internode mode, %d nodes x %d ranks; symmetric buffer of %d bytes; PEs over "
                    "NVLink: %s, over the network: %s", self.info.rank, self.info.num_nodes,
                    self.info.ranks_per_node, num_rdma_bytes, [r for r, d in enumerate(direct) if d],
                    [r for r, d in enumerate(direct) if not d])
        return runtime

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
        x_scales = None if x_scales is None else x_scales.contiguous()  # the network leg reads rows of scales
        net = self._net
        R, L, N = self.info.num_ranks, self.info.ranks_per_node, self.info.num_nodes
        T, K = topk_idx.shape
        num_experts = num_tokens_per_expert.size(0)
        num_local_experts = local_experts(num_experts, R)
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
        notify = _C_nvshmem.InternodeNotifyArgs()
        notify.num_channels, notify.num_tokens, notify.is_token_in_node = C, T, address_of(is_token_in_node)
        notify.row_bytes, notify.num_scales, notify.num_topk, notify.has_weights = row_bytes, num_scales, K, has_weights
        notify.send_counts, notify.recv_offsets = address_of(send_counts), address_of(recv_offsets)
        notify.num_recv, notify.capacity, notify.host_tag = address_of(num_forward_device), capacity, tag
        net.notify(notify, stream)
        F = capacity if graph else net.wait_notify(tag=tag, stream=stream)

        # Network leg, data: one row per (token, destination node) into the forwarders' rows.
        fwd_x = self._empty(F, x.size(1), dtype=x.dtype)
        fwd_scales = None if x_scales is None else self._empty(F, num_scales, dtype=x_scales.dtype)
        fwd_topk = self._empty(F, K, dtype=torch.int64)
        fwd_weights = None if topk_weights is None else self._empty(F, K, dtype=torch.float32)
        send_pos = self._empty(T, N, dtype=torch.int32)
        slot_bytes = _C_nvshmem.internode_dispatch_slot_bytes(row_bytes, num_scales, K, has_weights)
        self._prepare_rings(_NET_DISPATCH, (C, S, slot_bytes), after_notify=True)
        args = _ring_args(_C_nvshmem.InternodeDispatchArgs(), (C, B, S, slot_bytes), config)
        args.num_tokens, args.row_bytes, args.num_scales = T, row_bytes, num_scales
        args.num_topk, args.has_weights = K, has_weights
        args.x, args.x_scales = address_of(x), address_of(x_scales)
        args.topk_idx, args.topk_weights = address_of(topk_idx), address_of(topk_weights)
        args.is_token_in_node, args.send_pos = address_of(is_token_in_node), address_of(send_pos)
        args.recv_offsets, args.capacity = address_of(recv_offsets), F
        args.recv_x, args.recv_x_scales = address_of(fwd_x), address_of(fwd_scales)
        args.recv_topk_idx, args.recv_topk_weights = address_of(fwd_topk), address_of(fwd_weights)
        net.dispatch(args, stream)

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
        node_per_expert = self._empty(node_experts, dtype=torch.int32)
        node_in_rank = self._empty(F, L, dtype=torch.bool)
        _C.get_dispatch_layout(address_of(node_topk), F, K, node_experts, L, L, 0, 0, address_of(node_per_expert),
                               address_of(node_in_rank), stream)  # no per-rank or per-node counts
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
        self._launch_dispatch(tag_bf16, None, None, None, node.notify, recv_tag, None, None, None, None, 1,
                              node.num_worst_tokens, config)
        final_src_node = recv_tag.view(torch.int32)[:, 0]
        return source_order(final_src_node, node.recv_rank_offsets, node.num_recv_device, self.info.ranks_per_node,
                            self.info.num_ranks)

    def _internode_cached_dispatch(self, x, x_scales, handle: "InternodeHandle", config: Config):
        self._check_sms(config)
        x_scales = None if x_scales is None else x_scales.contiguous()  # the network leg reads rows of scales
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
        fwd_scales = None if x_scales is None else self._empty(F, num_scales, dtype=x_scales.dtype)
        args = _ring_args(_C_nvshmem.InternodeDispatchArgs(), (C, B, S, slot_bytes), config)
        args.num_tokens, args.row_bytes, args.num_scales = T, row_bytes, num_scales  # no top-k: cached
        args.x, args.x_scales = address_of(x), address_of(x_scales)
        args.is_token_in_node = address_of(handle.is_token_in_node)
        args.recv_offsets, args.capacity = address_of(handle.recv_offsets), F
        args.recv_x, args.recv_x_scales = address_of(fwd_x), address_of(fwd_scales)
        net.dispatch(args, self._stream())
        node = handle.node
        if node is None:  # one rank per node: the forwarder rows are the received rows
            return fwd_x, fwd_scales
        rows = node.num_recv_rows
        recv_x = self._empty(rows, x.size(1), dtype=x.dtype)
        recv_scales = None if x_scales is None else self._empty(rows, num_scales, dtype=x_scales.dtype)
        self._launch_dispatch(fwd_x, fwd_scales, None, None, node.notify, recv_x, recv_scales, None, None, None, 1,
                              node.num_worst_tokens, config)
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
        args = _ring_args(_C_nvshmem.InternodeCombineArgs(), (C, B, S, slot_bytes), config)
        args.hidden, args.num_topk, args.capacity, args.num_tokens = H, K, F, T
        args.partial_x, args.partial_weights = address_of(partial_x), address_of(partial_weights)
        args.recv_offsets, args.is_token_in_node = address_of(handle.recv_offsets), address_of(handle.is_token_in_node)
        args.send_pos, args.send_counts = address_of(handle.send_pos), address_of(handle.send_counts)
        args.bias_0, args.bias_1 = address_of(bias_0), address_of(bias_1)
        args.combined_x, args.combined_topk_weights = address_of(combined_x), address_of(combined_weights)
        net.combine(args, self._stream())
        return combined_x, combined_weights

    def _node_combine(self, x, topk_weights, node: NativeHandle, F: int, config: Config):
        """Intranode stage of combine: one partial row per forwarder row, reduced over the node's ranks."""
        H = x.size(1)
        K = 0 if topk_weights is None else topk_weights.size(1)
        partial_x = self._empty(F, H, dtype=torch.bfloat16)
        partial_weights = None if topk_weights is None else self._empty(F, K, dtype=torch.float32)
        self._sm_combine(x, topk_weights, node, None, None, partial_x, partial_weights, config)
        return partial_x, partial_weights
