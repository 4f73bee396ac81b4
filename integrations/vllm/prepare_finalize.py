"""vLLM prepare/finalize on `ep_plugin.Buffer`, and the factory that picks one per MoE layer.

Normal mode (`EpPluginPrepareAndFinalize`, `FusedMoEActivationFormat.Standard`): tokens travel once
per destination rank (bf16, or block-FP8 quantised before dispatch with its scales); the experts see
`[N, H]` rows with global top-k ids (entries of other ranks point at an expert this rank does not
hold, so the expert map drops them) and top-k weights (0 for those entries). Finalize applies the
experts' weight-and-reduce, then `combine` sums each token's per-rank partials.

Low-latency mode (`EpPluginLowLatencyPrepareAndFinalize`, `BatchedExperts`): each (token, expert)
pair goes into its expert's slot, `[E_local, R * T_max, H]`, FP8-quantised in flight for [128, 128]
block quantisation; finalize's `low_latency_combine` weights and reduces on the way back. The weights
travel with the dispatch (`low_latency_dispatch(topk_weights=...)`), so that where every peer is on
NVLink the native combine sums on the expert side and returns one partial per (token, rank).

Carried activations: unquantised bf16, and FP8 e4m3 with one float32 scale per 128 channels (vLLM's
[*, 128] block quantisation). Any other scheme is rejected when the layer is built.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

import torch
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig, FusedMoEQuantConfig
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceDelegate

from ep_plugin import Buffer, EpConfig, fp8
from ep_plugin.backends.base import DispatchRoute
from ep_plugin.validation import check_dispatch_route

from .manager import EpPluginAll2AllManager

BF16 = "bf16"
BLOCK_FP8 = "block_fp8"
CUDA_GRAPH_HINT = ("ep_plugin's normal mode waits on the host for the received-token count and cannot be "
                   "captured in a CUDA graph: serve with --enforce-eager (or -cc.cudagraph_mode=NONE), or set "
                   "`mode: low_latency` in $EP_PLUGIN_CONFIG")


def activation_transport(quant_config: Optional[FusedMoEQuantConfig], defer_input_quant: bool) -> str:
    """How activations travel for this quantisation: BF16 or BLOCK_FP8; raises for what we do not carry.

    Arguments:
        quant_config: the experts' quantisation (None or unquantised: bf16).
        defer_input_quant: the experts quantise their input themselves (then bf16 travels).
    """
    if quant_config is None or quant_config.quant_dtype is None or defer_input_quant:
        return BF16
    block_shape = quant_config.block_shape
    if (quant_config.quant_dtype == torch.float8_e4m3fn and block_shape is not None and block_shape[-1] == 128
            and not quant_config.per_act_token_quant and quant_config.a1_scale is None
            and not getattr(quant_config, "is_scale_transposed", False)):
        return BLOCK_FP8
    raise NotImplementedError(
        "ep_plugin carries bf16 activations or FP8 e4m3 activations with one float32 scale per 128 channels "
        "([*, 128] block quantisation); this layer's experts want quant_dtype="
        f"{quant_config.quant_dtype}, block_shape={block_shape}, per_act_token_quant="
        f"{quant_config.per_act_token_quant}, static a1_scale={quant_config.a1_scale is not None}, "
        f"transposed scales={getattr(quant_config, 'is_scale_transposed', False)}. Use another "
        "--all2all-backend (e.g. allgather_reducescatter) for this model.")


def _require_bf16(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype != torch.bfloat16:
        raise TypeError(f"ep_plugin's vLLM backend carries bf16 activations: {name} is {tensor.dtype} "
                        "(serve the model with --dtype bfloat16)")


def _weighted_inputs(a1: torch.Tensor, topk_weights: torch.Tensor, apply_router_weight_on_input: bool
                     ) -> torch.Tensor:
    """`a1` scaled by its router weight when the model applies it on the input (top-1 routing only)."""
    if not apply_router_weight_on_input:
        return a1
    if topk_weights.size(1) != 1:
        raise ValueError(f"apply_router_weight_on_input needs top-1 routing, got top-{topk_weights.size(1)}")
    return a1 * topk_weights.to(a1.dtype)


class _EpPluginPrepareFinalizeBase(mk.FusedMoEPrepareAndFinalizeModular):
    """What both modes share: the buffer, the capability answers, synchronous wrappers of the async hooks."""

    def __init__(self, buffer: Buffer, num_dispatchers: int, num_local_experts: int) -> None:
        super().__init__()
        self.buffer = buffer
        self.num_dispatchers_ = num_dispatchers
        self.num_local_experts = num_local_experts
        self.rank_expert_offset = buffer.rank * num_local_experts
        self.transport: Optional[str] = None  # set in post_init_setup, from the experts
        self._handle: Any = None  # the last dispatch's handle, for the matching combine

    def post_init_setup(self, fused_experts: mk.FusedMoEExperts) -> None:
        """Decide the transport from the experts' quantisation (raises for schemes we do not carry)."""
        self.transport = activation_transport(fused_experts.quant_config, fused_experts.expects_unquantized_inputs)

    def _transport_for(self, quant_config: FusedMoEQuantConfig, defer_input_quant: bool) -> str:
        return self.transport or activation_transport(quant_config, defer_input_quant)

    def num_dispatchers(self) -> int:
        return self.num_dispatchers_

    def output_is_reduced(self) -> bool:
        """Finalize leaves each token's complete output on its own rank."""
        return True

    def topk_indices_dtype(self) -> Optional[torch.dtype]:
        return torch.int64

    def supports_async(self) -> bool:
        return True

    def supports_dbo(self) -> bool:
        """Not with dual-batch overlap: one dispatch handle is in flight at a time."""
        return False

    def prepare(self, a1: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                expert_map: Optional[torch.Tensor], apply_router_weight_on_input: bool,
                quant_config: FusedMoEQuantConfig, defer_input_quant: bool = False) -> mk.PrepareResultType:
        """Dispatch and wait: `prepare_async` followed by its hook and receiver."""
        hook, receiver = self.prepare_async(a1, topk_weights, topk_ids, num_experts, expert_map,
                                            apply_router_weight_on_input, quant_config, defer_input_quant)
        hook()
        return receiver()

    def finalize(self, output: torch.Tensor, fused_expert_output: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, apply_router_weight_on_input: bool,
                 weight_and_reduce_impl: mk.TopKWeightAndReduce) -> None:
        """Combine into `output` and wait: `finalize_async` followed by its hook and receiver."""
        hook, receiver = self.finalize_async(output, fused_expert_output, topk_weights, topk_ids,
                                             apply_router_weight_on_input, weight_and_reduce_impl)
        hook()
        receiver()


