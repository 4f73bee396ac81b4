"""Time of one normal-mode combine on every rank, and the GPU operations it ran (torch.profiler).

Each timed combine starts from an idle GPU after a barrier (CUDA events, median of 20), so the ranks'
times show their spread; the profile lists each kernel's median time over 5 more combines.

    python3 benchmarks/probes/combine_times.py --ranks 4 [--ring 9/256] [--staging 0] [--sms 24]
    python3 benchmarks/probes/combine_times.py --ranks 4 --deepep     # DeepEP V1 on the same data
"""
from __future__ import annotations

import argparse
import collections
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: the repository's ep_plugin first
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from ep_plugin.bench import random_routing  # noqa: E402
from ep_plugin.launch import parallel_launch, rank_device  # noqa: E402

TIMED, PROFILED, WARMUP, TOPK = 20, 5, 10, 8


def make_buffer(group, args):
    """DeepEP V1's Buffer, or ep_plugin's with the staging area and rings asked for."""
    if args.deepep:
        import deep_ep
        deep_ep.Buffer.set_num_sms(args.sms)
        return deep_ep.Buffer(group, 1 << 30, 0, explicitly_destroy=True)
    import ep_plugin
    config = {"buffer": {"combine_staging_tokens": args.staging}}
    if args.ring:
        send, recv = (int(n) for n in args.ring.split("/"))
        config["combine"] = {"nvl_chunked_send_tokens": send, "nvl_chunked_recv_tokens": recv}
    ep_plugin.Buffer.set_num_sms(args.sms)
    return ep_plugin.Buffer(group, 1 << 30, 0, explicitly_destroy=True, config=config)


def one_combine(buffer, group, recv_x, handle, recv_w):
    dist.barrier(group=group)
    torch.cuda.synchronize()
    buffer.combine(recv_x, handle, topk_weights=recv_w)


def rank_fn(rank, world, group, args):
    device = rank_device(rank)
    torch.cuda.set_device(device)
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(args.tokens, args.hidden, generator=generator).to(torch.bfloat16).to(device)
    topk_idx = random_routing(args.tokens, args.experts, TOPK, device, generator)
    weights = torch.rand(args.tokens, TOPK, generator=generator).to(device)
    buffer = make_buffer(group, args)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, args.experts)
    recv_x, _, recv_w, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                      num_tokens_per_expert=per_expert, topk_idx=topk_idx,
                                                      topk_weights=weights)
    for _ in range(WARMUP):
        buffer.combine(recv_x, handle, topk_weights=recv_w)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(TIMED):
        dist.barrier(group=group)
        torch.cuda.synchronize()
        start.record()
        buffer.combine(recv_x, handle, topk_weights=recv_w)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    kernels = collections.defaultdict(list)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILED):
            one_combine(buffer, group, recv_x, handle, recv_w)
            torch.cuda.synchronize()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and "nccl" not in event.name:
            kernels[event.name[:70]].append(event.device_time_total)
    dist.barrier(group=group)
    buffer.destroy()
    return {"rank": rank, "recv_rows": recv_x.shape[0], "median_us": statistics.median(times),
            "kernels": {name: (len(t) / PROFILED, statistics.median(t)) for name, t in kernels.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--sms", type=int, default=24)
    parser.add_argument("--staging", default="0", help="buffer.combine_staging_tokens (0: the SM combine)")
    parser.add_argument("--ring", default="", help="combine rings SEND/RECV rows, e.g. 9/256 (default: the config's)")
    parser.add_argument("--deepep", action="store_true", help="DeepEP V1 instead of ep_plugin")
    args = parser.parse_args()
    args.staging = int(args.staging) if args.staging.isdigit() else args.staging
    label = "deepep" if args.deepep else f"staging={args.staging} ring={args.ring or 'default'} sms={args.sms}"
    for result in parallel_launch(args.ranks, rank_fn, args, timeout_s=300):
        print(f"[{label}] rank {result['rank']} rows {result['recv_rows']} combine median {result['median_us']:.1f} us")
        for name, (count, median) in sorted(result["kernels"].items(), key=lambda item: -item[1][1]):
            print(f"    {count:4.1f}x {median:8.1f} us  {name}")


if __name__ == "__main__":
    main()
