"""Megatron-Core integration on 2 GPUs: `ep_plugin` (native backend) against Megatron's `alltoall`.

- A whole MoELayer, forward and backward, built twice on the same weights (dispatcher types
  `alltoall` and `ep_plugin`) and fed the same input: outputs, input gradients and every weight
  gradient agree within bf16 tolerance. Layouts: dropless, drop-and-pad, shared-expert overlap.
- A small MoE GPT trained for a few steps with each dispatcher from the same initial weights and
  data: the losses agree step by step.

Needs 2 CUDA GPUs and megatron-core (on the GPU machine: the cp312 wheel, carried); skipped
otherwise. Runs without TransformerEngine (local specs, SequentialMLP experts). One launch runs
every case; each test reports one. Set EP_TEST_SEED to replay a run.
"""
from __future__ import annotations

import os
import random
import traceback
from typing import Dict, List, Optional

import pytest
import torch

import megatron_env
from case_runner import assert_case_passed
from ep_plugin.launch import parallel_launch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="needs 2 CUDA GPUs"),
    pytest.mark.skipif(not megatron_env.megatron_core_installed(), reason="megatron-core is not installed"),
]

BASE_SEED = int(os.environ.get("EP_TEST_SEED", random.SystemRandom().randrange(1 << 30)))
LAYER_CASES = ("dropless", "drop_and_pad", "shared_expert_overlap")
CASES = tuple(f"layer_{name}" for name in LAYER_CASES) + ("gpt_training_losses",)

# Layer sizes: several local experts, a hidden size the native kernels move in whole 16-byte rows.
HIDDEN, FFN, NUM_EXPERTS, TOPK, SEQ, BATCH = 512, 768, 8, 2, 128, 4
# GPT sizes.
GPT_LAYERS, GPT_VOCAB, GPT_SEQ, GPT_BATCH, GPT_STEPS = 2, 512, 64, 4, 6


# ---- set-up (inside the ranks) -------------------------------------------------------------------------
def _setup(seed: int) -> None:
    megatron_env.prepare()
    import warnings
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    import ep_plugin.integrations.megatron  # noqa: F401 - registers 'ep_plugin'

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=2)
    model_parallel_cuda_manual_seed(seed)