def _no_wait() -> None:
    """The hook of an operation whose receiver does the waiting."""


class EpPluginPrepareAndFinalize(_EpPluginPrepareFinalizeBase):
    """Normal mode: `Buffer.dispatch` / `Buffer.combine`, Standard activation format."""

    @property
    def activation_format(self) -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    def max_num_tokens_per_rank(self) -> Optional[int]:
        return None

    def prepare_async(self, a1: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      num_experts: int, expert_map: Optional[torch.Tensor], apply_router_weight_on_input: bool,
                      quant_config: FusedMoEQuantConfig, defer_input_quant: bool = False
                      ) -> Tuple[Callable[[], None], Callable[[], mk.PrepareResultType]]:
        """Start the dispatch of `a1` `[T, H]` bf16 by `topk_ids` `[T, K]` (global expert ids).

        Returns (hook, receiver); the receiver yields the rows this rank received `[N, H]` (bf16, or
        FP8 e4m3 with float32 scales `[N, ceil(H / 128)]`), the tokens per local expert, the global
        top-k ids `[N, K]` int64 and weights `[N, K]` float32 of each received row.
        """
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(CUDA_GRAPH_HINT)
        _require_bf16("the MoE input", a1)
        transport = self._transport_for(quant_config, defer_input_quant)
        x = _weighted_inputs(a1, topk_weights, apply_router_weight_on_input)
        payload = fp8.quantize(x) if transport == BLOCK_FP8 else x
        topk_ids = topk_ids.to(torch.int64)
        per_rank, per_node, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(topk_ids, num_experts)
        recv_x, recv_ids, recv_weights, per_expert_list, handle, event = self.buffer.dispatch(
            payload, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_node, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=topk_ids, topk_weights=topk_weights.to(torch.float32),
            async_finish=True)
        self._handle = handle

        def receive() -> mk.PrepareResultType:
            event.current_stream_wait()
            data, scales = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
            meta = mk.ExpertTokensMetadata.make_from_list(per_expert_list, device=data.device)
            return data, scales, meta, self._global_ids(recv_ids, num_experts), recv_weights

        return _no_wait, receive

    def _global_ids(self, local_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
        """Local ids (`-1`: not this rank's) -> global ids; `-1` becomes an expert of another rank."""
        elsewhere = num_experts - 1 if self.rank_expert_offset == 0 else 0
        return torch.where(local_ids >= 0, local_ids + self.rank_expert_offset,
                           torch.full_like(local_ids, elsewhere))

    def finalize_async(self, output: torch.Tensor, fused_expert_output: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor, apply_router_weight_on_input: bool,
                       weight_and_reduce_impl: mk.TopKWeightAndReduce
                       ) -> Tuple[Callable[[], None], Callable[[], None]]:
        """Weight and reduce the experts' output of the received rows, start the combine into `output` `[T, H]`.

        `fused_expert_output` is `[N, K, H]` (or `[N * K, H]`) when the experts leave the reduction to
        us (`TopKWeightAndReduceDelegate`), else whatever their own reduction takes.
        """
        if self._handle is None:
            raise RuntimeError("finalize without a preceding prepare")
        handle, self._handle = self._handle, None
        reduced = self._weight_and_reduce(fused_expert_output, topk_weights, topk_ids,
                                          apply_router_weight_on_input, weight_and_reduce_impl)
        combined, _, event = self.buffer.combine(reduced, handle, async_finish=True)

        def receive() -> None:
            event.current_stream_wait()
            output.copy_(combined)

        return _no_wait, receive

    def _weight_and_reduce(self, fused_expert_output: torch.Tensor, topk_weights: torch.Tensor,
                           topk_ids: torch.Tensor, apply_router_weight_on_input: bool,
                           impl: mk.TopKWeightAndReduce) -> torch.Tensor:
        """`[N, H]` bf16: each received row's sum over its local top-k entries of weight * expert output."""
        num_rows, top_k = topk_ids.shape
        hidden = fused_expert_output.size(-1)
        if num_rows == 0:
            return fused_expert_output.new_empty((0, hidden), dtype=torch.bfloat16)
        if not isinstance(impl, TopKWeightAndReduceDelegate):
            return impl.apply(None, fused_expert_output, topk_weights, topk_ids,
                              apply_router_weight_on_input).to(torch.bfloat16).contiguous()
        # Mask other ranks' entries (weight 0) so that garbage rows (NaN * 0) cannot leak in.
        local = (topk_ids >= self.rank_expert_offset) & (topk_ids < self.rank_expert_offset + self.num_local_experts)
        weights = local.to(torch.float32) if apply_router_weight_on_input else topk_weights.to(torch.float32)
        rows = fused_expert_output.reshape(num_rows, top_k, hidden).float() * weights.unsqueeze(-1)
        rows = torch.where(local.unsqueeze(-1), rows, torch.zeros((), dtype=rows.dtype, device=rows.device))
        return rows.sum(dim=1).to(torch.bfloat16)


@dataclass
class _Route:
    """What a low-latency prepare dispatched with: vLLM's topk tensors (`source`) and the int64 ids /
    float32 weights made of them. The combine must get the dispatch's own ids and weights, so finalize
    reuses these, after checking that vLLM handed it the same, unmodified tensors (its modular kernel
    passes prepare's topk_ids and topk_weights on to finalize)."""
    source: DispatchRoute
    weights_on_input: bool
    ids: torch.Tensor
    weights: torch.Tensor

    @classmethod
    def of(cls, topk_ids: torch.Tensor, topk_weights: torch.Tensor, weights_on_input: bool) -> "_Route":
        # Weights applied to the input already: the combine adds the experts' outputs unweighted.
        weights = torch.ones_like(topk_weights, dtype=torch.float32) if weights_on_input \
            else topk_weights.to(torch.float32)
        return cls(DispatchRoute.of(topk_ids, topk_weights), weights_on_input, topk_ids.to(torch.int64), weights)

    def check_same(self, topk_ids: torch.Tensor, topk_weights: torch.Tensor, weights_on_input: bool) -> None:
        try:
            check_dispatch_route(self.source, topk_ids, topk_weights)
            same = weights_on_input == self.weights_on_input
        except ValueError:
            same = False
        if not same:
            raise ValueError("ep_plugin's low-latency finalize must get the topk_ids, topk_weights and "
                             "apply_router_weight_on_input of the matching prepare, unmodified: the dispatch sent "
                             "the weights with the tokens")


class EpPluginLowLatencyPrepareAndFinalize(_EpPluginPrepareFinalizeBase):
    """Low-latency mode: `Buffer.low_latency_dispatch` / `low_latency_combine`, BatchedExperts format.

    Arguments:
        buffer: a low-latency `ep_plugin.Buffer`.
        max_tokens_per_rank: T_max, the most tokens one rank dispatches per call.
        num_dispatchers: ranks of the EP group.
        num_local_experts: experts per rank.
        settings: ep_plugin's config (its `low_latency` FP8 options).
    """

    def __init__(self, buffer: Buffer, max_tokens_per_rank: int, num_dispatchers: int, num_local_experts: int,
                 settings: EpConfig) -> None:
        super().__init__(buffer, num_dispatchers, num_local_experts)
        self.max_tokens_per_rank = max_tokens_per_rank
        self.fp8_in_flight = settings.low_latency.use_fp8
        self.round_scale = settings.low_latency.round_scale
        self.use_ue8m0 = settings.low_latency.use_ue8m0

    @property
    def activation_format(self) -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.BatchedExperts

    def max_num_tokens_per_rank(self) -> Optional[int]:
        return self.max_tokens_per_rank

    def post_init_setup(self, fused_experts: mk.FusedMoEExperts) -> None:
        super().post_init_setup(fused_experts)
        if (self.transport == BLOCK_FP8 and self.fp8_in_flight and self.use_ue8m0
                and not fused_experts.supports_packed_ue8m0_act_scales()):
            raise ValueError(f"low_latency.use_ue8m0 packs the FP8 scales as UE8M0 bytes, which "
                             f"{type(fused_experts).__name__} cannot read; set low_latency.use_ue8m0: false")

    def prepare_async(self, a1: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      num_experts: int, expert_map: Optional[torch.Tensor], apply_router_weight_on_input: bool,
                      quant_config: FusedMoEQuantConfig, defer_input_quant: bool = False
                      ) -> Tuple[Callable[[], None], Callable[[], mk.PrepareResultType]]:
        """Send `a1` `[T, H]` bf16 (T <= T_max) into its experts' slots by `topk_ids` `[T, K]`.

        Returns (hook, receiver): the hook completes the receive; the receiver yields
        `[E_local, R * T_max, H]` (bf16, or FP8 e4m3 with float32 scales `[E_local, R * T_max,
        ceil(H / 128)]`) and the valid slots per local expert `[E_local]` int32.
        """
        _require_bf16("the MoE input", a1)
        if a1.size(0) > self.max_tokens_per_rank:
            raise ValueError(f"{a1.size(0)} tokens in one MoE call, more than low_latency.max_dispatch_tokens_per_rank"
                             f" = {self.max_tokens_per_rank}: lower --max-num-batched-tokens or raise the config value")
        transport = self._transport_for(quant_config, defer_input_quant)
        in_flight = transport == BLOCK_FP8 and self.fp8_in_flight
        x = _weighted_inputs(a1, topk_weights, apply_router_weight_on_input)
        route = _Route.of(topk_ids, topk_weights, apply_router_weight_on_input)
        # The weights go with the dispatch: where every peer is on NVLink the combine then sums on the
        # expert side (low_latency.expert_sums_partials) and moves a fraction of the bytes.
        recv_x, recv_count, handle, _, hook = self.buffer.low_latency_dispatch(
            x, route.ids, self.max_tokens_per_rank, num_experts, use_fp8=in_flight,
            round_scale=in_flight and self.round_scale, use_ue8m0=in_flight and self.use_ue8m0,
            return_recv_hook=True, topk_weights=route.weights)
        self._handle = (handle, route)

        def receive() -> mk.PrepareResultType:
            if in_flight:
                data, scales = recv_x
            elif transport == BLOCK_FP8:  # FP8 off on the wire, but the experts want it: quantise here
                data, scales = fp8.quantize(recv_x)
            else:
                data, scales = recv_x, None
            meta = mk.ExpertTokensMetadata(expert_num_tokens=recv_count, expert_num_tokens_cpu=None)
            return data, scales, meta, None, None

        return hook, receive

    def finalize_async(self, output: torch.Tensor, fused_expert_output: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor, apply_router_weight_on_input: bool,
                       weight_and_reduce_impl: mk.TopKWeightAndReduce
                       ) -> Tuple[Callable[[], None], Callable[[], None]]:
        """Return `fused_expert_output` `[E_local, R * T_max, H]` bf16 to its tokens, weighted by
        `topk_weights` `[T, K]` and summed into `output` `[T, H]`; the hook completes the receive."""
        if not isinstance(weight_and_reduce_impl, TopKWeightAndReduceDelegate):
            raise ValueError("ep_plugin's low-latency combine weights and reduces itself; the batched experts must "
                             "leave that to it (TopKWeightAndReduceDelegate), got "
                             f"{type(weight_and_reduce_impl).__name__}")
        if self._handle is None:
            raise RuntimeError("finalize without a preceding prepare")
        (handle, route), self._handle = self._handle, None
        _require_bf16("the experts' output", fused_expert_output)
        route.check_same(topk_ids, topk_weights, apply_router_weight_on_input)
        direct = output.dtype == torch.bfloat16 and output.is_contiguous()
        combined, _, hook = self.buffer.low_latency_combine(
            fused_expert_output, route.ids, route.weights, handle, return_recv_hook=True,
            out=output if direct else None)

        def receive() -> None:
            if not direct:
                output.copy_(combined)

        return hook, receive


class EpPluginPrepareFinalizeFactory:
    """Builds the prepare/finalize of one MoE layer for `--all2all-backend ep_plugin`.

    Shaped like vLLM's proposed `MoEPrepareFinalizeFactory` (PR 50556): registered under
    `backend_name` where vLLM has the registry, called by the patched `maybe_make_prepare_finalize`
    where it does not.
    """

    backend_name = "ep_plugin"
    supports_sequence_parallel = True

    @classmethod
    def create(cls, *, moe: FusedMoEConfig, quant_config: Optional[FusedMoEQuantConfig],
               routing_tables: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]], allow_new_interface: bool,
               use_monolithic: bool, eep_stage: bool, all2all_manager: Any) -> _EpPluginPrepareFinalizeBase:
        """The normal or low-latency prepare/finalize (by `$EP_PLUGIN_CONFIG`'s `mode`) for layer `moe`."""
        del allow_new_interface  # ours is the modular interface, which every caller accepts
        if use_monolithic:
            raise NotImplementedError("ep_plugin provides a modular prepare/finalize (top-k ids in, per-expert rows "
                                      "out); the selected MoE kernel is monolithic (router fused in). Choose a "
                                      "modular --moe-backend, or another --all2all-backend.")
        if eep_stage:
            raise NotImplementedError("ep_plugin does not support elastic EP reconfiguration")
        if routing_tables is not None:
            raise NotImplementedError("ep_plugin places experts linearly (rank r holds a contiguous range); "
                                      "round-robin placement tables are not supported")
        if not isinstance(all2all_manager, EpPluginAll2AllManager):
            raise TypeError(f"the EP group's all2all manager is {type(all2all_manager).__name__}, not ep_plugin's: "
                            "was ep_plugin's vLLM plugin registered in this process?")
        num_ranks = all2all_manager.world_size
        if moe.num_experts != moe.num_local_experts * num_ranks:
            raise ValueError(f"ep_plugin needs the {moe.num_experts} experts split evenly over {num_ranks} EP ranks, "
                             f"got {moe.num_local_experts} local experts")
        settings = all2all_manager.settings
        if settings.mode == "low_latency":
            return cls._low_latency(moe, all2all_manager, settings)
        buffer = all2all_manager.get_handle({"mode": "normal", "hidden": moe.hidden_dim})
        return EpPluginPrepareAndFinalize(buffer, num_ranks, moe.num_local_experts)

    @staticmethod
    def _low_latency(moe: FusedMoEConfig, manager: EpPluginAll2AllManager, settings: EpConfig
                     ) -> EpPluginLowLatencyPrepareAndFinalize:
        max_tokens = settings.low_latency.max_dispatch_tokens_per_rank
        if moe.max_num_tokens > max_tokens:
            raise ValueError(f"vLLM may send up to {moe.max_num_tokens} tokens per rank through one MoE call "
                             f"(--max-num-batched-tokens), more than low_latency.max_dispatch_tokens_per_rank = "
                             f"{max_tokens} in {settings.source or 'the default config'}: lower the former or "
                             "raise the latter")
        buffer = manager.get_handle({"mode": "low_latency", "hidden": moe.hidden_dim,
                                     "max_dispatch_tokens_per_rank": max_tokens, "num_experts": moe.num_experts})
        return EpPluginLowLatencyPrepareAndFinalize(buffer, max_tokens, manager.world_size, moe.num_local_experts,
                                                    settings)
