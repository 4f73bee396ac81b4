"""`EpPluginTokenDispatcher`: Megatron-Core's MoE token dispatcher on `ep_plugin.Buffer` (normal mode).

Data flow for one MoE layer (T local tokens, E experts, W = expert-TP x EP ranks, E_local = E / EP):

    dispatch_preprocess   routing map [T, E] + probs [T, E] -> expert ids [T, K] (-1 = not routed) and
                          float32 weights [T, K]. With expert TP the map is first widened to
                          [T, W * E_local] so that every TP rank of an EP rank gets the token (as
                          Megatron's flex dispatcher forms its TP x EP group); K = TP * top-k.
    token_dispatch        Buffer.get_dispatch_layout + Buffer.dispatch: received rows [N, H] (each
                          token once per rank, ordered by source rank, then source token), their
                          local expert ids and weights [N, K].
    dispatch_postprocess  local multi-hot map [N, E_local] -> rows grouped by local expert [M, H] in
                          Megatron's permute order, their probs [M], tokens_per_expert [E_local]; with
                          router padding each expert's rows are padded to the quantization alignment.
                          TransformerEngine's fused permute when `moe_permute_fusion` is on, else
                          ep_plugin.permute (a gather; its backward sums without atomics).
    combine_preprocess    the reverse: expert outputs summed back per received row [N, H] (TE's fused
                          unpermute, or ep_plugin.permute's gather-and-sum kernel).
    token_combine         Buffer.combine: each token's rows summed over the ranks it went to [T, H].
    combine_postprocess   the input's shape, plus the overlapped shared experts' output.

Autograd: the backward of dispatch is a combine of the gradients, which also returns the weights'
gradients (so the router's probs get theirs); the backward of combine is a cached dispatch.

Rows travel as bf16 (the Buffer's normal-mode dtype); another hidden dtype is cast for the transfer
and back, with a warning. Weights travel as float32.
"""
from __future__ import annotations

import logging
import math
import warnings
from typing import List, Optional, Tuple

import torch

from megatron.core import utils as mcore_utils
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

from ep_plugin.permute import ExpertMajorOrder, permute_rows, unpermute_rows
from ep_plugin.tuning import MAX_TOPK

from . import _compat
from .buffers import get_buffer

logger = logging.getLogger("ep_plugin.megatron")

DISPATCHER_TYPE = "ep_plugin"
COMM_DTYPE = torch.bfloat16


class _DispatchState:
    """What one dispatch leaves for dispatch_postprocess and combine (tensors that need no grad)."""

    __slots__ = ("buffer", "handle", "recv_topk_idx", "recv_counts")

    def __init__(self, buffer) -> None:
        self.buffer = buffer
        self.handle = None
        self.recv_topk_idx: Optional[torch.Tensor] = None   # [N, K] int64: local expert, or -1
        self.recv_counts: Optional[List[int]] = None         # [E_local] host ints: rows per local expert