def _config(dispatcher: str, **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig
    kwargs = dict(num_layers=1, hidden_size=HIDDEN, ffn_hidden_size=FFN, moe_ffn_hidden_size=FFN,
                  num_attention_heads=8, num_moe_experts=NUM_EXPERTS, moe_router_topk=TOPK,
                  moe_token_dispatcher_type=dispatcher, expert_model_parallel_size=2, bf16=True,
                  params_dtype=torch.bfloat16, moe_router_dtype="fp32", add_bias_linear=False,
                  moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def _moe_submodules(spec):
    """MoESubmodules of a MoE spec: a ModuleSpec up to megatron-core 0.17, a functools.partial from 0.18."""
    import functools
    return spec.keywords["submodules"] if isinstance(spec, functools.partial) else spec.submodules


def _layer(config, seed: int):
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe.moe_layer import MoELayer

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    spec = get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    layer = MoELayer(config, _moe_submodules(spec)).cuda()
    layer.set_layer_number(1)
    return layer


def _assert_close(name: str, actual: Optional[torch.Tensor], expected: Optional[torch.Tensor]) -> None:
    """bf16 tolerance: relative 2e-2, absolute 1e-2 of the largest magnitude (different summation orders);
    and the whole tensor within 2e-2 in norm, which the elementwise bounds alone are too wide to see: a
    uniform 3% error passes them almost everywhere (bf16 rounding gives well under 1e-2 in norm)."""
    if actual is None or expected is None:
        other = actual if actual is not None else expected
        assert other is None or float(other.abs().max()) == 0, f"{name}: one side has no value"
        return
    expected = expected.float()
    scale = max(float(expected.abs().max()), 1e-6)
    torch.testing.assert_close(actual.float(), expected, rtol=2e-2, atol=1e-2 * scale, msg=lambda m: f"{name}: {m}")
    error, size = float((actual.float() - expected).norm()), float(expected.norm())
    assert error <= 2e-2 * size, f"{name}: relative error {error / size:.3g} in norm, more than 2e-2"


# ---- cases ------------------------------------------------------------------------------------------
def _layer_case(name: str, seed: int) -> None:
    from ep_plugin.integrations.megatron import EpPluginTokenDispatcher

    overrides = {
        "dropless": {},
        "drop_and_pad": dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True),
        "shared_expert_overlap": dict(moe_shared_expert_intermediate_size=FFN, moe_shared_expert_overlap=True),
    }[name]
    reference = _layer(_config("alltoall", **overrides), seed)
    layer = _layer(_config("ep_plugin", **overrides), seed)
    layer.load_state_dict(reference.state_dict())
    assert isinstance(layer.token_dispatcher, EpPluginTokenDispatcher)
    assert layer.token_dispatcher.buffer.backend_name == "native", layer.token_dispatcher.buffer.backend_name

    gen = torch.Generator(device="cuda").manual_seed(seed * 7 + torch.distributed.get_rank())
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
    grad_output = torch.randn(SEQ, BATCH, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
    results = []
    for module in (reference, layer):
        x = hidden.clone().requires_grad_()
        output, _ = module(x)
        torch.autograd.backward(output, grad_output)
        results.append((output.detach(), x.grad, {n: p.grad for n, p in module.named_parameters()}))
    torch.cuda.synchronize()
    (out_ref, grad_ref, params_ref), (out, grad, params) = results
    _assert_close("output", out, out_ref)
    _assert_close("input gradient", grad, grad_ref)
    for param_name, param_grad in params_ref.items():
        _assert_close(f"gradient of {param_name}", params[param_name], param_grad)


def _reset_moe_metrics() -> None:
    """Forget Megatron's per-layer aux-loss metrics: the tracker sizes each metric by the num_layers of its first
    record (1, from the layer cases), and a later 2-layer model's second layer would index past it."""
    try:
        from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker  # 0.19+
        destroy_moe_metrics_tracker()
    except ImportError:
        from megatron.core import parallel_state
        getattr(parallel_state, "_MOE_LAYER_WISE_LOGGING_TRACKER", {}).clear()


def _gpt(dispatcher: str, seed: int):
    """A small MoE GPT (local spec), wrapped in Float16Module as Megatron-LM does for bf16 training."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    _reset_moe_metrics()
    # No dropout: both runs must see the same function (their RNG streams differ).
    config = _config(dispatcher, num_layers=GPT_LAYERS, num_moe_experts=4, hidden_size=256, ffn_hidden_size=512,
                     moe_ffn_hidden_size=512, num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=GPT_VOCAB, max_sequence_length=GPT_SEQ)
    return Float16Module(config, model.cuda())


def _train(model, seed: int) -> List[float]:
    """GPT_STEPS Adam steps on one fixed random batch; dense gradients averaged over the data-parallel group
    (expert gradients stay: expert data parallelism is 1 here). Returns the global mean loss per step."""
    from megatron.core import parallel_state

    dp_group = parallel_state.get_data_parallel_group()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator(device="cuda").manual_seed(seed * 13 + torch.distributed.get_rank())
    position_ids = torch.arange(GPT_SEQ, device="cuda").unsqueeze(0).expand(GPT_BATCH, -1)
    # One fixed batch, seen every step: uniform random tokens are unlearnable (fresh ones each step keep
    # the loss at ln(vocab) or above), but a fixed batch is memorised, so the loss must go down.
    tokens = torch.randint(0, GPT_VOCAB, (GPT_BATCH, GPT_SEQ + 1), generator=gen, device="cuda")
    losses = []
    for _ in range(GPT_STEPS):
        loss = model(tokens[:, :-1], position_ids, None, labels=tokens[:, 1:]).float().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        for param in model.parameters():
            if param.grad is not None and getattr(param, "allreduce", True):
                torch.distributed.all_reduce(param.grad, group=dp_group)
                param.grad /= torch.distributed.get_world_size(dp_group)
        optimizer.step()
        global_loss = loss.detach().clone()
        torch.distributed.all_reduce(global_loss)
        losses.append(float(global_loss) / torch.distributed.get_world_size())
    return losses


def _gpt_training_case(seed: int) -> None:
    reference = _gpt("alltoall", seed)
    initial = {name: tensor.clone() for name, tensor in reference.state_dict().items()
               if isinstance(tensor, torch.Tensor)}
    reference_losses = _train(reference, seed)
    del reference
    model = _gpt("ep_plugin", seed)
    model.load_state_dict(initial, strict=False)
    losses = _train(model, seed)
    assert losses[-1] < losses[0], f"ep_plugin: the loss did not go down: {losses}"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference_losses), rtol=2e-2, atol=2e-2,
                               msg=lambda m: f"losses {losses} vs alltoall {reference_losses}: {m}")


def gpu_worker(rank: int, world: int, group, seed: int) -> Dict[str, Optional[str]]:
    """Run every case on this rank; case -> None (passed) or the failure's traceback."""
    _setup(seed)
    results: Dict[str, Optional[str]] = {}
    for case in CASES:
        try:
            if case.startswith("layer_"):
                _layer_case(case[len("layer_"):], seed)
            else:
                _gpt_training_case(seed)
            results[case] = None
        except Exception:  # noqa: BLE001 - reported per case
            results[case] = traceback.format_exc()
        torch.distributed.barrier()
    return results


# ---- pytest -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def launch():
    # 180 s per collective, 240 s for the results: inside the 300 s that benchmarks/gpu_session.sh gives this file,
    # so a hang is reported (and the ranks ended) before the outer timeout kills pytest without a word.
    # The ranks run as Megatron-LM launches them: every stream of a process on one hardware queue.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # the spawned ranks inherit it
        return parallel_launch(2, gpu_worker, BASE_SEED, timeout_s=180)


@pytest.mark.parametrize("case", CASES)
def test_megatron_gpu(launch, case):
    assert_case_passed(launch, case, f"EP_TEST_SEED={BASE_SEED}")
