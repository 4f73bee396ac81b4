"""Copy-engine throughput between two GPUs, by copy size and by streams in flight.

The copy-engine combine moves a rank's rows to their owner in pieces, one cudaMemcpyAsync per
piece; this measures what such copies reach over the link, both directions at once (as in a
combine), without any kernel beside them:

    python3 benchmarks/bench_copy_engine.py                       # GPU machine, 2 GPUs
    python3 benchmarks/bench_copy_engine.py --sizes-mb 7.3 58.7 --streams 1 2 4

For each (piece size, streams) it copies `--total-mb` per direction as pieces of that size, the
pieces taking turns over the streams, and prints GB/s per direction (median of `--iters`).
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import glob
import os
import site
import statistics
from typing import List

import torch


@functools.lru_cache(maxsize=None)
def _cudart() -> ctypes.CDLL:
    """The CUDA runtime torch uses (its cudaMemcpyAsync has none of torch's cross-device syncs)."""
    roots = [os.path.dirname(torch.__file__)] + [os.path.join(p, "nvidia") for p in site.getsitepackages()]
    for root in roots:
        for path in sorted(glob.glob(os.path.join(root, "**", "libcudart.so*"), recursive=True)):
            try:
                return ctypes.CDLL(path)
            except OSError:
                continue
    return ctypes.CDLL("libcudart.so")


_DEVICE_TO_DEVICE = 3


def _memcpy_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    rc = _cudart().cudaMemcpyAsync(ctypes.c_void_p(dst), ctypes.c_void_p(src), ctypes.c_size_t(nbytes),
                                 ctypes.c_int(_DEVICE_TO_DEVICE), ctypes.c_void_p(stream))
    if rc != 0:
        raise RuntimeError(f"cudaMemcpyAsync failed with {rc}")


def _copy_round(srcs, dsts, streams_per_gpu, piece_bytes: int, total_bytes: int) -> None:
    for gpu in (0, 1):
        torch.cuda.set_device(gpu)  # a copy is issued from its source GPU, as a combine's sender does
        offset, k = 0, 0
        while offset < total_bytes:
            n = min(piece_bytes, total_bytes - offset)
            stream = streams_per_gpu[gpu][k % len(streams_per_gpu[gpu])]
            _memcpy_async(dsts[gpu].data_ptr() + offset, srcs[gpu].data_ptr() + offset, n, stream.cuda_stream)
            offset += n
            k += 1


def measure(piece_mb: float, num_streams: int, total_mb: float, iters: int) -> float:
    total = int(total_mb * 1e6) // 16 * 16
    piece = max(16, int(piece_mb * 1e6) // 16 * 16)
    # GPU g sends from its own memory into the other GPU's memory.
    srcs = [torch.empty(total, dtype=torch.uint8, device=f"cuda:{g}") for g in (0, 1)]
    dsts = [torch.empty(total, dtype=torch.uint8, device=f"cuda:{1 - g}") for g in (0, 1)]
    streams = [[torch.cuda.Stream(device=g) for _ in range(num_streams)] for g in (0, 1)]
    mains = [torch.cuda.Stream(device=g) for g in (0, 1)]
    times: List[float] = []
    for it in range(iters + 2):
        for g in (0, 1):
            torch.cuda.synchronize(g)
        starts = [torch.cuda.Event(enable_timing=True) for _ in (0, 1)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in (0, 1)]
        for g in (0, 1):
            with torch.cuda.device(g), torch.cuda.stream(mains[g]):
                # NOTE: a spin holds the GPU while the host queues every copy: the time is the engines'.
                torch.cuda._sleep(20_000_000)
                starts[g].record(mains[g])
                for s in streams[g]:
                    s.wait_stream(mains[g])
        _copy_round(srcs, dsts, streams, piece, total)
        for g in (0, 1):
            with torch.cuda.device(g):
                for s in streams[g]:
                    mains[g].wait_stream(s)
                ends[g].record(mains[g])
        for g in (0, 1):
            torch.cuda.synchronize(g)
        if it >= 2:  # two warm-up rounds
            times.append(max(starts[g].elapsed_time(ends[g]) for g in (0, 1)) * 1e3)
    return total / (statistics.median(times) * 1e-6) / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[0.9, 1.8, 3.7, 7.3, 14.7, 29.4, 58.7])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--total-mb", type=float, default=58.7, help="bytes per direction of one round (a 4096 x 7168 combine)")
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit("bench_copy_engine needs 2 GPUs")
    torch.cuda.init()
    for g in (0, 1):  # as a CUDA IPC mapping does, so that the copies go peer to peer
        _cudart().cudaSetDevice(g)
        _cudart().cudaDeviceEnablePeerAccess(1 - g, 0)  # 704: already enabled
    print(f"device: {torch.cuda.get_device_name(0)} x2, {args.total_mb} MB per direction per round, both directions at once")
    print("piece MB  " + "".join(f"{s:>3} stream(s) GB/s " for s in args.streams))
    for size in args.sizes_mb:
        row = [measure(size, s, args.total_mb, args.iters) for s in args.streams]
        print(f"{size:8.1f}  " + "".join(f"{v:>20.1f}" for v in row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
