"""One rank of the vLLM integration test: vLLM's own distributed set-up, EP communicator, prepare/finalize
factory and modular kernel, with a dense torch experts implementation, on the reference backend.

Spawned by tests/test_vllm_integration.py through `ep_plugin.launch.parallel_launch` (gloo, CPU).
Nothing of vLLM is mocked: `DenseStandardExperts` / `DenseBatchedExperts` are ordinary subclasses
of vLLM's `FusedMoEExpertsModular`, like any experts kernel.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List, Optional

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before vLLM picks its platform

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ep_plugin import fp8  # noqa: E402


@dataclass
class MoeCase:
    """Global data of one MoE call: every rank's tokens and routing, all experts' weights."""

    name: str
    block_fp8: bool
    xs: List[torch.Tensor]            # per rank [T_r, H] bf16
    topk_ids: List[torch.Tensor]      # per rank [T_r, K] int64, global expert ids, distinct per token
    topk_weights: List[torch.Tensor]  # per rank [T_r, K] float32
    w1: torch.Tensor                  # [E, 2 I, H] bf16 (gate; up)
    w2: torch.Tensor                  # [E, H, I] bf16


def make_case(name: str, block_fp8: bool, num_ranks: int, num_experts: int, top_k: int, hidden: int,
              intermediate: int, max_tokens: int, generator: torch.Generator) -> MoeCase:
    """Random tokens (1..max_tokens per rank), distinct top-k experts per token, random weights."""
    xs, ids, weights = [], [], []
    for _ in range(num_ranks):
        tokens = int(torch.randint(1, max_tokens + 1, (1,), generator=generator))
        xs.append(torch.randn(tokens, hidden, generator=generator).to(torch.bfloat16))
        ids.append(torch.rand(tokens, num_experts, generator=generator).argsort(dim=1)[:, :top_k].contiguous())
        weights.append(torch.rand(tokens, top_k, generator=generator) + 0.1)
    w1 = (torch.randn(num_experts, 2 * intermediate, hidden, generator=generator) / hidden ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(num_experts, hidden, intermediate, generator=generator) / intermediate ** 0.5).to(torch.bfloat16)
    return MoeCase(name, block_fp8, xs, ids, weights, w1, w2)


def expert_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """SiLU-gated MLP in float32: x `[n, H]`, w1 `[2 I, H]`, w2 `[H, I]` -> `[n, H]` float32."""
    gate, up = (x.float() @ w1.float().t()).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ w2.float().t()


def as_expert_input(x: torch.Tensor, block_fp8: bool) -> torch.Tensor:
    """What an expert sees of bf16 tokens `[..., H]`: the tokens, or their block-FP8 round trip (float32)."""
    return fp8.dequantize(*fp8.quantize(x)) if block_fp8 else x.float()


def dense_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w1: torch.Tensor,
              w2: torch.Tensor, block_fp8: bool) -> torch.Tensor:
    """Single-process MoE: per token, sum_k weight_k * expert_{id_k}(x), float32 `[T, H]`."""
    inputs = as_expert_input(x, block_fp8)
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.size(0)):
        for k in range(topk_ids.size(1)):
            e = int(topk_ids[t, k])
            out[t] += float(topk_weights[t, k]) * expert_mlp(inputs[t:t + 1], w1[e], w2[e])[0]
    return out


# ---- experts (vLLM's FusedMoEExpertsModular interface) ---------------------------------------------
def _make_experts_classes():
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceDelegate

    def dequantized(hidden_states: torch.Tensor, scales: Optional[torch.Tensor]) -> torch.Tensor:
        return fp8.dequantize(hidden_states, scales) if scales is not None else hidden_states.float()

    class _DenseExperts(mk.FusedMoEExpertsModular):
        """Dense torch experts: unweighted per-(row, expert) outputs, weighting left to finalize."""

        @staticmethod
        def _supports_current_device() -> bool:
            return True

        @staticmethod
        def _supports_no_act_and_mul() -> bool:
            return False

        @staticmethod
        def _supports_quant_scheme(weight_key, activation_key) -> bool:
            return True

        @staticmethod
        def _supports_activation(activation) -> bool:
            return activation == mk.MoEActivation.SILU

        @staticmethod
        def _supports_parallel_config(moe_parallel_config) -> bool:
            return True

        def finalize_weight_and_reduce_impl(self) -> mk.TopKWeightAndReduce:
            return TopKWeightAndReduceDelegate()

        def record_input(self, hidden_states: torch.Tensor, scales: Optional[torch.Tensor]) -> None:
            """Keep what arrived (dtype, shape, scales' shape) for the test to check the transport."""
            self.seen_input = (str(hidden_states.dtype), tuple(hidden_states.shape),
                               None if scales is None else tuple(scales.shape))

    class DenseStandardExperts(_DenseExperts):
        """Standard format: rows `[N, H]` with global top-k ids -> `[N, K, H]` (NaN for other ranks' experts)."""

        @staticmethod
        def activation_format() -> mk.FusedMoEActivationFormat:
            return mk.FusedMoEActivationFormat.Standard

        def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta,
                             activation):
            return (0,), (0,), (M, topk, K)

        def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                  expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
                  apply_router_weight_on_input):
            self.record_input(hidden_states, a1q_scale)
            x = dequantized(hidden_states, a1q_scale)
            output.fill_(float("nan"))  # finalize must not read entries of other ranks' experts
            local = expert_map[topk_ids]
            for n, k in (local >= 0).nonzero().tolist():
                e = int(local[n, k])
                output[n, k] = expert_mlp(x[n:n + 1], w1[e], w2[e])[0].to(output.dtype)
            return None

    class DenseBatchedExperts(_DenseExperts):
        """Batched format: `[E_local, slots, H]` with valid slots per expert -> same shape (NaN past them)."""

        @staticmethod
        def activation_format() -> mk.FusedMoEActivationFormat:
            return mk.FusedMoEActivationFormat.BatchedExperts

        def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta,
                             activation):
            return (0,), (0,), (local_num_experts, M, K)

        def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                  expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
                  apply_router_weight_on_input):
            self.record_input(hidden_states, a1q_scale)
            x = dequantized(hidden_states, a1q_scale)
            output.fill_(float("nan"))  # combine must read valid slots only
            for e, count in enumerate(expert_tokens_meta.expert_num_tokens.tolist()):
                output[e, :count] = expert_mlp(x[e, :count], w1[e], w2[e]).to(output.dtype)
            return None

    return DenseStandardExperts, DenseBatchedExperts


