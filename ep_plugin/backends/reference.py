"""The `reference` backend: every operation in plain PyTorch over torch.distributed.

It is the executable definition of the semantics in `Buffer`'s docstrings, the oracle the native
kernels are tested against, and the baseline of the benchmarks. Simple and vectorised (no Python
loops over tokens), deterministic (sums run in a fixed order), never fast.

Transport: each operation packs its rows (payload and metadata side by side as bytes) and moves
them with one `all_to_all_single` on the group; dispatches first exchange counts with a small
all-to-all and read them on the host. When the group's backend cannot move tensors of the data's
device (a gloo group with CUDA tensors, as vLLM passes), the rows are staged through host memory.

Expert ids outside [-1, num_experts) (which Buffer rejects unless `check_inputs` is off) are
treated as -1, never as an index.

Errors that only the exchanged counts reveal (inconsistent layouts, `num_worst_tokens` too small)
are raised on every rank, so no rank is left waiting in a collective.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .. import fp8, masking
from ..tuning import Config
from .base import Backend, DispatchOutput, DispatchRoute, LowLatencyDispatchOutput
from .waits import honours_timeouts

# Devices that each torch.distributed backend can move tensors of (all_to_all_single).
_BACKEND_DEVICES: Dict[str, Tuple[str, ...]] = {"nccl": ("cuda",), "gloo": ("cpu",), "mpi": ("cpu",),
                                                "ucc": ("cpu", "cuda")}

# Error bits that a rank reports with its counts in normal-mode dispatch.
_ERR_TOKENS_PER_RANK = 1
_ERR_TOKENS_PER_EXPERT = 2


# ---- handles -------------------------------------------------------------------------------------
@dataclass(eq=False)
class DispatchHandle:
    """Layout of one normal-mode dispatch, for `combine` and cached dispatch.

    Sent rows are grouped by destination rank, by token index within a destination; received rows
    by source rank, by source token index within a source (then `num_recv_rows - num_recv_tokens`
    padding rows).
    """
    owner: "ReferenceBackend"
    num_tokens: int                  # T: tokens this rank dispatched
    is_token_in_rank: torch.Tensor   # [T, R] bool
    send_token_idx: torch.Tensor     # [sum(send_counts)] int64: the token of each sent row
    send_counts: List[int]           # [R] rows sent to each rank
    recv_counts: List[int]           # [R] rows received from each rank
    recv_src_idx: torch.Tensor       # [num_recv_rows] int32: source token index of each received row (-1: padding)
    num_recv_tokens: int             # received rows
    num_recv_rows: int               # rows of recv_x: received rows, or num_worst_tokens
    rank_count_matrix: List[List[int]]  # [R][R]: rows rank j receives from rank s, at [s][j]


@dataclass(eq=False)
class LowLatencyHandle:
    """Layout of one low-latency dispatch, for `low_latency_combine`.

    One message per routed (token, k) entry; sent in (destination rank, token, k) order, received
    grouped by source rank in the sender's order.
    """
    owner: "ReferenceBackend"
    num_tokens: int                  # T of the dispatch
    recv_shape: Tuple[int, int, int]  # (E_local, R * T_max, H)
    num_max_dispatch_tokens_per_rank: int
    num_experts: int
    topk_idx: torch.Tensor           # [T, K] int64, a copy of the dispatch's ids
    send_token: torch.Tensor         # [M] int64: token of each sent message
    send_k: torch.Tensor             # [M] int64: top-k position of each sent message
    send_counts: List[int]           # [R] messages sent to each rank
    recv_counts: List[int]           # [R] messages received from each rank
    recv_expert: torch.Tensor        # [N] int64: local expert of each kept received message
    recv_slot: torch.Tensor          # [N] int64: its slot in that expert's rows
    recv_src_token: torch.Tensor     # [E_local, R * T_max] int32: source token index of each slot (-1: empty)
    recv_layout: torch.Tensor        # [E_local, R] int64: first slot << 32 | count, per source rank
    combine_buffer: Optional[torch.Tensor] = field(default=None)
    dispatch_route: Optional[DispatchRoute] = field(default=None)  # set by the Buffer


def _receive_complete() -> None:
    """Receive hook: the reference backend has already received everything (idempotent no-op)."""


# ---- row packing -----------------------------------------------------------------------------------
def _row_numel(tensor: torch.Tensor) -> int:
    """Elements per row of an [N, ...] tensor."""
    numel = 1
    for size in tensor.shape[1:]:
        numel *= size
    return numel


def _dense(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` with row-major strides (a copy only if needed).

    NOTE: not `.contiguous()`, which keeps the odd strides of size-0 and size-1 dimensions that
    `.view(dtype)` then rejects.
    """
    stride, expected = 1, []
    for size in reversed(tensor.shape):
        expected.append(stride)
        stride *= size
    if tuple(reversed(expected)) == tensor.stride():
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def _as_byte_rows(tensor: torch.Tensor) -> torch.Tensor:
    """[N, ...] tensor of any dtype -> [N, row bytes] uint8 (a view where possible)."""
    return _dense(tensor.reshape(tensor.size(0), _row_numel(tensor))).view(torch.uint8)