class _Dispatch(torch.autograd.Function):
    """x [T, H] bf16, weights [T, K] float32 -> received rows [N, H] bf16 and their weights [N, K] float32."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weights: torch.Tensor, topk_idx: torch.Tensor, num_experts: int,
                state: _DispatchState):
        buffer = state.buffer
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
        recv_x, recv_idx, recv_weights, counts, handle, _ = buffer.dispatch(
            x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=weights)
        state.handle, state.recv_topk_idx, state.recv_counts = handle, recv_idx, list(counts)
        ctx.buffer, ctx.handle, ctx.hidden = buffer, handle, x.size(1)
        ctx.save_for_backward(recv_idx)
        return recv_x, recv_weights

    @staticmethod
    def backward(ctx, grad_recv_x: Optional[torch.Tensor], grad_recv_weights: Optional[torch.Tensor]):
        (recv_idx,) = ctx.saved_tensors
        if grad_recv_x is None:
            grad_recv_x = torch.zeros(recv_idx.size(0), ctx.hidden, dtype=COMM_DTYPE, device=recv_idx.device)
        grad_recv_x = grad_recv_x.to(COMM_DTYPE).contiguous()
        grad_weights = None
        if ctx.needs_input_grad[1]:
            if grad_recv_weights is None:
                grad_recv_weights = torch.zeros(recv_idx.shape, dtype=torch.float32, device=recv_idx.device)
            # A slot whose expert lives elsewhere gets its gradient from that expert's rank.
            grad_weights = torch.where(recv_idx >= 0, grad_recv_weights.float(), 0.0).contiguous()
        grad_x, grad_topk_weights, _ = ctx.buffer.combine(grad_recv_x, ctx.handle, topk_weights=grad_weights)
        return grad_x, grad_topk_weights, None, None, None


class _Combine(torch.autograd.Function):
    """Expert outputs per received row [N, H] bf16 -> [T, H] bf16, each token's rows summed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, state: _DispatchState):
        combined, _, _ = state.buffer.combine(x, state.handle)
        ctx.buffer, ctx.handle = state.buffer, state.handle
        return combined

    @staticmethod
    def backward(ctx, grad_combined: torch.Tensor):
        grad_x, _, _, _, _, _ = ctx.buffer.dispatch(grad_combined.to(COMM_DTYPE).contiguous(), handle=ctx.handle)
        return grad_x, None