# ---- one rank ----------------------------------------------------------------------------------------
def _init_vllm(rank: int, world_size: int):
    """vLLM's config, distributed environment and groups for DP = EP = world_size, over the existing gloo group."""
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    parallel = ParallelConfig(data_parallel_size=world_size, data_parallel_rank=rank, enable_expert_parallel=True,
                              all2all_backend="ep_plugin", distributed_executor_backend="external_launcher")
    vllm_config = VllmConfig(parallel_config=parallel)
    context = set_current_vllm_config(vllm_config)
    context.__enter__()
    parallel_state.init_distributed_environment(world_size=world_size, rank=rank, local_rank=rank, backend="gloo")
    parallel_state.initialize_model_parallel(1, 1, backend="gloo")
    return parallel


def _moe_config(parallel, world_size: int, num_experts: int, top_k: int, hidden: int, intermediate: int,
                max_tokens: int):
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig, FusedMoEParallelConfig, RoutingMethodType

    moe_parallel = FusedMoEParallelConfig.make(tp_size_=1, pcp_size_=1, dp_size_=world_size, sp_size_=1,
                                               vllm_parallel_config=parallel)
    return FusedMoEConfig(num_experts=num_experts, experts_per_token=top_k, hidden_dim=hidden,
                          intermediate_size=intermediate, num_local_experts=num_experts // world_size,
                          num_logical_experts=num_experts, activation=MoEActivation.SILU, device="cpu",
                          routing_method=RoutingMethodType.TopK, moe_parallel_config=moe_parallel,
                          in_dtype=torch.bfloat16, max_num_tokens=max_tokens)


def _quant_config(block_fp8: bool, num_local_experts: int):
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG, fp8_w8a8_moe_quant_config
    if not block_fp8:
        return FUSED_MOE_UNQUANTIZED_CONFIG
    # The dense experts keep bf16 weights; the scales only describe the scheme ([128, 128] blocks).
    ones = torch.ones(num_local_experts, 1, 1)
    return fp8_w8a8_moe_quant_config(w1_scale=ones, w2_scale=ones, block_shape=[128, 128])


def _run_sync(pf, experts, x, topk_ids, topk_weights, num_experts, expert_map, quant_config, w1, w2):
    """prepare -> experts -> finalize, called one by one (the synchronous entry points)."""
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk

    a1q, scales, meta, ids, weights = pf.prepare(x, topk_weights, topk_ids, num_experts, expert_map, False,
                                                 quant_config, defer_input_quant=False)
    ids = topk_ids if ids is None else ids
    weights = topk_weights if weights is None else weights
    if pf.activation_format == mk.FusedMoEActivationFormat.Standard:
        fused = torch.empty((a1q.size(0), ids.size(1), a1q.size(-1)), dtype=torch.bfloat16)
    else:
        fused = torch.empty(a1q.shape, dtype=torch.bfloat16)
    if fused.numel():
        experts.apply(fused, a1q, w1, w2, weights, ids, mk.MoEActivation.SILU, num_experts, expert_map, scales,
                      None, None, None, meta, False)
    output = torch.full(x.shape, float("nan"), dtype=torch.bfloat16)
    pf.finalize(output, fused, weights, ids, False, experts.finalize_weight_and_reduce_impl())
    return output