def _take_rows(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """tensor[index] along dim 0 for any dtype (FP8 is indexed through its bytes)."""
    if tensor.element_size() == 1 and tensor.dtype != torch.uint8:
        return tensor.view(torch.uint8)[index].view(tensor.dtype)
    return tensor[index]


class _RowLayout:
    """Fields of one row laid side by side as bytes: pack [N, ...] tensors into [N, row_bytes] uint8."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.fields = [(t.dtype, tuple(t.shape[1:]), _row_numel(t) * t.element_size()) for t in tensors]
        self.row_bytes = sum(nbytes for _, _, nbytes in self.fields)

    def pack(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat([_as_byte_rows(t) for t in tensors], dim=1)

    def unpack(self, rows: torch.Tensor) -> List[torch.Tensor]:
        out, offset = [], 0
        for dtype, tail, nbytes in self.fields:
            part = _dense(rows[:, offset:offset + nbytes]).view(dtype)
            out.append(part.reshape(rows.size(0), *tail))
            offset += nbytes
        return out


def _pad_rows(rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Append zero rows up to `num_rows`."""
    if rows.size(0) == num_rows:
        return rows
    padded = rows.new_zeros((num_rows, *rows.shape[1:]))
    padded[:rows.size(0)] = rows
    return padded


def _count_ids(ids: torch.Tensor, n: int) -> torch.Tensor:
    """int64 [n]: how many entries of `ids` equal each of 0..n-1 (other values, e.g. -1, ignored)."""
    flat = ids.reshape(-1)
    bucket = torch.where((flat >= 0) & (flat < n), flat, n)
    counts = torch.zeros(n + 1, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    return counts[:n]


def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, ranks_per_node: int
                    ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """`Backend.get_dispatch_layout` of a group of `num_ranks` ranks, `ranks_per_node` to a node (a pure
    function: the oracle of the native layout kernel's tests too). topk_idx: [T, K] int64; ids outside
    [0, num_experts) are not routed. Returns num_tokens_per_rank [R] int32, num_tokens_per_rdma_rank
    [nodes] int32 (None in one node), num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool."""
    num_local_experts = num_experts // num_ranks
    num_tokens = topk_idx.size(0)
    routed = (topk_idx >= 0) & (topk_idx < num_experts)
    # Column num_ranks collects the entries that go nowhere.
    dest_rank = torch.where(routed, topk_idx // num_local_experts, num_ranks)
    hits = torch.zeros((num_tokens, num_ranks + 1), dtype=torch.bool, device=topk_idx.device)
    hits.scatter_(1, dest_rank, True)
    is_token_in_rank = hits[:, :num_ranks].contiguous()
    num_tokens_per_rank = is_token_in_rank.sum(dim=0, dtype=torch.int32)
    num_tokens_per_rdma_rank = None
    num_nodes = num_ranks // ranks_per_node
    if num_nodes > 1:
        in_node = is_token_in_rank.view(num_tokens, num_nodes, ranks_per_node).any(dim=2)
        num_tokens_per_rdma_rank = in_node.sum(dim=0, dtype=torch.int32)
    num_tokens_per_expert = _count_ids(topk_idx, num_experts).to(torch.int32)
    return num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank


# ---- the backend -----------------------------------------------------------------------------------
@honours_timeouts
class ReferenceBackend(Backend):
    """Dispatch and combine with torch ops and `all_to_all_single`; see the module docstring."""

    name = "reference"
    rank_mask: Optional[masking.RankMask] = None  # set by a Buffer with enable_shrink (ep_plugin/masking.py)

    # ---- transport ------------------------------------------------------------------------------
    def _comm_device(self, device: torch.device) -> torch.device:
        """Where tensors must be for the group's backend: `device` if it can move them, else the host."""
        backend = str(dist.get_backend(self.info.group)).lower()
        supported = set()
        for part in backend.split(","):
            device_type, _, name = part.strip().rpartition(":")
            if device_type:  # "cpu:gloo,cuda:nccl"
                supported.add(device_type)
            else:
                supported.update(_BACKEND_DEVICES.get(name, (device.type,)))
        if device.type in supported:
            return device
        if "cpu" in supported:
            return torch.device("cpu")
        if "cuda" in supported and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        raise RuntimeError(f"the process group's backend '{backend}' cannot move tensors of {device}")

    def _all_to_all(self, send: torch.Tensor, send_counts: List[int], recv_counts: List[int],
                    step: str = "rows", masked: bool = False) -> torch.Tensor:
        """Rows of `send` (grouped by destination, `send_counts[r]` for rank r) -> the rows received
        (grouped by source, `recv_counts[r]` from rank r), as bytes on the wire, on `send`'s device.
        `masked` (low-latency calls): with a RankMask, masked ranks' rows are not moved (zeros)."""
        device, dtype, tail = send.device, send.dtype, tuple(send.shape[1:])
        comm_device = self._comm_device(device)
        send_bytes = _as_byte_rows(send).to(comm_device)
        exchange = masking.exchange_for(self) if masked else None
        if exchange is not None:
            recv_bytes = exchange.all_to_all(send_bytes, send_counts, recv_counts)
        else:
            recv_bytes = torch.empty((sum(recv_counts), send_bytes.size(1)), dtype=torch.uint8, device=comm_device)
            self.waits.all_to_all_single(recv_bytes, send_bytes, recv_counts, send_counts, step)
        return recv_bytes.to(device).view(dtype).reshape(recv_bytes.size(0), *tail)

    def _exchange_meta(self, per_destination: List[List[int]], device: torch.device,
                       masked_row: Optional[List[int]] = None) -> List[List[int]]:
        """Send `per_destination[r]` (ints, same length for every r) to rank r; returns what each rank sent here.
        `masked_row` (low-latency calls): with a RankMask, what a masked rank counts as having sent."""
        send = torch.tensor(per_destination, dtype=torch.int64, device=device)
        ones = [1] * self.info.num_ranks
        meta = self._all_to_all(send, ones, ones, "counts", masked=masked_row is not None).tolist()
        return masking.with_masked_rows(self, meta, masked_row)

    # ---- normal mode ----------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int
                            ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
        return dispatch_layout(topk_idx, num_experts, self.info.num_ranks, self.info.ranks_per_node)

    def dispatch(self, x: torch.Tensor, x_scales: Optional[torch.Tensor],
                 topk_idx: Optional[torch.Tensor], topk_weights: Optional[torch.Tensor],
                 num_tokens_per_rank: torch.Tensor, is_token_in_rank: torch.Tensor,
                 num_tokens_per_expert: torch.Tensor, expert_alignment: int, num_worst_tokens: int,
                 config: Config) -> DispatchOutput:
        rank, num_ranks = self.info.rank, self.info.num_ranks
        device = x.device
        num_tokens = x.size(0)
        num_experts = num_tokens_per_expert.size(0)
        num_local_experts = num_experts // num_ranks

        # Rows to send: grouped by destination rank, by token index within a destination.
        _, send_token_idx = is_token_in_rank.t().nonzero(as_tuple=True)
        send_counts = is_token_in_rank.sum(dim=0).tolist()
        error = 0
        if send_counts != num_tokens_per_rank.tolist():
            error |= _ERR_TOKENS_PER_RANK
        if topk_idx is not None and not torch.equal(_count_ids(topk_idx, num_experts).to(torch.int32),
                                                    num_tokens_per_expert):
            error |= _ERR_TOKENS_PER_EXPERT

        token_idx = torch.arange(num_tokens, dtype=torch.int32, device=device).unsqueeze(1)
        fields = [x] + ([x_scales] if x_scales is not None else []) + \
            ([topk_idx] if topk_idx is not None else []) + \
            ([topk_weights] if topk_weights is not None else []) + [token_idx]
        layout = _RowLayout(fields)

        # Every rank learns every rank's counts, limit and verdict, so all of them fail together; and
        # the tokens it sends to each of the destination's experts (num_recv_tokens_per_expert_list).
        base = send_counts + [num_worst_tokens, layout.row_bytes, error]
        per_expert_sent = num_tokens_per_expert.view(num_ranks, num_local_experts).tolist()
        meta = self._exchange_meta([base + per_expert_sent[dst] for dst in range(num_ranks)], device)
        self._check_dispatch_meta(meta)
        recv_counts = [meta[src][rank] for src in range(num_ranks)]
        num_recv_tokens = sum(recv_counts)
        num_recv_rows = num_worst_tokens if num_worst_tokens > 0 else num_recv_tokens

        packed = layout.pack(fields)
        received = self._all_to_all(packed[send_token_idx], send_counts, recv_counts)
        unpacked = layout.unpack(_pad_rows(received, num_recv_rows))
        recv_x = unpacked.pop(0)
        recv_x_scales = unpacked.pop(0) if x_scales is not None else None
        recv_global_idx = unpacked.pop(0) if topk_idx is not None else None
        recv_weights = unpacked.pop(0) if topk_weights is not None else None
        recv_src_idx = unpacked.pop(0).reshape(-1)
        recv_src_idx[num_recv_tokens:] = -1

        recv_topk_idx = recv_topk_weights = None
        if recv_global_idx is not None:
            # Keep this rank's experts as local ids; padding rows route nowhere.
            local_idx = recv_global_idx - rank * num_local_experts
            is_real = (torch.arange(num_recv_rows, dtype=torch.int64, device=device) < num_recv_tokens).unsqueeze(1)
            is_local = is_real & (recv_global_idx >= 0) & (local_idx >= 0) & (local_idx < num_local_experts)
            recv_topk_idx = torch.where(is_local, local_idx, -1)
            if recv_weights is not None:
                recv_topk_weights = torch.where(is_local, recv_weights, torch.zeros_like(recv_weights))

        per_expert: List[int] = []
        if num_worst_tokens == 0:
            first = num_ranks + 3
            for e in range(num_local_experts):
                count = sum(row[first + e] for row in meta)
                per_expert.append((count + expert_alignment - 1) // expert_alignment * expert_alignment)

        handle = DispatchHandle(owner=self, num_tokens=num_tokens, is_token_in_rank=is_token_in_rank,
                                send_token_idx=send_token_idx, send_counts=send_counts, recv_counts=recv_counts,
                                recv_src_idx=recv_src_idx, num_recv_tokens=num_recv_tokens,
                                num_recv_rows=num_recv_rows,
                                rank_count_matrix=[row[:num_ranks] for row in meta])
        return recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, per_expert, handle

    def _check_dispatch_meta(self, meta: List[List[int]]) -> None:
        """meta[s] = rank s's [send counts..., num_worst_tokens, row bytes, error bits]; raise on every rank."""
        num_ranks = self.info.num_ranks
        problems = []
        for src, row in enumerate(meta):
            if row[num_ranks + 2] & _ERR_TOKENS_PER_RANK:
                problems.append(f"rank {src}: num_tokens_per_rank does not match is_token_in_rank "
                                "(pass the outputs of one get_dispatch_layout call)")
            if row[num_ranks + 2] & _ERR_TOKENS_PER_EXPERT:
                problems.append(f"rank {src}: num_tokens_per_expert does not match topk_idx "
                                "(pass the outputs of one get_dispatch_layout call)")
        row_bytes = [row[num_ranks + 1] for row in meta]
        if len(set(row_bytes)) != 1:
            problems.append("ranks disagree on the row layout (x, x_scales, topk_idx and topk_weights must have the "
                            f"same widths, dtypes and presence on every rank): bytes per row by rank {row_bytes}")
        if problems:
            raise ValueError("dispatch rejected on every rank: " + "; ".join(problems))
        overflows = []
        for dst in range(num_ranks):
            received = sum(row[dst] for row in meta)
            limit = meta[dst][num_ranks]
            if 0 < limit < received:
                overflows.append(f"rank {dst} receives {received} tokens but num_worst_tokens = {limit}")
        if overflows:
            raise RuntimeError("dispatch failed on every rank: " + "; ".join(overflows))

    def cached_dispatch(self, x: torch.Tensor, x_scales: Optional[torch.Tensor], handle: object,
                        config: Config) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        handle = self._normal_handle(handle)
        fields = [x] + ([x_scales] if x_scales is not None else [])
        layout = _RowLayout(fields)
        received = self._all_to_all(layout.pack(fields)[handle.send_token_idx], handle.send_counts,
                                    handle.recv_counts)
        unpacked = layout.unpack(_pad_rows(received, handle.num_recv_rows))
        return unpacked[0], (unpacked[1] if x_scales is not None else None)

    def combine(self, x: torch.Tensor, handle: object, topk_weights: Optional[torch.Tensor],
                bias_0: Optional[torch.Tensor], bias_1: Optional[torch.Tensor],
                config: Config) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        handle = self._normal_handle(handle)
        num_real = handle.num_recv_tokens
        # Send every real (non-padding) row back to where it came from; rows return in send order.
        fields = [x[:num_real]] + ([topk_weights[:num_real]] if topk_weights is not None else [])
        layout = _RowLayout(fields)
        returned = layout.unpack(self._all_to_all(layout.pack(fields), handle.recv_counts, handle.send_counts))
        combined = self._sum_copies(returned[0].float(), handle)
        for bias in (bias_0, bias_1):
            if bias is not None:
                combined = combined + bias.float()
        combined_weights = self._sum_copies(returned[1], handle) if topk_weights is not None else None
        return combined.to(torch.bfloat16), combined_weights

    def _sum_copies(self, rows: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """fp32 [T, ...]: per token, the sum of its returned rows, added rank by rank (rank 0 first)."""
        total = torch.zeros((handle.num_tokens, *rows.shape[1:]), dtype=torch.float32, device=rows.device)
        start = 0
        for count in handle.send_counts:
            # A token goes at most once to each rank: the indices of one rank's rows are distinct.
            total.index_add_(0, handle.send_token_idx[start:start + count], rows[start:start + count].float())
            start += count
        return total

    def _normal_handle(self, handle: object) -> DispatchHandle:
        if not isinstance(handle, DispatchHandle):
            raise ValueError(f"expected a handle from (normal-mode) dispatch, got {type(handle).__name__}")
        return handle

    def handle_num_recv_rows(self, handle: object) -> int:
        return self._normal_handle(handle).num_recv_rows

    def handle_num_tokens(self, handle: object) -> int:
        return self._normal_handle(handle).num_tokens

    # ---- low-latency mode -----------------------------------------------------------------------
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: Optional[torch.Tensor],
                             use_fp8: bool, round_scale: bool, use_ue8m0: bool,
                             return_recv_hook: bool, topk_weights: Optional[torch.Tensor]) -> LowLatencyDispatchOutput:
        # topk_weights: the reference always sums on the token side, with the combine's weights (the
        # Buffer checks that they are the dispatch's).
        rank, num_ranks = self.info.rank, self.info.num_ranks
        device = x.device
        num_tokens, hidden = x.shape
        top_k = topk_idx.size(1)
        num_local_experts = num_experts // num_ranks
        num_slots = num_ranks * num_max_dispatch_tokens_per_rank

        # One message per routed (token, k), ordered by (destination rank, token, k).
        routed = (topk_idx >= 0) & (topk_idx < num_experts) & ~masking.masked_entries(self, topk_idx, num_experts)
        token, k = routed.nonzero(as_tuple=True)
        expert = topk_idx[token, k]
        dest = expert // num_local_experts
        order = torch.argsort(dest * (num_tokens * top_k) + token * top_k + k)
        token, k, expert, dest = token[order], k[order], expert[order], dest[order]
        send_counts = _count_ids(dest, num_ranks).tolist()

        if use_fp8:
            data, scales = fp8.quantize(x, round_scale, use_ue8m0)
            payload = [_take_rows(data, token), scales[token]]
        else:
            payload = [x[token]]
        local_expert = (expert - dest * num_local_experts).unsqueeze(1)
        fields = payload + [token.unsqueeze(1), local_expert]
        layout = _RowLayout(fields)

        flags = int(use_fp8) | int(round_scale) << 1 | int(use_ue8m0) << 2
        params = [layout.row_bytes, num_max_dispatch_tokens_per_rank, num_experts, flags]
        meta = self._exchange_meta([[count] + params for count in send_counts], device, masked_row=[0] + params)
        if any(row[1:] != params for row in meta):
            by_rank = {src: dict(zip(("row_bytes", "T_max", "num_experts", "fp8_flags"), row[1:]))
                       for src, row in enumerate(meta)}
            raise ValueError("low_latency_dispatch rejected on every rank: ranks disagree on hidden, "
                             f"num_max_dispatch_tokens_per_rank, num_experts or FP8 options: {by_rank}")
        recv_counts = [row[0] for row in meta]

        received = self._all_to_all(layout.pack(fields), send_counts, recv_counts, masked=True)
        received, recv_counts = masking.without_lost_sources(self, received, recv_counts)
        received = layout.unpack(received)
        recv_src = torch.repeat_interleave(torch.arange(num_ranks, dtype=torch.int64, device=device),
                                           torch.tensor(recv_counts, dtype=torch.int64, device=device))
        recv_expert = received[-1].reshape(-1)
        num_recv = recv_expert.size(0)

        # Slot of a message: its position among its expert's messages in arrival order (source rank,
        # then token, then k).
        recv_count = _count_ids(recv_expert, num_local_experts)
        by_expert = torch.argsort(recv_expert * max(num_recv, 1) + torch.arange(num_recv, dtype=torch.int64, device=device))
        first_slot = torch.cumsum(recv_count, 0) - recv_count
        recv_slot = torch.empty_like(recv_expert)
        recv_slot[by_expert] = torch.arange(num_recv, dtype=torch.int64, device=device) - first_slot[recv_expert[by_expert]]
        most = int(recv_count.max())
        if most > num_slots:
            raise RuntimeError(f"low_latency_dispatch on rank {rank}: a local expert receives {most} tokens, more "
                               f"than its {num_slots} slots (num_ranks * T_max); does a token select one "
                               "expert twice?")

        shape = (num_local_experts, num_slots, hidden)
        if use_fp8:
            recv_bytes = torch.zeros(shape, dtype=torch.uint8, device=device)
            recv_bytes[recv_expert, recv_slot] = received[0].view(torch.uint8)
            recv_scales_rows = received[1]
            # Column-major in the last two dimensions: allocate [E_local, S, slots], view transposed.
            recv_scales = torch.zeros((num_local_experts, recv_scales_rows.size(1), num_slots),
                                      dtype=recv_scales_rows.dtype, device=device).transpose(1, 2)
            recv_scales[recv_expert, recv_slot] = recv_scales_rows
            recv_x = (recv_bytes.view(fp8.FP8_DTYPE), recv_scales)
        else:
            recv_x = torch.zeros(shape, dtype=torch.bfloat16, device=device)
            recv_x[recv_expert, recv_slot] = received[0]
        recv_src_token = torch.full((num_local_experts, num_slots), -1, dtype=torch.int32, device=device)
        recv_src_token[recv_expert, recv_slot] = received[-2].reshape(-1).to(torch.int32)
        recv_layout = self._slot_ranges(recv_expert, recv_src, num_local_experts)
        recv_count = recv_count.to(torch.int32)
        if cumulative_local_expert_recv_stats is not None:
            cumulative_local_expert_recv_stats.add_(recv_count)

        handle = LowLatencyHandle(owner=self, num_tokens=num_tokens, recv_shape=shape,
                                  num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
                                  num_experts=num_experts, topk_idx=topk_idx.clone(), send_token=token,
                                  send_k=k, send_counts=send_counts, recv_counts=recv_counts,
                                  recv_expert=recv_expert, recv_slot=recv_slot, recv_src_token=recv_src_token,
                                  recv_layout=recv_layout)
        return recv_x, recv_count, handle, (_receive_complete if return_recv_hook else None)

    def _slot_ranges(self, recv_expert: torch.Tensor, recv_src: torch.Tensor, num_local_experts: int) -> torch.Tensor:
        """[E_local, R] int64: first slot << 32 | count of each source rank's messages per local expert
        (slots are by source rank, so each source's are contiguous)."""
        num_ranks = self.info.num_ranks
        pair = recv_expert * num_ranks + recv_src
        counts = _count_ids(pair, num_local_experts * num_ranks).view(num_local_experts, num_ranks)
        first = torch.cumsum(counts, dim=1) - counts
        return torch.bitwise_left_shift(first, 32) | counts

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: object, zero_copy: bool, return_recv_hook: bool,
                            out: Optional[torch.Tensor]) -> Tuple[torch.Tensor, Optional[Callable[[], None]]]:
        handle = self._low_latency_handle(handle)
        if zero_copy:  # the caller wrote the expert outputs into the combine buffer; x's data is not read
            x = self.get_next_low_latency_combine_buffer(handle)
        rows = x[handle.recv_expert, handle.recv_slot]
        returned = self._all_to_all(rows, handle.recv_counts, handle.send_counts, masked=True)  # in send order
        # Checked after the exchange, so that no other rank is left waiting in it.
        if topk_idx.shape != handle.topk_idx.shape:
            raise ValueError(f"low_latency_combine: topk_idx has shape {tuple(topk_idx.shape)} but the dispatch's "
                             f"had {tuple(handle.topk_idx.shape)}")
        changed = ((topk_idx >= 0) & (topk_idx != handle.topk_idx)).nonzero()
        if changed.size(0) > 0:
            t, k = changed[0].tolist()
            raise ValueError(f"low_latency_combine: topk_idx[{t}, {k}] = {int(topk_idx[t, k])} but the dispatch had "
                             f"{int(handle.topk_idx[t, k])} (only -1 may replace an id)")

        num_tokens, top_k = topk_idx.shape
        hidden = x.size(2)
        per_entry = torch.zeros((num_tokens, top_k, hidden), dtype=torch.float32, device=x.device)
        per_entry[handle.send_token, handle.send_k] = returned.float()
        use = (topk_idx >= 0) & ~masking.masked_entries(self, topk_idx, handle.num_experts)
        combined = torch.zeros((num_tokens, hidden), dtype=torch.float32, device=x.device)
        for slot in range(top_k):  # fixed order: k = 0, 1, ...
            weighted = topk_weights[:, slot:slot + 1] * per_entry[:, slot]
            combined += torch.where(use[:, slot:slot + 1], weighted, torch.zeros_like(weighted))
        combined = combined.to(torch.bfloat16)
        if out is not None:
            out.copy_(combined)
            combined = out
        return combined, (_receive_complete if return_recv_hook else None)

    def get_next_low_latency_combine_buffer(self, handle: object) -> torch.Tensor:
        handle = self._low_latency_handle(handle)
        if handle.combine_buffer is None:
            handle.combine_buffer = torch.empty(handle.recv_shape, dtype=torch.bfloat16,
                                                device=handle.recv_expert.device)
        return handle.combine_buffer

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        """Nothing to reset: the reference keeps no state between calls (but the rank mask)."""

    def _low_latency_handle(self, handle: object) -> LowLatencyHandle:
        if not isinstance(handle, LowLatencyHandle):
            raise ValueError(f"expected a handle from low_latency_dispatch, got {type(handle).__name__}")
        return handle
