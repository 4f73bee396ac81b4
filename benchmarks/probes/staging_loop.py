"""The copy-engine combine with a staging area smaller than the rows it carries, in a loop: how many runs
each rank completes before the first error (docs/design.md, "Wrapping staging areas at 3-8 ranks under MPS").

Each run draws new routing and rows, then makes a layout, a dispatch and a combine, synchronizes and meets
the other ranks at a host barrier (gloo: no GPU kernel between runs). With --reference the reference
backend's dispatch and combine follow each native combine before the synchronize, as in the tests.

    python3 benchmarks/probes/staging_loop.py --ranks 4 [--runs 24] [--staging 1024] [--sms 24] [--reference]
    (ranks sharing a GPU: start CUDA MPS and set EP_PLUGIN_RANKS_PER_GPU, as benchmarks/gpu_session.sh does)
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: the repository's ep_plugin first
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import ep_plugin  # noqa: E402
from ep_plugin.bench import random_routing  # noqa: E402
from ep_plugin.launch import finish_rank, parallel_launch, rank_device  # noqa: E402

TOPK = 8


def make_buffers(group, args):
    """ep_plugin's native Buffer with the staging area asked for, and the reference backend's with --reference."""
    native = ep_plugin.Buffer(group, 1 << 30, explicitly_destroy=True,
                              config={"backend": "native", "num_sms": args.sms, "timeout_s": args.timeout,
                                      "buffer": {"combine_staging_tokens": args.staging,
                                                 "max_hidden": args.max_hidden}})
    reference = ep_plugin.Buffer(group, explicitly_destroy=True, config={"backend": "reference"}) \
        if args.reference else None
    return native, reference


def one_run(buffers, rank: int, run: int, args) -> str:
    """A layout, dispatch and combine on each buffer; returns the native combine's path."""
    device = rank_device(rank)
    generator = torch.Generator().manual_seed(run * 1000 + rank)
    x = torch.randn(args.tokens, args.hidden, generator=generator).to(torch.bfloat16).to(device)
    topk_idx = random_routing(args.tokens, args.experts, TOPK, device, generator)
    weights = None if args.no_weights else torch.rand(args.tokens, TOPK, generator=generator).to(device)
    path = ""
    for buffer in buffers:
        if buffer is None:
            continue
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, args.experts)
        recv_x, _, recv_w, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                          num_tokens_per_expert=per_expert, topk_idx=topk_idx,
                                                          topk_weights=weights)
        buffer.combine(recv_x, handle, topk_weights=recv_w)
        path = path or buffer._backend.last_combine_path
    return path


def rank_fn(rank, world, group, args) -> None:
    buffers = make_buffers(group, args)
    host = dist.new_group(backend="gloo")
    done, start, outcome = 0, time.monotonic(), "ok"
    try:
        for run in range(args.runs):
            path = one_run(buffers, rank, run, args)
            torch.cuda.synchronize()
            dist.barrier(group=host)
            done += 1
        outcome += f" (combine path: {path})"
    except Exception as error:  # noqa: BLE001 - the report is the result
        outcome = f"{type(error).__name__}: {str(error)[:240]}"
    # NOTE: no teardown after an error: the buffers' kernels have left, and the report must reach the parent.
    finish_rank(f"rank {rank}: {done}/{args.runs} runs in {time.monotonic() - start:.1f} s: {outcome}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--runs", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--sms", type=int, default=24)
    parser.add_argument("--staging", type=int, default=1024, help="buffer.combine_staging_tokens (rows per peer)")
    parser.add_argument("--max-hidden", type=int, default=16896,
                        help="buffer.max_hidden, which sizes the staging area's pieces (16896: the tests' buffers, "
                             "four slots of 512 rows at hidden 7168 for --staging 1024)")
    parser.add_argument("--timeout", type=float, default=10.0, help="the buffer's timeout_s")
    parser.add_argument("--no-weights", action="store_true", help="combine without top-k weights")
    parser.add_argument("--reference", action="store_true", help="the reference backend's calls after each combine")
    args = parser.parse_args()
    for line in parallel_launch(args.ranks, rank_fn, args, timeout_s=args.runs * (args.timeout + 5) + 60):
        print(line)


if __name__ == "__main__":
    main()