def routing_map_to_topk(routing_map: torch.Tensor, probs: torch.Tensor, num_slots: int
                        ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Multi-hot routing to top-k form, on the device and without a host sync.

    Arguments:
        routing_map: `[T, E]` bool; probs: `[T, E]` float (any float dtype; may require grad).
        num_slots: K <= E, at least the most experts any row selects (extra selections are lost).

    Returns:
        topk_idx: `[T, K]` int64, the selected experts in ascending order, then -1.
        weights: `[T, K]` float32, the probs of those experts (0 in -1 slots); differentiable in probs.
    """
    num_experts = routing_map.size(1)
    # Key E - e for a selected expert e, 0 otherwise: topk takes the selected ones in ascending id order.
    rank_key = torch.arange(num_experts, 0, -1, device=routing_map.device, dtype=torch.int32)
    key = torch.where(routing_map.bool(), rank_key, 0)
    values, topk_idx = torch.topk(key, num_slots, dim=1, sorted=True)
    selected = values > 0
    topk_idx = torch.where(selected, topk_idx, -1)
    weights = probs.gather(1, topk_idx.clamp(min=0)).float()
    weights = torch.where(selected, weights, 0.0)
    return topk_idx, weights


def topk_to_local_multihot(recv_topk_idx: torch.Tensor, recv_weights: torch.Tensor, num_local_experts: int
                           ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Received ids and weights `[N, K]` -> `[N, E_local]` bool map and float32 probs (differentiable in weights)."""
    num_rows = recv_topk_idx.size(0)
    valid = recv_topk_idx >= 0
    column = torch.where(valid, recv_topk_idx, num_local_experts)  # -1 -> a spare column, cut off below
    routing = torch.zeros(num_rows, num_local_experts + 1, dtype=torch.bool, device=recv_topk_idx.device)
    routing.scatter_(1, column, True)
    probs = torch.zeros(num_rows, num_local_experts + 1, dtype=torch.float32, device=recv_weights.device)
    probs = probs.scatter(1, column, torch.where(valid, recv_weights.float(), 0.0))
    return routing[:, :num_local_experts].contiguous(), probs[:, :num_local_experts].contiguous()


class EpPluginTokenDispatcher(MoETokenDispatcher):
    """Token dispatcher selected by `moe_token_dispatcher_type="ep_plugin"` (see `register()`).

    Communicates over the expert-TP x EP group (`pg_collection.tp_ep`), as Megatron's flex
    dispatcher does, through one `ep_plugin.Buffer` per group shared by every layer.

    Supports dropless routing, capacity factors with and without drop-and-pad, router padding for
    FP8/FP4 (`moe_router_padding_for_quantization`), shared-expert overlap, TransformerEngine's
    fused permutation (`moe_permute_fusion`) and expert tensor parallelism. Limits (a ValueError
    says so): TP x top-k <= 32 (the Buffer's top-k limit); with drop-and-pad, where padding may route
    a token to more experts than its top-k, TP x (most experts of any token) <= 32; the hidden size
    (or `moe_latent_size`) a multiple of 8. CUDA graphs over the dispatch are not supported (the host
    waits for the received-token count).
    """

    def __init__(self, num_local_experts: int, local_expert_indices: List[int], config,
                 pg_collection=None) -> None:
        if pg_collection is None:
            pg_collection = moe_utils.get_default_pg_collection()
        super().__init__(config=config, pg_collection=pg_collection)
        self.ep_rank = mcore_utils.get_pg_rank(self.ep_group)  # set by the base class from 0.18 on only
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        self.num_experts = config.num_moe_experts
        self._check_layout()
        self.world_size = self.tp_size * self.ep_size
        # Experts as the Buffer sees them: expert TP puts a copy of each expert on each of its TP ranks.
        self.num_comm_experts = self.world_size * num_local_experts
        self.drop_and_pad = bool(config.moe_pad_expert_input_to_capacity)
        self.permute_fusion = bool(config.moe_permute_fusion)
        self.num_slots = self._static_num_slots()

        hidden = getattr(config, "moe_latent_size", None) or config.hidden_size
        if hidden % 8 != 0:
            raise ValueError(f"ep_plugin moves bf16 rows of a multiple of 16 bytes: the hidden size {hidden} must be a "
                             f"multiple of 8")
        self.buffer = get_buffer(self.tp_ep_group, hidden)
        self._state: Optional[_DispatchState] = None
        self._order: Optional[ExpertMajorOrder] = None  # the non-fused permutation, until combine_preprocess
        self._topk_idx: Optional[torch.Tensor] = None
        self._hidden_dtype: Optional[torch.dtype] = None
        self._warned_dtype = False

    # ---- helpers ---------------------------------------------------------------------------------
    def _check_layout(self) -> None:
        num_local, indices = self.num_local_experts, self.local_expert_indices
        if num_local <= 0 or len(indices) != num_local:
            raise ValueError(f"expected {num_local} local expert indices, got {indices}")
        if indices != list(range(indices[0], indices[0] + num_local)):
            raise ValueError(f"local expert indices must be consecutive, got {indices}")
        if self.num_experts != num_local * self.ep_size:
            raise ValueError(f"num_moe_experts ({self.num_experts}) != local experts ({num_local}) x EP size "
                             f"({self.ep_size})")
        if torch.distributed.get_backend(self.tp_ep_group) == "fake":
            raise ValueError("ep_plugin moves tokens between real ranks: Megatron's --fake-process-group is not "
                             "supported with moe_token_dispatcher_type='ep_plugin'")
        group_size = mcore_utils.get_pg_size(self.tp_ep_group)
        if group_size != self.tp_size * self.ep_size:
            raise ValueError(f"the expert TP x EP group has {group_size} ranks, expected expert TP ({self.tp_size}) "
                             f"x EP ({self.ep_size})")

    def _static_num_slots(self) -> Optional[int]:
        """K when it is known up front: TP x top-k, or with drop-and-pad TP x E if that fits (else None)."""
        if self.drop_and_pad:
            # Padding to capacity may route a token to any number of experts.
            slots = self.tp_size * self.num_experts
            return slots if slots <= MAX_TOPK else None
        slots = self.tp_size * self.config.moe_router_topk
        if slots > MAX_TOPK:
            raise ValueError(f"expert TP ({self.tp_size}) x moe_router_topk ({self.config.moe_router_topk}) = {slots} "
                             f"exceeds ep_plugin's top-k limit of {MAX_TOPK}")
        return slots

    def _dynamic_num_slots(self, routing_map: torch.Tensor) -> int:
        """Drop-and-pad with many experts: the most experts any token of the group selects (a host sync)."""
        most = routing_map.sum(dim=1).max() if routing_map.numel() else routing_map.new_zeros((), dtype=torch.long)
        most = most.to(torch.int64).reshape(1)
        torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX, group=self.tp_ep_group)
        slots = max(1, int(most.item()))
        if slots > MAX_TOPK:
            raise ValueError(f"drop-and-pad routed a token to {slots} experts (after expert-TP widening); ep_plugin "
                             f"carries at most {MAX_TOPK} per token. Lower moe_expert_capacity_factor or disable "
                             f"moe_pad_expert_input_to_capacity")
        return slots

    def _widen_for_expert_tp(self, tensor: torch.Tensor) -> torch.Tensor:
        """[T, E] -> [T, W * E_local]: entry (ep, tp, e) repeats (ep, e) for every expert-TP rank."""
        if self.tp_size == 1:
            return tensor
        num_tokens = tensor.size(0)
        return (tensor.reshape(num_tokens, self.ep_size, 1, self.num_local_experts)
                .expand(num_tokens, self.ep_size, self.tp_size, self.num_local_experts)
                .reshape(num_tokens, self.num_comm_experts))

    def _to_comm_dtype(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dtype != COMM_DTYPE and not self._warned_dtype:
            self._warned_dtype = True
            warnings.warn(f"ep_plugin's Megatron dispatcher moves bf16 rows: {tensor.dtype} hidden states are cast to "
                          f"bf16 for dispatch and combine (precision is lost)", RuntimeWarning, stacklevel=3)
        return tensor.to(COMM_DTYPE)

    def _router_padding(self, routing: torch.Tensor, counts: List[int]) -> Tuple[torch.Tensor, List[int]]:
        """Pad each local expert's rows to the quantization alignment by routing extra rows to it (prob 0)."""
        align = moe_utils.get_align_size_for_quantization(self.config)
        if not self.config.moe_router_padding_for_quantization or align <= 0:
            return routing, counts
        padded = [math.ceil(count / align) * align for count in counts]
        if any(target > routing.size(0) for target in padded):
            logger.warning("ep_plugin: %d received rows are too few to pad every local expert to a multiple of %d; "
                           "the experts pad instead", routing.size(0), align)
            return routing, counts
        return moe_utils.pad_routing_map(routing, align), padded

    def _tokens_per_expert_for_experts(self, counts: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The counts are host values already (the dispatch waited for them): the experts read them with
        `.tolist()`, so they stay on the host, except for TE's op fuser, which reads them on the device
        (copied asynchronously, no host sync)."""
        if like.is_cuda and getattr(self.config, "use_transformer_engine_op_fuser", False):
            return counts.pin_memory().to(like.device, non_blocking=True)
        return counts

    # ---- the six-step contract ---------------------------------------------------------------------
    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """Tokens `[S, B, H]` (or `[T, H]`), routing map `[T, E]` bool, probs `[T, E]` ->
        tokens `[T, H]` and float32 weights `[T, K]` (the expert ids are kept for token_dispatch)."""
        if routing_map.dim() != 2 or probs.dim() != 2 or routing_map.shape != probs.shape:
            raise ValueError(f"expected routing_map and probs of one [tokens, experts] shape, got "
                             f"{tuple(routing_map.shape)} and {tuple(probs.shape)}")
        if routing_map.size(1) != self.num_experts:
            raise ValueError(f"routing_map has {routing_map.size(1)} experts, the layer {self.num_experts}")
        self.hidden_shape = hidden_states.shape
        hidden_states = hidden_states.reshape(-1, self.hidden_shape[-1])
        if hidden_states.size(0) != routing_map.size(0):
            raise ValueError(f"{hidden_states.size(0)} tokens but a routing map for {routing_map.size(0)}")
        routing_map = self._widen_for_expert_tp(routing_map)
        probs = self._widen_for_expert_tp(probs)
        num_slots = self.num_slots if self.num_slots is not None else self._dynamic_num_slots(routing_map)
        self._topk_idx, weights = routing_map_to_topk(routing_map, probs, min(num_slots, self.num_comm_experts))
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(hidden_states.view(self.hidden_shape))
        return hidden_states, weights

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Send tokens to the ranks of their experts: -> received rows `[N, H]` and their weights `[N, K]` float32."""
        if self._topk_idx is None:
            raise RuntimeError("token_dispatch called without dispatch_preprocess")
        if self.shared_experts is not None:
            _compat.shared_experts_wait(self.shared_experts)
        self._hidden_dtype = hidden_states.dtype
        state = _DispatchState(self.buffer)
        recv_x, recv_weights = _Dispatch.apply(self._to_comm_dtype(hidden_states), probs.float(), self._topk_idx,
                                               self.num_comm_experts, state)
        self._state, self._topk_idx = state, None
        recv_x = recv_x.to(self._hidden_dtype)
        if self.shared_experts is not None:
            self.shared_experts.linear_fc1_forward_and_act(recv_x)
        return recv_x, recv_weights

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Group received rows by local expert: rows `[N, H]`, weights `[N, K]` -> tokens `[M, H]`,
        tokens_per_expert `[E_local]` int64, probs `[M]` float32 (float64 with `moe_router_dtype='fp64'`)."""
        state = self._state
        if state is None:
            raise RuntimeError("dispatch_postprocess called without token_dispatch")
        routing, local_probs = topk_to_local_multihot(state.recv_topk_idx, probs, self.num_local_experts)
        routing, counts = self._router_padding(routing, list(state.recv_counts))
        if self.permute_fusion:
            self._routing_local = routing
            self._hidden_shape_before_permute = hidden_states.shape
            permuted, permuted_probs, self._reversed_mapping, self._pad_offsets, tokens_per_expert = _compat.permute(
                hidden_states, routing, local_probs, sum(counts), True, torch.tensor(counts, dtype=torch.long),
                moe_utils.get_align_size_for_quantization(self.config))
        else:
            self._order = ExpertMajorOrder.from_routing(routing, sum(counts))
            permuted = permute_rows(hidden_states, self._order)
            permuted_probs = self._order.permute_like_routing(local_probs)
            tokens_per_expert = torch.tensor(counts, dtype=torch.long)
        if getattr(self.config, "moe_router_dtype", None) == "fp64":
            permuted_probs = permuted_probs.to(torch.float64)
        return permuted, self._tokens_per_expert_for_experts(tokens_per_expert, permuted), permuted_probs

    def combine_preprocess(self, hidden_states: torch.Tensor):
        """Expert outputs `[M, H]` -> one row per received row `[N, H]` (the experts applied the probs)."""
        if self._order is not None:
            output = unpermute_rows(hidden_states, self._order)
            self._order = None
            return output
        output = _compat.unpermute(hidden_states, self._reversed_mapping, self._hidden_shape_before_permute,
                                   self._routing_local, True, self._pad_offsets)
        self._reversed_mapping = self._routing_local = self._pad_offsets = None
        return output

    def token_combine(self, hidden_states: torch.Tensor):
        """Return rows to their source ranks and sum each token's copies: `[N, H]` -> `[T, H]`."""
        if self._state is None:
            raise RuntimeError("token_combine called without token_dispatch")
        if self.shared_experts is not None:
            _compat.shared_experts_wait(self.shared_experts)
        dtype = hidden_states.dtype
        combined = _Combine.apply(self._to_comm_dtype(hidden_states), self._state).to(dtype)
        self._state = None
        if self.shared_experts is not None:
            self.shared_experts.linear_fc2_forward(combined)
            self.shared_experts.post_forward_comm()
        return combined

    def combine_postprocess(self, hidden_states: torch.Tensor):
        """`[T, H]` -> the input's shape, plus the overlapped shared experts' output."""
        output = hidden_states.view(self.hidden_shape)
        if self.shared_experts is not None:
            output = output + self.shared_experts.get_output()
        return output
