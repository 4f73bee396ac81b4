"""Dispatch tokens to their experts and combine the results, with ep_plugin's DeepEP-style API.

    torchrun --nproc-per-node 2 examples/dispatch_combine.py            # GPUs (NCCL) or CPU (gloo)
    torchrun --nproc-per-node 4 examples/dispatch_combine.py --tokens 512 --hidden 1024

Each rank routes its tokens to top-k of `--experts` experts spread over the ranks, dispatches them
(`Buffer.dispatch`), applies its local experts (a small linear layer each) to what it received, and
combines the results back (`Buffer.combine`). The result is compared with the same MoE computed in
plain torch on each rank's own tokens; the script exits non-zero if they differ. With GPUs the native
kernels run; without, the reference backend (the same API over torch.distributed).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist


def import_ep_plugin():
    """ep_plugin, or a clear exit where a folder named ep_plugin (a clone) shadows the package."""
    import ep_plugin
    if getattr(ep_plugin, "__file__", None) is None:  # a namespace package: a folder without __init__.py
        sys.exit(f"`import ep_plugin` found the folder {list(ep_plugin.__path__)[0]}, not the package: run this "
                 "script from another directory, or install ep_plugin (pip install --no-build-isolation .) and "
                 "rename the clone")
    return ep_plugin


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8, help="experts in all (a multiple of the ranks)")
    parser.add_argument("--topk", type=int, default=2)
    return parser.parse_args()


def expert_weights(num_experts: int, hidden: int) -> torch.Tensor:
    """Every expert's weight [E, H, H] (float32), the same on every rank (a shared seed)."""
    generator = torch.Generator().manual_seed(1234)
    return torch.randn(num_experts, hidden, hidden, generator=generator) / hidden ** 0.5


def route(tokens: int, experts: int, topk: int, rank: int):
    """Random top-k routing: expert ids int64 [T, K] and softmax weights float32 [T, K]."""
    generator = torch.Generator().manual_seed(rank)
    scores = torch.randn(tokens, experts, generator=generator)
    top_scores, topk_idx = scores.topk(topk, dim=1)
    return topk_idx, top_scores.softmax(dim=1)


def main() -> None:
    ep_plugin = import_ep_plugin()
    args = parse_args()
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if on_gpu else "gloo")
    group = dist.group.WORLD
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.experts % world:
        sys.exit(f"--experts {args.experts}: must be a multiple of the {world} ranks")
    device = torch.device("cuda") if on_gpu else torch.device("cpu")
    local = args.experts // world  # this rank holds experts [rank * local, (rank + 1) * local)

    # The buffer, sized for the largest row it will carry (bf16: 2 bytes per channel).
    Buffer = ep_plugin.Buffer
    num_nvl_bytes = max(config.get_nvl_buffer_size_hint(args.hidden * 2, world)
                        for config in (Buffer.get_dispatch_config(world), Buffer.get_combine_config(world)))
    buffer = Buffer(group, num_nvl_bytes)

    generator = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(args.tokens, args.hidden, generator=generator).to(torch.bfloat16).to(device)
    topk_idx, topk_weights = (t.to(device) for t in route(args.tokens, args.experts, args.topk, rank))
    weights = expert_weights(args.experts, args.hidden).to(device)

    # Dispatch: every token goes to each rank that holds one of its experts.
    num_tokens_per_rank, _, num_tokens_per_expert, is_token_in_rank, _ = buffer.get_dispatch_layout(
        topk_idx, args.experts)
    recv_x, recv_topk_idx, recv_topk_weights, tokens_per_local_expert, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=num_tokens_per_rank, is_token_in_rank=is_token_in_rank,
        num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk_idx, topk_weights=topk_weights)

    # The local experts: recv_topk_idx holds local expert ids (-1: an expert on another rank).
    out = torch.zeros(recv_x.shape, dtype=torch.float32, device=device)
    for k in range(args.topk):
        for e in range(local):
            rows = recv_topk_idx[:, k] == e
            out[rows] += recv_topk_weights[rows, k, None] * (recv_x[rows].float() @ weights[rank * local + e])

    # Combine: each token's partial results come back to its rank and are summed.
    combined, _, _ = buffer.combine(out.to(torch.bfloat16), handle)

    # The same MoE in plain torch, on this rank's tokens alone.
    expected = torch.zeros(args.tokens, args.hidden, device=device)
    for k in range(args.topk):
        expected += topk_weights[:, k, None] * torch.bmm(x.float()[:, None], weights[topk_idx[:, k]])[:, 0]
    torch.testing.assert_close(combined.float(), expected, rtol=2e-2, atol=2e-2)

    print(f"rank {rank}/{world} ({buffer.backend_name} backend): received {recv_x.size(0)} rows for experts "
          f"{rank * local}..{(rank + 1) * local - 1} ({tokens_per_local_expert}); combined output matches plain "
          f"torch (max abs diff {(combined.float() - expected).abs().max().item():.3g})", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
