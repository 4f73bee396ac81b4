"""The Megatron integration's CPU cases: real megatron-core, gloo, ep_plugin's reference backend.

Imported only inside spawned ranks (tests/test_megatron_integration.py): it imports Megatron at
module level, after `megatron_env.prepare()`. Each rank runs every case of its world size and
reports per case; data is random each run (seeded from the test's seed).

Layouts: 2 ranks = EP 2; 4 ranks = EP 2 x expert-TP 2 (the TP x EP group Megatron's flex
dispatcher uses). Oracles: the rows each local expert must receive come from all-gathering every
rank's tokens and routing map (exact equality); the layer's output and gradients come from a dense
MoE built from the same Megatron modules (every expert sees every token, weighted by its prob).
"""
from __future__ import annotations

import contextlib
import copy
import functools
import io
import math
import os
import sys
import tempfile
import traceback
import warnings
from typing import Callable, Dict, List, Optional, Tuple

import megatron_env

megatron_env.prepare()
warnings.filterwarnings("ignore")  # Megatron warns about missing TE / Apex / absl on import

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.nn.functional as dist_nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec  # noqa: E402
from megatron.core.transformer.moe import moe_layer as megatron_moe_layer  # noqa: E402
from megatron.core.transformer.moe.moe_layer import MoELayer  # noqa: E402
from megatron.core.transformer.moe.moe_utils import (  # noqa: E402
    get_align_size_for_quantization, get_capacity, get_default_pg_collection)
from megatron.core.transformer.moe.token_dispatcher import (  # noqa: E402
    MoEAllGatherTokenDispatcher, MoEAlltoAllTokenDispatcher)
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

import ep_plugin.integrations.megatron as ep_megatron  # noqa: E402
from ep_plugin.integrations.megatron import EpPluginTokenDispatcher, MegatronVersionError  # noqa: E402
from ep_plugin.integrations.megatron import _compat, buffers  # noqa: E402

HIDDEN = 32
FFN = 48
NUM_EXPERTS = 8
TOPK = 2
SEQ, BATCH = 8, 4          # 32 tokens per rank
BF16 = torch.bfloat16

CASES = ("dropless", "router_probs_grad", "capacity", "drop_and_pad", "drop_and_pad_many_experts",
         "router_padding", "moe_layer_vs_dense", "moe_layer_one_ep_rank_idle", "registration", "cli")


# ---- set-up -----------------------------------------------------------------------------------------
class Ctx:
    """One rank's view: model-parallel groups, seeds, the TP x EP group."""

    def __init__(self, rank: int, world: int, seed: int, expert_tp: int) -> None:
        self.rank, self.world, self.seed, self.etp = rank, world, seed, expert_tp
        self.ep = world // expert_tp
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, expert_model_parallel_size=self.ep,
                                                 expert_tensor_parallel_size=expert_tp)
        self.group = parallel_state.get_expert_tensor_and_model_parallel_group()
        self.group_rank = dist.get_rank(self.group)

    def generator(self, case_id: int, shared: bool = False) -> torch.Generator:
        """Per-rank data, or (shared) the same stream on every rank."""
        return torch.Generator().manual_seed(self.seed * 1009 + case_id * 101 + (0 if shared else 1 + self.rank))

    def config(self, **overrides) -> TransformerConfig:
        kwargs = dict(num_layers=1, hidden_size=HIDDEN, ffn_hidden_size=FFN, moe_ffn_hidden_size=FFN,
                      num_attention_heads=4, num_moe_experts=NUM_EXPERTS, moe_router_topk=TOPK,
                      moe_token_dispatcher_type="ep_plugin", expert_model_parallel_size=self.ep,
                      expert_tensor_parallel_size=self.etp, use_cpu_initialization=True, bf16=True,
                      params_dtype=BF16, moe_router_dtype="fp32", add_bias_linear=False,
                      moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
        kwargs.update(overrides)
        return TransformerConfig(**kwargs)

    def layer(self, config: TransformerConfig, logit_bias: Optional[torch.Tensor] = None) -> MoELayer:
        """A real MoELayer (local spec: SequentialMLP experts); identical weights on every run of a seed."""
        torch.manual_seed(self.seed)
        spec = get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts, moe_grouped_gemm=False)
        layer = MoELayer(config, moe_submodules(spec))
        run_router_on_cpu(layer.router, logit_bias)
        return layer


