"""benchmarks/torch_grouped_experts.py: Megatron's TEGroupedMLP on torch's grouped_mm, against
Megatron's SequentialMLP with the same weights (real megatron-core, CPU, one gloo rank).

The layer benchmark's `--expert-impl grouped` uses it; this checks that it computes what Megatron's
own experts compute, forward and backward, including an expert with no rows, and that a MoELayer
built with it runs forward and backward.
"""
from __future__ import annotations

import os
import random
import sys

import pytest

import megatron_env

pytestmark = pytest.mark.skipif(not megatron_env.megatron_core_installed(),
                                reason="megatron-core is not installed (.ci/install_megatron.sh)")

BENCHMARKS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")
SEED = int(os.environ.get("EP_TEST_SEED", random.SystemRandom().randrange(1 << 30)))


def _layer(config, experts_builder=None):
    """A real MoELayer (local spec), its experts replaced by `experts_builder` if given; its router on the CPU."""
    import dataclasses

    import megatron_cases  # after megatron_env.prepare(); imports Megatron
    import torch
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer

    spec = get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    submodules = megatron_cases.moe_submodules(spec)
    if experts_builder is not None:
        submodules = dataclasses.replace(submodules, experts=experts_builder)
    torch.manual_seed(0)
    layer = MoELayer(config, submodules)
    megatron_cases.run_router_on_cpu(layer.router)
    return layer


def grouped_vs_sequential_worker(rank: int, world: int, group, seed: int):
    megatron_env.prepare()
    import warnings
    warnings.filterwarnings("ignore")
    import torch
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig

    import ep_plugin.integrations.megatron  # noqa: F401 - registers the ep_plugin dispatcher

    sys.path.insert(0, BENCHMARKS_DIR)
    from torch_grouped_experts import grouped_experts_builder

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=1)
    num_experts, hidden, ffn = 4, 32, 48
    config = TransformerConfig(
        num_layers=1, hidden_size=hidden, ffn_hidden_size=ffn, moe_ffn_hidden_size=ffn, num_attention_heads=4,
        num_moe_experts=num_experts, moe_router_topk=2, moe_token_dispatcher_type="ep_plugin",
        use_cpu_initialization=True, bf16=True, params_dtype=torch.bfloat16, moe_router_dtype="fp32",
        add_bias_linear=False, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
    sequential, grouped = _layer(config), _layer(config, grouped_experts_builder())
    with torch.no_grad():
        for expert, mlp in enumerate(sequential.experts.local_experts):
            grouped.experts.linear_fc1.weight[expert].copy_(mlp.linear_fc1.weight)
            grouped.experts.linear_fc2.weight[expert].copy_(mlp.linear_fc2.weight)

    gen = torch.Generator().manual_seed(seed)
    tokens_per_expert = torch.tensor([5, 0, 9, 3])  # expert 1 gets no rows
    rows = torch.randn(int(tokens_per_expert.sum()), hidden, generator=gen).to(torch.bfloat16)
    probs = torch.rand(rows.size(0), generator=gen)
    grad = torch.randn(rows.size(0), hidden, generator=gen).to(torch.bfloat16)
    results = {}
    for name, layer in (("sequential", sequential), ("grouped", grouped)):
        x, p = rows.clone().requires_grad_(), probs.clone().requires_grad_()
        out, _ = layer.experts(x, tokens_per_expert, p)
        out.backward(grad)
        fc1 = [m.linear_fc1.weight.grad for m in layer.experts.local_experts] if name == "sequential" \
            else list(layer.experts.linear_fc1.weight.grad)
        # Plain lists: tensors would travel back through shared memory that dies with this process.
        results[name] = {"out": out.detach().float().tolist(), "x_grad": x.grad.float().tolist(),
                         "p_grad": p.grad.float().tolist(), "fc1_grad": torch.stack([g.float() for g in fc1]).tolist()}

    # The whole layer (router, ep_plugin's dispatcher on its reference backend, grouped experts) forward and backward.
    hidden_states = torch.randn(8, 2, hidden, generator=gen).to(torch.bfloat16).requires_grad_()
    output, _ = grouped(hidden_states)
    output.backward(torch.randn(output.shape, generator=gen).to(torch.bfloat16))
    results["layer"] = {"output_shape": tuple(output.shape), "input_grad_finite": bool(hidden_states.grad.isfinite().all()),
                        "fc2_grad_norm": float(grouped.experts.linear_fc2.weight.grad.float().norm())}
    return results


def test_grouped_experts_compute_what_sequential_mlp_computes():
    import torch

    results = megatron_env.cpu_launch(1, grouped_vs_sequential_worker, SEED, timeout_s=240)[0]
    sequential = {key: torch.tensor(value) for key, value in results["sequential"].items()}
    grouped = {key: torch.tensor(value) for key, value in results["grouped"].items()}
    for key in ("out", "x_grad", "p_grad", "fc1_grad"):
        # bf16 GEMMs on both sides; fp32 accumulation order may differ between grouped_mm and matmul.
        torch.testing.assert_close(grouped[key], sequential[key], rtol=2e-2, atol=2e-2,
                                   msg=lambda m, key=key: f"{key} (EP_TEST_SEED={SEED}): {m}")
    assert sequential["out"].abs().max() > 0 and sequential["fc1_grad"][1].abs().max() == 0
    layer = results["layer"]
    assert layer["output_shape"] == (8, 2, 32)
    assert layer["input_grad_finite"] and layer["fc2_grad_norm"] > 0
