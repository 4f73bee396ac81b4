"""One training step of a Megatron-Core MoE layer whose tokens move through ep_plugin.

    torchrun --nproc-per-node 2 examples/megatron_moe_layer.py      # GPUs (NCCL) or CPU (gloo)

`import ep_plugin.integrations.megatron` registers the dispatcher type; the layer is Megatron's own
`MoELayer` built with `moe_token_dispatcher_type="ep_plugin"` (Megatron-LM scripts take
`--moe-token-dispatcher-type ep_plugin` through `python -m ep_plugin.integrations.megatron`; see
docs/megatron.md). The step runs forward and backward; the forward output is compared with the
same layer computed densely (every local expert on every token of the group, weighted by its
router probability), and the script exits non-zero if they differ. Expert parallelism = ranks.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F


def import_ep_plugin():
    """ep_plugin, or a clear exit where a folder named ep_plugin (a clone) shadows the package."""
    import ep_plugin
    if getattr(ep_plugin, "__file__", None) is None:  # a namespace package: a folder without __init__.py
        sys.exit(f"`import ep_plugin` found the folder {list(ep_plugin.__path__)[0]}, not the package: run this "
                 "script from another directory, or install ep_plugin (pip install --no-build-isolation .) and "
                 "rename the clone")
    return ep_plugin


def import_megatron():
    try:
        warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|TE).*")
        import megatron.core  # noqa: F401
    except ImportError as error:
        sys.exit(f"this example needs megatron-core 0.16 to 0.19 (pip install megatron-core): {error}")
    import ep_plugin.integrations.megatron  # noqa: F401 - registers moe_token_dispatcher_type="ep_plugin"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--ffn", type=int, default=128)
    parser.add_argument("--experts", type=int, default=8, help="a multiple of the ranks")
    parser.add_argument("--topk", type=int, default=2)
    return parser.parse_args()


def build_layer(args: argparse.Namespace, world: int, on_gpu: bool):
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1, hidden_size=args.hidden, ffn_hidden_size=args.ffn, moe_ffn_hidden_size=args.ffn,
        num_attention_heads=4, num_moe_experts=args.experts, moe_router_topk=args.topk,
        moe_token_dispatcher_type="ep_plugin", expert_model_parallel_size=world,
        use_cpu_initialization=not on_gpu, bf16=True, params_dtype=torch.bfloat16, moe_router_dtype="fp32",
        add_bias_linear=False, moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
    spec = get_moe_module_spec(use_te=False, num_experts=args.experts, moe_grouped_gemm=False)
    # The MoE spec's submodules: a ModuleSpec up to megatron-core 0.17, a functools.partial from 0.18.
    submodules = spec.keywords["submodules"] if isinstance(spec, functools.partial) else spec.submodules
    layer = MoELayer(config, submodules)
    if on_gpu:
        return layer.cuda()
    # Megatron's router moves its weight to CUDA when it first runs; on CPU, the same fp32 logits here.
    layer.router.gating = lambda hidden: F.linear(hidden.float(), layer.router.weight.float())
    return layer


def dense_output(layer, hidden: torch.Tensor, group) -> torch.Tensor:
    """The layer's output without a dispatcher: the group's tokens through every local expert,
    weighted by the router's probabilities, summed over the group; this rank's tokens."""
    with torch.no_grad():
        probs, _ = layer.router(hidden)
        tokens = hidden.reshape(-1, hidden.size(-1))
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        all_tokens = [torch.empty_like(tokens.float()) for _ in range(world)]
        all_probs = [torch.empty_like(probs.float()) for _ in range(world)]
        dist.all_gather(all_tokens, tokens.float().contiguous(), group=group)
        dist.all_gather(all_probs, probs.float().contiguous(), group=group)
        all_tokens, all_probs = torch.cat(all_tokens).to(tokens.dtype), torch.cat(all_probs)
        local = layer.token_dispatcher.local_expert_indices
        expert_input = all_tokens.repeat(len(local), 1)
        expert_probs = torch.cat([all_probs[:, e] for e in local])
        counts = torch.full((len(local),), all_tokens.size(0), dtype=torch.long)
        output, _ = layer.experts(expert_input, counts, expert_probs)
        partial = output.float().view(len(local), all_tokens.size(0), -1).sum(dim=0)
        dist.all_reduce(partial, group=group)
        mine = partial[rank * tokens.size(0):(rank + 1) * tokens.size(0)]
        return mine.to(hidden.dtype).view_as(hidden)


def main() -> None:
    import_ep_plugin()
    import_megatron()
    from megatron.core import parallel_state, tensor_parallel

    args = parse_args()
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if on_gpu else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    if args.experts % world:
        sys.exit(f"--experts {args.experts}: must be a multiple of the {world} ranks")
    parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
    torch.manual_seed(0)  # the same weights on every rank
    if on_gpu:
        tensor_parallel.model_parallel_cuda_manual_seed(0)
    layer = build_layer(args, world, on_gpu)
    device = torch.device("cuda") if on_gpu else torch.device("cpu")

    generator = torch.Generator().manual_seed(100 + rank)
    hidden = torch.randn(args.seq, args.batch, args.hidden, generator=generator).to(torch.bfloat16).to(device)
    hidden.requires_grad_()
    output, _ = layer(hidden)               # forward: router, ep_plugin dispatch, experts, ep_plugin combine
    loss = output.float().square().mean()
    loss.backward()                         # backward: the same path in reverse
    assert hidden.grad is not None and layer.router.weight.grad is not None

    expected = dense_output(layer, hidden.detach(), parallel_state.get_expert_model_parallel_group())
    scale = expected.float().abs().max().item()
    assert scale > 0, "the dense layer's output is all zeros: nothing to compare"
    torch.testing.assert_close(output.detach().float(), expected.float(), rtol=2e-2, atol=1e-2 * scale)
    print(f"rank {rank}/{world}: {type(layer.token_dispatcher).__name__}, loss {loss.item():.4f}; output matches "
          f"the dense layer (max abs diff {(output.detach().float() - expected.float()).abs().max().item():.3g}); "
          "gradients reached the input and the router", flush=True)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