def moe_submodules(spec):
    """MoESubmodules of a MoE spec: a ModuleSpec up to megatron-core 0.17, a functools.partial from 0.18."""
    return spec.keywords["submodules"] if isinstance(spec, functools.partial) else spec.submodules


def run_router_on_cpu(router, logit_bias: Optional[torch.Tensor] = None) -> None:
    """Megatron's TopKRouter.gating moves CPU weights to CUDA; compute the same fp32 logits on the CPU
    (plus an optional per-expert bias that steers the routing)."""
    def gating(hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden.float(), router.weight.float())
        return logits if logit_bias is None else logits + logit_bias
    router.gating = gating


def random_bf16(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(BF16)


def permute(dispatcher, hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
    """Megatron's dispatch half: -> (permuted tokens [M, H], tokens_per_expert [E_local], permuted probs [M])."""
    hidden, probs = dispatcher.dispatch_preprocess(hidden, routing_map, probs)
    hidden, probs = dispatcher.token_dispatch(hidden, probs)
    return dispatcher.dispatch_postprocess(hidden, probs)


def unpermute(dispatcher, hidden: torch.Tensor) -> torch.Tensor:
    """Megatron's combine half: expert outputs [M, H] -> the input's shape."""
    hidden = dispatcher.combine_preprocess(hidden)
    hidden = dispatcher.token_combine(hidden)
    return dispatcher.combine_postprocess(hidden)


def scale_by_probs(permuted: torch.Tensor, permuted_probs: torch.Tensor, divisor: int = 1) -> torch.Tensor:
    """What the experts do with the probs (here: no weights), in the hidden dtype."""
    return (permuted.float() * permuted_probs.unsqueeze(-1) / divisor).to(permuted.dtype)


# ---- oracles -----------------------------------------------------------------------------------------
def gather(ctx: Ctx, tensor: torch.Tensor) -> List[torch.Tensor]:
    """All-gather over the TP x EP group, in group-rank order (float32/int64 on the wire for gloo)."""
    wire = tensor.to(torch.int64 if tensor.dtype == torch.bool else torch.float32).contiguous()
    parts = [torch.empty_like(wire) for _ in range(ctx.world)]
    dist.all_gather(parts, wire, group=ctx.group)
    return [part.to(tensor.dtype) for part in parts]


def expected_permutation(ctx: Ctx, dispatcher, tokens: torch.Tensor, routing_map: torch.Tensor,
                         probs: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows per local expert as the dispatcher defines them: expert by expert, then by source rank of the
    TP x EP group, then by source token. Returns (rows [M, H], probs [M], tokens_per_expert [E_local])."""
    all_tokens = gather(ctx, tokens.reshape(-1, tokens.size(-1)))
    all_maps, all_probs = gather(ctx, routing_map), gather(ctx, probs.float())
    rows, row_probs, counts = [], [], []
    for expert in dispatcher.local_expert_indices:
        count = 0
        for source in range(ctx.world):
            selected = all_maps[source][:, expert]
            rows.append(all_tokens[source][selected])
            row_probs.append(all_probs[source][selected, expert])
            count += int(selected.sum())
        counts.append(count)
    return torch.cat(rows), torch.cat(row_probs), torch.tensor(counts, dtype=torch.long)


def dense_moe(ctx: Ctx, layer: MoELayer, hidden: torch.Tensor) -> torch.Tensor:
    """The layer's output computed densely with its own router and experts: every local expert runs on
    every token of the TP x EP group, weighted by its prob (0 where not routed); the partial outputs are
    summed over the group. Differentiable (torch.distributed.nn collectives)."""
    probs, _ = layer.router(hidden)
    tokens = hidden.reshape(-1, hidden.size(-1))
    num_tokens = tokens.size(0)
    all_tokens = torch.cat(dist_nn.all_gather(tokens.float().contiguous(), group=ctx.group)).to(tokens.dtype)
    all_probs = torch.cat(dist_nn.all_gather(probs.float().contiguous(), group=ctx.group))
    dispatcher = layer.token_dispatcher
    num_local, num_rows = dispatcher.num_local_experts, all_tokens.size(0)
    expert_input = all_tokens.repeat(num_local, 1)
    expert_probs = torch.cat([all_probs[:, expert] for expert in dispatcher.local_expert_indices])
    output, _ = layer.experts(expert_input, torch.full((num_local,), num_rows, dtype=torch.long), expert_probs)
    partial = output.float().view(num_local, num_rows, -1).sum(dim=0)
    total = dist_nn.all_reduce(partial, group=ctx.group)
    mine = total[ctx.group_rank * num_tokens:(ctx.group_rank + 1) * num_tokens]
    return mine.to(hidden.dtype).view_as(hidden)


# ---- checks ------------------------------------------------------------------------------------------
def assert_equal(name: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Same dtype, shape and values."""
    assert actual.dtype == expected.dtype, f"{name}: dtype {actual.dtype}, expected {expected.dtype}"
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    if not torch.equal(actual, expected):
        bad = (actual != expected).nonzero()[:5].tolist()
        raise AssertionError(f"{name}: differs at {bad} (first 5)")


def assert_close_bf16(name: str, actual: Optional[torch.Tensor], expected: Optional[torch.Tensor]) -> None:
    """Within bf16 rounding of a few sums: relative 2e-2, absolute 1e-2 of the largest magnitude."""
    if actual is None or expected is None:
        assert actual is None and expected is None or \
            (actual if actual is not None else expected).abs().max() == 0, f"{name}: one side has no value"
        return
    expected = expected.float()
    scale = max(float(expected.abs().max()), 1e-6)
    torch.testing.assert_close(actual.float(), expected, rtol=2e-2, atol=1e-2 * scale, msg=lambda m: f"{name}: {m}")


def expect_error(kind: type, fragment: str, fn: Callable) -> BaseException:
    try:
        fn()
    except kind as error:
        text = str(error) + "".join(getattr(error, "__notes__", []))
        assert fragment in text, f"expected {kind.__name__} mentioning {fragment!r}, got: {text}"
        return error
    raise AssertionError(f"expected {kind.__name__} mentioning {fragment!r}, nothing was raised")


# ---- cases: Megatron's dispatcher checks ----------------------------------------------------------
def case_dropless(ctx: Ctx) -> None:
    """Permute, scale by probs, unpermute gives back the input; the backward gives the input as gradient;
    every local expert receives exactly the rows the routing maps of the group send it."""
    layer = ctx.layer(ctx.config())
    dispatcher = layer.token_dispatcher
    assert isinstance(dispatcher, EpPluginTokenDispatcher), type(dispatcher)
    gen = ctx.generator(1)
    hidden = random_bf16(gen, SEQ, BATCH, HIDDEN).requires_grad_()
    _, routing_map = layer.router.routing(torch.randn(SEQ, BATCH, NUM_EXPERTS, generator=gen))
    probs = routing_map.float() / TOPK

    permuted, tokens_per_expert, permuted_probs = permute(dispatcher, hidden, probs, routing_map)
    rows, row_probs, counts = expected_permutation(ctx, dispatcher, hidden.detach(), routing_map, probs)
    assert_equal("tokens_per_expert", tokens_per_expert, counts)
    assert_equal("permuted tokens", permuted.detach(), rows)
    assert_equal("permuted probs", permuted_probs.detach(), row_probs)

    restored = unpermute(dispatcher, scale_by_probs(permuted, permuted_probs))
    # Each expert-TP rank of an expert sends its copy back: the combine sums ETP copies.
    restored = restored / ctx.etp
    torch.testing.assert_close(restored, hidden.detach(), rtol=0, atol=0)
    torch.autograd.backward(restored, hidden.detach())
    torch.testing.assert_close(hidden.grad, hidden.detach(), rtol=0, atol=0)


def case_router_probs_grad(ctx: Ctx) -> None:
    """With the router's own probs and "experts" that scale their rows by (global expert id + 1):
    output = ETP * x * sum_e (e + 1) probs_e, and the gradients of the input and of the router logits
    (through the probs carried by dispatch) match the same function computed locally."""
    layer = ctx.layer(ctx.config())
    dispatcher = layer.token_dispatcher
    gen = ctx.generator(2)
    hidden = random_bf16(gen, SEQ, BATCH, HIDDEN).requires_grad_()
    logits = torch.randn(SEQ, BATCH, NUM_EXPERTS, generator=gen).requires_grad_()
    grad_output = torch.randn(SEQ, BATCH, HIDDEN, generator=gen)

    probs, routing_map = layer.router.routing(logits)
    permuted, tokens_per_expert, permuted_probs = permute(dispatcher, hidden, probs, routing_map)
    expert_of_row = torch.tensor(dispatcher.local_expert_indices).repeat_interleave(tokens_per_expert)
    output = unpermute(dispatcher, scale_by_probs(permuted, permuted_probs * (expert_of_row + 1)))
    torch.autograd.backward(output, grad_output.to(output.dtype))

    hidden_ref = hidden.detach().clone().requires_grad_()
    logits_ref = logits.detach().clone().requires_grad_()
    probs_ref, _ = layer.router.routing(logits_ref)
    factor = (probs_ref * torch.arange(1, NUM_EXPERTS + 1)).sum(dim=-1).view(SEQ, BATCH, 1)
    output_ref = ctx.etp * hidden_ref.float() * factor
    torch.autograd.backward(output_ref, grad_output)
    assert logits.grad is not None and float(logits_ref.grad.abs().max()) > 0
    assert_close_bf16("output", output, output_ref)
    assert_close_bf16("input gradient", hidden.grad, hidden_ref.grad)
    assert_close_bf16("logits gradient", logits.grad, logits_ref.grad)


def case_capacity(ctx: Ctx) -> None:
    """Capacity factor without padding: tokens over capacity are dropped; tokens_per_expert <= capacity x
    EP x TP (and exactly the rows sent); the output and gradient are x * sum(probs of the kept experts)."""
    capacity_factor = 0.5
    layer = ctx.layer(ctx.config(moe_expert_capacity_factor=capacity_factor))
    dispatcher = layer.token_dispatcher
    gen = ctx.generator(3)
    hidden = random_bf16(gen, SEQ, BATCH, HIDDEN).requires_grad_()
    probs, routing_map = layer.router.routing(torch.randn(SEQ, BATCH, NUM_EXPERTS, generator=gen))
    num_tokens = SEQ * BATCH
    assert int(routing_map.sum()) < num_tokens * TOPK, "the capacity factor dropped nothing"
    probs = routing_map.float() / TOPK
    answer = hidden.detach().float() * probs.sum(dim=1).view(SEQ, BATCH, 1)

    permuted, tokens_per_expert, permuted_probs = permute(dispatcher, hidden, probs, routing_map)
    capacity = get_capacity(num_tokens * TOPK, NUM_EXPERTS, capacity_factor)
    assert bool((tokens_per_expert <= capacity * ctx.ep * ctx.etp).all()), tokens_per_expert
    _, _, counts = expected_permutation(ctx, dispatcher, hidden.detach(), routing_map, probs)
    assert_equal("tokens_per_expert", tokens_per_expert, counts)

    restored = unpermute(dispatcher, scale_by_probs(permuted, permuted_probs, ctx.etp))
    assert_close_bf16("restored", restored, answer)
    torch.autograd.backward(restored, hidden.detach())
    assert_close_bf16("gradient", hidden.grad, answer)


def case_drop_and_pad(ctx: Ctx) -> None:
    """Drop-and-pad gives every expert exactly capacity x EP x TP rows, and (padding rows having prob 0)
    the same output and gradient as dropping without padding."""
    capacity_factor = 0.5
    layer = ctx.layer(ctx.config(moe_expert_capacity_factor=capacity_factor))
    padded_layer = ctx.layer(ctx.config(moe_expert_capacity_factor=capacity_factor,
                                        moe_pad_expert_input_to_capacity=True))
    padded_layer.load_state_dict(layer.state_dict())
    gen = ctx.generator(4)
    hidden = random_bf16(gen, SEQ, BATCH, HIDDEN).requires_grad_()
    logits = torch.randn(SEQ, BATCH, NUM_EXPERTS, generator=gen)

    probs, routing_map = layer.router.routing(logits)
    permuted, _, permuted_probs = permute(layer.token_dispatcher, hidden, probs, routing_map)
    answer = unpermute(layer.token_dispatcher, scale_by_probs(permuted, permuted_probs))
    torch.autograd.backward(answer, answer.detach())
    grad_answer, hidden.grad = hidden.grad.clone(), None

    dispatcher = padded_layer.token_dispatcher
    probs, routing_map = padded_layer.router.routing(logits)
    permuted, tokens_per_expert, permuted_probs = permute(dispatcher, hidden, probs, routing_map)
    capacity = get_capacity(SEQ * BATCH * TOPK, NUM_EXPERTS, capacity_factor)
    assert_equal("tokens_per_expert", tokens_per_expert,
                 torch.full((dispatcher.num_local_experts,), capacity * ctx.ep * ctx.etp, dtype=torch.long))
    restored = unpermute(dispatcher, scale_by_probs(permuted, permuted_probs))
    assert_close_bf16("restored", restored, answer)
    torch.autograd.backward(restored, restored.detach())
    assert_close_bf16("gradient", hidden.grad, grad_answer)


def case_drop_and_pad_many_experts(ctx: Ctx) -> None:
    """Drop-and-pad with TP x E > 32: the dispatcher sizes its top-k from the group's busiest token (an
    all-reduce); a token padded into more than 32 experts is a clear error on every rank."""
    num_experts = 64
    layer = ctx.layer(ctx.config(num_moe_experts=num_experts, moe_expert_capacity_factor=1.0,
                                 moe_pad_expert_input_to_capacity=True))
    dispatcher = layer.token_dispatcher
    assert dispatcher.num_slots is None
    gen = ctx.generator(5)
    num_tokens = SEQ * BATCH
    hidden = random_bf16(gen, num_tokens, HIDDEN).requires_grad_()
    # A padded routing map: each token in 1..12 experts (as padding to capacity spreads tokens).
    experts_per_token = torch.randint(1, 13, (num_tokens, 1), generator=gen)
    order = torch.rand(num_tokens, num_experts, generator=gen).argsort(dim=1)
    routing_map = order < experts_per_token
    probs = routing_map.float() / experts_per_token

    permuted, tokens_per_expert, permuted_probs = permute(dispatcher, hidden, probs, routing_map)
    _, _, counts = expected_permutation(ctx, dispatcher, hidden.detach(), routing_map, probs)
    assert_equal("tokens_per_expert", tokens_per_expert, counts)
    restored = unpermute(dispatcher, scale_by_probs(permuted, permuted_probs, ctx.etp))
    assert_close_bf16("restored", restored, hidden.detach())
    torch.autograd.backward(restored, hidden.detach())
    assert_close_bf16("gradient", hidden.grad, hidden.detach())

    crowded = routing_map.clone()
    if ctx.rank == ctx.world - 1:
        crowded[0, :40 // ctx.etp + 1] = True  # after expert-TP widening: more than 40 slots
    expect_error(ValueError, "carries at most 32", lambda: permute(dispatcher, hidden, probs, crowded))


def case_router_padding(ctx: Ctx) -> None:
    """Router padding for FP8: each local expert's rows are padded to a multiple of the FP8 alignment with
    prob-0 rows; output and gradient equal the unpadded ones.

    FP8 configs need TransformerEngine at construction, but the padding path only reads the config's
    flags: the padding dispatcher gets a copy of a validated config with `fp8` and
    `moe_router_padding_for_quantization` set."""
    layer = ctx.layer(ctx.config())
    padded_config = copy.copy(layer.config)
    padded_config.fp8 = "hybrid"
    padded_config.moe_router_padding_for_quantization = True
    align = get_align_size_for_quantization(padded_config)
    assert align == 16, align
    padded = EpPluginTokenDispatcher(layer.num_local_experts, layer.local_expert_indices, padded_config,
                                     pg_collection=get_default_pg_collection())
    gen = ctx.generator(6)
    num_tokens = 64
    hidden = random_bf16(gen, num_tokens, HIDDEN).requires_grad_()
    probs, routing_map = layer.router.routing(torch.randn(num_tokens, 1, NUM_EXPERTS, generator=gen))

    permuted, tokens_per_expert, permuted_probs = permute(layer.token_dispatcher, hidden, probs, routing_map)
    answer = unpermute(layer.token_dispatcher, scale_by_probs(permuted, permuted_probs))
    torch.autograd.backward(answer, answer.detach())
    grad_answer, hidden.grad = hidden.grad.clone(), None

    permuted_p, tokens_per_expert_p, permuted_probs_p = permute(padded, hidden, probs, routing_map)
    num_received = padded._state.recv_topk_idx.size(0)
    targets = (tokens_per_expert + align - 1) // align * align
    expected = targets if bool((targets <= num_received).all()) else tokens_per_expert
    assert_equal("padded tokens_per_expert", tokens_per_expert_p, expected)
    assert int(tokens_per_expert_p.sum()) == permuted_p.size(0)
    assert bool((permuted_probs_p.sum() - permuted_probs.sum()).abs() < 1e-4), "padding rows must have prob 0"
    restored = unpermute(padded, scale_by_probs(permuted_p, permuted_probs_p))
    assert_close_bf16("restored", restored, answer)
    torch.autograd.backward(restored, restored.detach())
    assert_close_bf16("gradient", hidden.grad, grad_answer)


# ---- cases: the whole MoELayer --------------------------------------------------------------------
def _layer_against_dense(ctx: Ctx, case_id: int, logit_bias: Optional[torch.Tensor]) -> None:
    layer = ctx.layer(ctx.config(), logit_bias)
    assert isinstance(layer.token_dispatcher, EpPluginTokenDispatcher)
    gen = ctx.generator(case_id)
    hidden = random_bf16(gen, SEQ, BATCH, HIDDEN).requires_grad_()
    grad_output = torch.randn(SEQ, BATCH, HIDDEN, generator=gen)

    output, bias = layer(hidden)
    assert bias is None
    torch.autograd.backward(output, grad_output.to(output.dtype))
    grads = {name: param.grad for name, param in layer.named_parameters()}
    assert grads["router.weight"] is not None, "no gradient reached the router through the dispatcher"
    layer.zero_grad(set_to_none=True)

    hidden_ref = hidden.detach().clone().requires_grad_()
    output_ref = dense_moe(ctx, layer, hidden_ref)
    torch.autograd.backward(output_ref, grad_output.to(output_ref.dtype))
    assert_close_bf16("output", output, output_ref)
    assert_close_bf16("input gradient", hidden.grad, hidden_ref.grad)
    for name, param in layer.named_parameters():
        assert_close_bf16(f"gradient of {name}", grads[name], param.grad)


def case_moe_layer_vs_dense(ctx: Ctx) -> None:
    """MoELayer forward and backward with moe_token_dispatcher_type='ep_plugin' equals the dense MoE."""
    _layer_against_dense(ctx, 7, None)


def case_moe_layer_one_ep_rank_idle(ctx: Ctx) -> None:
    """Every token routed to the first EP rank's experts: the other EP rank receives no rows."""
    bias = torch.zeros(NUM_EXPERTS)
    bias[:NUM_EXPERTS // ctx.ep] = 50.0
    _layer_against_dense(ctx, 8, bias)


# ---- cases: registration and command line --------------------------------------------------------
def case_registration(ctx: Ctx) -> None:
    """The config checks that list dispatcher types accept 'ep_plugin' (validated as 'alltoall'); MoELayer
    builds our dispatcher and leaves the other types alone; unregister/register; versions; bad input."""
    assert ep_megatron.is_registered()
    overlap = dict(moe_shared_expert_intermediate_size=64, moe_shared_expert_overlap=True)
    config = ctx.config(**overlap)
    assert config.moe_token_dispatcher_type == "ep_plugin"
    expect_error(ValueError, "moe_shared_expert_overlap", lambda: ctx.config(moe_token_dispatcher_type="allgather",
                                                                             **overlap))
    # Megatron paths that branch on the dispatcher type and that ep_plugin refuses (docs/megatron.md).
    expect_error(ValueError, "does not support overlap_moe_expert_parallel_comm=True",
                 lambda: ctx.config(overlap_moe_expert_parallel_comm=True))
    assert ctx.config(moe_token_dispatcher_type="alltoall", overlap_moe_expert_parallel_comm=True)
    expect_error(AssertionError, "alltoall/flex", lambda: ctx.config(moe_token_dispatcher_type="allgather",
                                                                     overlap_moe_expert_parallel_comm=True))
    for modules, covered in ((["moe_router", "moe_preprocess"], "moe_router, moe_preprocess"), ([], "the whole layer")):
        expect_error(ValueError, f"cannot run inside a CUDA graph (cuda_graph_impl='local' capturing {covered})",
                     lambda: ctx.config(cuda_graph_impl="local", cuda_graph_modules=modules))
        assert ctx.config(moe_token_dispatcher_type="alltoall", cuda_graph_impl="local", cuda_graph_modules=modules)
    assert ctx.config(cuda_graph_impl="local", cuda_graph_modules=["attn"]).cuda_graph_impl == "local"
    expect_error(ValueError, "validated like 'alltoall'", lambda: ctx.config(moe_router_padding_for_quantization=True))

    layer = ctx.layer(ctx.config())
    assert isinstance(layer.token_dispatcher, EpPluginTokenDispatcher)
    assert layer.config.moe_token_dispatcher_type == "ep_plugin"
    assert megatron_moe_layer.MoEAlltoAllTokenDispatcher is MoEAlltoAllTokenDispatcher, "patch not undone"
    other = ctx.layer(ctx.config(moe_token_dispatcher_type="allgather"))
    assert type(other.token_dispatcher) is MoEAllGatherTokenDispatcher

    ep_megatron.unregister()
    try:
        assert not ep_megatron.is_registered()
        expect_error(ValueError, "Unsupported token dispatcher type", lambda: ctx.layer(ctx.config()))
    finally:
        ep_megatron.register()
    assert isinstance(ctx.layer(ctx.config()).token_dispatcher, EpPluginTokenDispatcher)

    for bad in ("0.15.3", "0.20.0rc1", "1.0"):
        expect_error(MegatronVersionError, "supports megatron-core 0.16.x to 0.19.x", lambda: _compat.check_version(bad))
    for good in ("0.16.0", "0.19.2+f6a5b40"):
        _compat.check_version(good)
    os.environ[_compat.RELEASES.allow_untested_env] = "1"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _compat.check_version("0.20.0")
        assert any("0.20.0" in str(w.message) for w in caught)
    finally:
        del os.environ[_compat.RELEASES.allow_untested_env]
    _compat.check_surface()
    # The version is the imported code's (package_info travels with a source tree), not the wheel's metadata.
    from megatron.core import package_info
    installed = package_info.__version__
    package_info.__version__ = "0.20.0"
    try:
        expect_error(MegatronVersionError, "found 0.20.0", _compat.check_version)
    finally:
        package_info.__version__ = installed

    expect_error(ValueError, "multiple of 8", lambda: ctx.layer(ctx.config(hidden_size=20, moe_ffn_hidden_size=FFN)))
    expect_error(ValueError, "top-k limit", lambda: ctx.layer(ctx.config(num_moe_experts=64,
                                                                         moe_router_topk=32 // ctx.etp + 1)))
    ep_megatron.register(config={"mode": "low_latency"})
    try:
        expect_error(ValueError, "normal mode", lambda: ctx.layer(ctx.config()))
    finally:
        ep_megatron.register(config=None)


def case_cli(ctx: Ctx) -> None:
    """Megatron-LM's own parser (patched when megatron.training.arguments is imported) accepts
    `--moe-token-dispatcher-type ep_plugin --ep-plugin-config FILE`; the dispatcher's buffers use FILE;
    validate_args and core_transformer_config_from_args build a TransformerConfig of type ep_plugin."""
    from megatron.training import arguments

    assert getattr(arguments.add_megatron_arguments, "_ep_plugin_wrapper", False), "parser builder not wrapped"
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "ep.yaml")
        with open(path, "w") as file:
            file.write("mode: normal\nbackend: reference\nnum_sms: 8\n")
        argv = ["pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                "--num-experts", "4", "--seq-length", "32", "--max-position-embeddings", "32",
                "--micro-batch-size", "1", "--moe-token-dispatcher-type", "ep_plugin", "--ep-plugin-config", path]
        args = _parse(arguments, argv)
        assert args.moe_token_dispatcher_type == "ep_plugin" and args.ep_plugin_config == path
        settings = ep_megatron.resolve_config()
        assert settings.source == path and settings.num_sms == 8, settings
        with _environment(RANK="0", WORLD_SIZE="1"), contextlib.redirect_stdout(io.StringIO()):
            arguments.validate_args(args)
            config = arguments.core_transformer_config_from_args(args)
        assert config.moe_token_dispatcher_type == "ep_plugin" and config.num_moe_experts == 4

        bad = argv[:-4] + ["--moe-token-dispatcher-type", "bogus"]
        expect_error(SystemExit, "2", lambda: _parse(arguments, bad))
        ep_megatron.unregister()
        try:
            expect_error(SystemExit, "2", lambda: _parse(arguments, argv))
        finally:
            ep_megatron.register()
        assert _parse(arguments, argv).moe_token_dispatcher_type == "ep_plugin"
        buffers.set_cli_config_path(None)


def _parse(arguments, argv: List[str]):
    saved = sys.argv
    sys.argv = argv
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return arguments.parse_args()
    finally:
        sys.argv = saved


@contextlib.contextmanager
def _environment(**values: str):
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


# ---- the worker -------------------------------------------------------------------------------------
def _cases(ctx: Ctx) -> Dict[str, Callable[[], None]]:
    return {name: functools.partial(globals()[f"case_{name}"], ctx) for name in CASES}


def run_all(rank: int, world: int, group, seed: int, expert_tp: int) -> Dict[str, Optional[str]]:
    """Run every case on this rank; case -> None (passed) or the failure's traceback.

    A failing case is followed by a barrier so that the ranks stay in step for the next one."""
    ctx = Ctx(rank, world, seed, expert_tp)
    results: Dict[str, Optional[str]] = {}
    for name, case in _cases(ctx).items():
        try:
            case()
            results[name] = None
        except Exception:  # noqa: BLE001 - reported per case
            results[name] = traceback.format_exc()
        dist.barrier()
    return results