def _too_many_tokens_error(parallel, world_size: int, case: MoeCase, max_tokens: int) -> Optional[str]:
    """The error of building a layer that may see more tokens per call than T_max (None: no error)."""
    from vllm.model_executor.layers.fused_moe import all2all_utils
    moe = _moe_config(parallel, world_size, case.w1.size(0), case.topk_ids[0].size(1), case.w1.size(2),
                      case.w2.size(2), max_tokens + 1)
    try:
        all2all_utils.maybe_make_prepare_finalize(moe, _quant_config(False, moe.num_local_experts),
                                                  allow_new_interface=True)
    except ValueError as error:
        return str(error)
    return None


def _finalize_mismatch_error(pf, x, topk_ids, topk_weights, num_experts, expert_map, quant_config) -> Optional[str]:
    """A low-latency finalize given other topk_weights than its prepare's: the error (None: none raised)."""
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceDelegate

    a1q = pf.prepare(x, topk_weights, topk_ids, num_experts, expert_map, False, quant_config,
                     defer_input_quant=False)[0]
    try:
        pf.finalize(torch.empty(x.shape, dtype=torch.bfloat16), torch.zeros(a1q.shape, dtype=torch.bfloat16),
                    topk_weights.clone(), topk_ids, False, TopKWeightAndReduceDelegate())
    except ValueError as error:
        return str(error)
    return None


def run_rank(rank: int, world_size: int, group, config_path: str, cases: List[MoeCase], max_tokens: int
             ) -> Dict[str, object]:
    """Run every case twice (through vLLM's FusedMoEKernel, and prepare/experts/finalize called directly).

    Returns {"outputs": {case name + path: [T_rank, H] nested lists of the bf16 values}, "facts": what vLLM
    saw of the backend}.
    """
    os.environ["EP_PLUGIN_CONFIG"] = config_path
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm.distributed import get_ep_group
    from vllm.model_executor.layers.fused_moe import all2all_utils
    from vllm.model_executor.layers.fused_moe.oracle import unquantized
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # the entry point: how vLLM's workers register ep_plugin
    parallel = _init_vllm(rank, world_size)
    manager = get_ep_group().device_communicator.all2all_manager
    standard_cls, batched_cls = _make_experts_classes()
    outputs, facts = {}, {"manager": type(manager).__name__,
                          "oracle_sees_patch": unquantized.maybe_make_prepare_finalize
                          is all2all_utils.maybe_make_prepare_finalize}
    for case in cases:
        num_experts = case.w1.size(0)
        moe = _moe_config(parallel, world_size, num_experts, case.topk_ids[0].size(1), case.w1.size(2),
                          case.w2.size(2), max_tokens)
        num_local = moe.num_local_experts
        local = slice(rank * num_local, (rank + 1) * num_local)
        expert_map = torch.full((num_experts,), -1, dtype=torch.int32)
        expert_map[local] = torch.arange(num_local, dtype=torch.int32)
        facts["batched_format"] = moe.moe_parallel_config.use_batched_activation_format
        quant_config = _quant_config(case.block_fp8, num_local)
        w1, w2 = case.w1[local].contiguous(), case.w2[local].contiguous()
        x, ids, weights = case.xs[rank], case.topk_ids[rank], case.topk_weights[rank]
        for path in ("kernel", "sync"):
            pf = all2all_utils.maybe_make_prepare_finalize(moe, quant_config, allow_new_interface=True)
            if pf.activation_format == mk.FusedMoEActivationFormat.Standard:
                experts = standard_cls(moe, quant_config)
            else:
                experts = batched_cls(moe, quant_config, max_num_tokens=pf.max_num_tokens_per_rank(),
                                      num_dispatchers=pf.num_dispatchers())
            if path == "kernel":
                kernel = mk.FusedMoEKernel(pf, experts)
                out = kernel.apply(x, w1, w2, weights, ids, mk.MoEActivation.SILU, num_experts, expert_map, False)
            else:
                pf.post_init_setup(experts)
                out = _run_sync(pf, experts, x, ids, weights, num_experts, expert_map, quant_config, w1, w2)
            outputs[f"{case.name}/{path}"] = out.float().tolist()  # plain data: no shared memory on return
            facts[f"{case.name}/{path}/expert_input"] = getattr(experts, "seen_input", None)
        facts.update(pf_class=type(pf).__name__, activation_format=pf.activation_format.name,
                     topk_indices_dtype=str(pf.topk_indices_dtype()), max_num_tokens=pf.max_num_tokens_per_rank(),
                     num_dispatchers=pf.num_dispatchers(), output_is_reduced=pf.output_is_reduced(),
                     supports_async=pf.supports_async(), backend=pf.buffer.backend_name)
    facts["too_many_tokens_error"] = _too_many_tokens_error(parallel, world_size, cases[0], max_tokens)
    if pf.activation_format == mk.FusedMoEActivationFormat.BatchedExperts:
        facts["finalize_mismatch_error"] = _finalize_mismatch_error(pf, x, ids, weights, num_experts, expert_map,
                                                                    quant_config)
    facts["num_buffers"] = manager.num_buffers
    manager.destroy()
    facts["num_buffers_after_destroy"] = manager.num_buffers
    return {"outputs": outputs, "facts": facts}
