"""`ep-plugin bench`: dispatch + combine on random routing, verified against the reference backend,
timed, and compared with the reference backend and the peer-copy ceiling measured in the same run.

Bandwidth formulas (per rank, averaged over ranks):
    normal dispatch   algo = received tokens (own included) x bytes per token / time
                      (dispatch: with notify and host wait; dispatch_cached: with a handle, as DeepEP's
                      tests time it)
                      link = tokens received from other ranks x bytes per token / time
    normal combine    the same byte counts (every received row goes back), bf16 rows
    low-latency       bytes per (token, expert) message: received messages x message bytes / time
    bytes per token   hidden x element size (+ 4 bytes per FP8 scale)
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from .buffer import Buffer
from .config import EpConfig, load_config
from .testing import raw_bytes
from .launch import RANKS_PER_GPU_ENV, parallel_launch, rank_device, rank_slots

GPU_DEFAULTS = {"normal": dict(num_tokens=4096, hidden=7168, num_topk=8, num_experts=256),
                "low_latency": dict(num_tokens=128, hidden=7168, num_topk=8, num_experts=256)}
CPU_DEFAULTS = {"normal": dict(num_tokens=256, hidden=512, num_topk=4, num_experts=16),
                "low_latency": dict(num_tokens=32, hidden=512, num_topk=4, num_experts=16)}


@dataclass
class BenchSettings:
    mode: str = "normal"
    backend: Optional[str] = None       # None: the config's backend
    config_path: Optional[str] = None
    num_ranks: Optional[int] = None
    num_tokens: Optional[int] = None
    hidden: Optional[int] = None
    num_topk: Optional[int] = None
    num_experts: Optional[int] = None
    num_sms: Optional[int] = None
    dtype: str = "bf16"                 # dispatch payload: bf16 or fp8
    warmup: int = 5
    iters: int = 30
    seed: int = 0
    gpu_lead_us: float = 0.0            # a GPU sleep before each timed call's flush (Timer)
    baseline: bool = True               # also time the reference backend
    check: bool = True                  # verify results against the reference backend
    sweep: Dict[str, List[int]] = field(default_factory=dict)  # e.g. {"num_sms": [8, 16, 24]}
    command: str = ""

    def resolved(self, on_gpu: bool) -> "BenchSettings":
        defaults = (GPU_DEFAULTS if on_gpu else CPU_DEFAULTS)[self.mode]
        values = {k: getattr(self, k) if getattr(self, k) is not None else v for k, v in defaults.items()}
        return dataclasses.replace(self, **values)


# ---- data ---------------------------------------------------------------------------------------
def random_routing(num_tokens: int, num_experts: int, num_topk: int, device, generator) -> torch.Tensor:
    """Distinct random experts per token (int64 [T, K])."""
    scores = torch.rand(num_tokens, num_experts, generator=generator, device="cpu")
    return scores.topk(num_topk, dim=1).indices.to(device)


def per_token_fp8(x: torch.Tensor):
    """FP8 e4m3 rows with one float scale per 128 channels (a dispatch payload; not the LL cast)."""
    from .fp8 import quantize
    return quantize(x, round_scale=False, use_ue8m0=False)


@dataclass
class Times:
    """One timed loop: the GPU's time per call (CUDA events) and the host's (the Python call itself)."""
    gpu_us: List[float]
    host_us: List[float]


class Timer:
    """Per-call times, as DeepEP's benchmarks take them.

    GPU: warm-up calls, one barrier, then `iters` calls back to back with CUDA events around each
    and the L2 flushed (256 MB written) before each, outside the timed region. No host barrier
    between calls: ranks stay in step through the operation itself (every dispatch and combine waits
    for its peers), so a barrier's exit skew is not timed. CPU: a barrier and perf_counter per call.

    The host's time per call is taken too. Where it is longer than the GPU's, the GPU waits for the
    launches and the events time the host as well. `gpu_lead_us` > 0 queues a GPU sleep of that
    length before each flush: the host then runs ahead and the events time the GPU alone.
    """

    METHOD = "warm-up, one barrier, back-to-back calls, L2 flushed before each (untimed), CUDA events"

    def __init__(self, device: torch.device, gpu_lead_us: float = 0.0) -> None:
        self.device = device
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device=device) if device.type == "cuda" else None
        self.lead_cycles = _sleep_cycles(gpu_lead_us) if gpu_lead_us > 0 and device.type == "cuda" else 0

    def run(self, fn: Callable[[], object], group, warmup: int, iters: int) -> Times:
        if self.device.type != "cuda":
            return self._run_on_host(fn, group, warmup, iters)
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        dist.barrier(group=group)
        events, host_us = [], []
        for _ in range(iters):
            if self.lead_cycles:
                torch.cuda._sleep(self.lead_cycles)
            self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            begin = time.perf_counter()
            fn()
            host_us.append((time.perf_counter() - begin) * 1e6)
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        return Times([start.elapsed_time(end) * 1e3 for start, end in events], host_us)

    @staticmethod
    def _run_on_host(fn: Callable[[], object], group, warmup: int, iters: int) -> Times:
        times = []
        for i in range(warmup + iters):
            dist.barrier(group=group)
            begin = time.perf_counter()
            fn()
            if i >= warmup:
                times.append((time.perf_counter() - begin) * 1e6)
        return Times(times, times)


def _sleep_cycles(lead_us: float) -> int:
    """GPU clock cycles that `torch.cuda._sleep` spins for `lead_us` microseconds (measured here)."""
    probe = 1_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(probe)  # warm-up
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    return max(1, int(probe * lead_us / (start.elapsed_time(end) * 1e3)))


DISPATCH_PATHS = ("direct", "direct, fell back to rings", "rings")


def _dispatch_path(buf: Buffer) -> str:
    """Which intranode dispatch ran last: one of DISPATCH_PATHS (native), else the backend's name."""
    backend = buf._backend
    path = getattr(backend, "last_dispatch_path", "") or buf.backend_name
    if path == "direct" and backend.direct_fell_back():
        return "direct, fell back to rings"
    return path


def _times(t: Times) -> dict:
    return dict(times_us=t.gpu_us, host_us=t.host_us)


def summarize(times_us: List[float]) -> Dict[str, float]:
    ordered = sorted(times_us)

    def quantile(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]

    return {"median_us": statistics.median(ordered), "p10_us": quantile(0.1), "p90_us": quantile(0.9)}


# ---- checks -------------------------------------------------------------------------------------
def _assert_equal(name: str, got, want) -> None:
    if got is None or want is None:
        if got is not want:
            raise AssertionError(f"{name}: one backend returned None")
        return
    if isinstance(got, tuple):  # (fp8 rows, scales)
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_equal(f"{name}[{i}]", g, w)
        return
    if isinstance(got, list):
        if got != want:
            raise AssertionError(f"{name}: {got} != {want}")
        return
    if got.shape != want.shape or got.dtype != want.dtype:
        raise AssertionError(f"{name}: shape/dtype {tuple(got.shape)}/{got.dtype} != {tuple(want.shape)}/{want.dtype}")
    if not torch.equal(raw_bytes(got), raw_bytes(want)):
        raise AssertionError(f"{name}: values differ")


def _assert_close(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    try:
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    except AssertionError as error:
        raise AssertionError(f"{name}: {error}") from None


# ---- one rank -----------------------------------------------------------------------------------
def _make_config(s: BenchSettings, backend: Optional[str]) -> EpConfig:
    """The run's config: the file (if any), then the bench's flags; `backend` None keeps the file's."""
    overrides = {"mode": s.mode, "check_inputs": False}
    if backend is not None:
        overrides["backend"] = backend
    if s.num_sms is not None:
        overrides["num_sms"] = s.num_sms
    if s.mode == "low_latency":
        overrides["low_latency.max_dispatch_tokens_per_rank"] = s.num_tokens
        overrides["low_latency.num_experts"] = s.num_experts
    overrides["buffer.max_hidden"] = s.hidden
    return load_config(s.config_path, overrides=overrides)


def _rank_inputs(rank: int, group, s: BenchSettings, device: torch.device):
    """This rank's generator (seeded by the seed and the rank; later draws continue from it), the buffer
    under test, the reference (when a baseline or a check needs it), and its inputs: bf16 rows, random
    top-k routing and weights."""
    generator = torch.Generator().manual_seed(s.seed * 1000 + rank)
    buffer = Buffer.from_config(group, _make_config(s, s.backend), explicitly_destroy=True)
    reference = Buffer.from_config(group, _make_config(s, "reference"), explicitly_destroy=True) \
        if (s.baseline or s.check) else None
    x = torch.randn(s.num_tokens, s.hidden, generator=generator).to(torch.bfloat16).to(device)
    topk_idx = random_routing(s.num_tokens, s.num_experts, s.num_topk, device, generator)
    topk_weights = torch.rand(s.num_tokens, s.num_topk, generator=generator).to(device)
    return generator, buffer, reference, x, topk_idx, topk_weights


def _normal_rank(rank: int, R: int, group, s: BenchSettings, device: torch.device) -> dict:
    generator, buffer, reference, x, topk_idx, topk_weights = _rank_inputs(rank, group, s, device)
    payload = per_token_fp8(x) if s.dtype == "fp8" else x

    layouts = {}

    def run_dispatch(buf: Buffer):
        # Timed: the dispatch call only, its notify step and host wait included.
        if buf not in layouts:
            layouts[buf] = buf.get_dispatch_layout(topk_idx, s.num_experts)
        layout = layouts[buf]
        return buf.dispatch(payload, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                            num_tokens_per_expert=layout[2], topk_idx=topk_idx, topk_weights=topk_weights)

    recv = run_dispatch(buffer)
    recv_rows = recv[0][0] if isinstance(recv[0], tuple) else recv[0]
    handle = recv[4]
    expert_out = recv_rows.to(torch.bfloat16) if s.dtype == "bf16" else torch.randn(
        recv_rows.shape, generator=generator).to(torch.bfloat16).to(device)
    combined = buffer.combine(expert_out, handle, topk_weights=recv[2])
    checked = False
    if s.check:
        want = run_dispatch(reference)
        for i, name in enumerate(("recv_x", "recv_topk_idx", "recv_topk_weights", "num_recv_tokens_per_expert")):
            _assert_equal(name, recv[i], want[i])
        want_combined = reference.combine(expert_out, want[4], topk_weights=want[2])
        _assert_close("combined_x", combined[0], want_combined[0])
        _assert_close("combined_topk_weights", combined[1], want_combined[1])
        cached = buffer.dispatch(payload, handle=handle)
        _assert_equal("cached recv_x", cached[0], recv[0])
        checked = True

    num_recv = recv_rows.size(0)
    # The checks' outputs go before the timing: a dispatch's outputs may live in the direct dispatch's
    # output region (`buffer.dispatch_output_bytes: auto` holds two dispatches' at once), and a user's
    # step holds one dispatch's while the next runs, not four.
    fp8_expert_out = expert_out if s.dtype == "fp8" else None
    del recv, recv_rows, expert_out, combined
    if s.check:
        del cached
    own = int(buffer.get_dispatch_layout(topk_idx, s.num_experts)[0][rank])  # this rank's tokens to itself
    bytes_per_token = s.hidden * (1 if s.dtype == "fp8" else 2) + (4 * math.ceil(s.hidden / 128) if s.dtype == "fp8" else 0)
    combine_bytes_per_token = s.hidden * 2
    timer = Timer(device, s.gpu_lead_us)
    results = {}
    measured = [("", buffer)]
    if s.baseline and buffer.backend_name != "reference":
        measured.append(("reference_", reference))
    for prefix, buf in measured:
        out = run_dispatch(buf)
        rows, hdl = (out[0][0] if isinstance(out[0], tuple) else out[0]), out[4]
        # BF16: the dispatched rows themselves; FP8: random BF16 rows of their shape.
        combine_x = rows if fp8_expert_out is None else fp8_expert_out
        dispatch_times = timer.run(lambda: run_dispatch(buf), group, s.warmup, s.iters)
        # Cached dispatch (the handle's layout, no notify and no host wait): what DeepEP's
        # test_intranode.py times for its published dispatch figures.
        cached_times = timer.run(lambda: buf.dispatch(payload, handle=hdl), group, s.warmup, s.iters)
        combine_times = timer.run(lambda: buf.combine(combine_x, hdl, topk_weights=out[2]), group, s.warmup, s.iters)
        results[prefix + "dispatch"] = dict(**_times(dispatch_times), recv_bytes=num_recv * bytes_per_token,
                                            link_bytes=(num_recv - own) * bytes_per_token)
        results[prefix + "dispatch_cached"] = dict(**_times(cached_times), recv_bytes=num_recv * bytes_per_token,
                                                   link_bytes=(num_recv - own) * bytes_per_token,
                                                   path=_dispatch_path(buf))
        results[prefix + "combine"] = dict(**_times(combine_times), recv_bytes=num_recv * combine_bytes_per_token,
                                           link_bytes=(num_recv - own) * combine_bytes_per_token,
                                           path=getattr(buf._backend, "last_combine_path", "") or buf.backend_name)
    backend_name = buffer.backend_name
    for buf in (buffer, reference):
        if buf is not None:
            buf.destroy()
    return dict(rank=rank, backend=backend_name, checked=checked, ops=results)


def _low_latency_rank(rank: int, R: int, group, s: BenchSettings, device: torch.device) -> dict:
    generator, buffer, reference, x, topk_idx, topk_weights = _rank_inputs(rank, group, s, device)
    use_fp8 = s.dtype == "fp8"

    def run_dispatch(buf: Buffer):
        return buf.low_latency_dispatch(x, topk_idx, s.num_tokens, s.num_experts, use_fp8=use_fp8)

    recv_x, recv_count, handle, _, _ = run_dispatch(buffer)
    expert_out = torch.randn(handle.recv_shape, generator=generator).to(torch.bfloat16).to(device)
    combined, _, _ = buffer.low_latency_combine(expert_out, topk_idx, topk_weights, handle)
    checked = False
    if s.check and reference is not None:
        want_x, want_count, want_handle, _, _ = run_dispatch(reference)
        _assert_equal("recv_count", recv_count, want_count)
        for e in range(recv_count.numel()):
            n = int(recv_count[e])
            got = recv_x[0][e, :n] if use_fp8 else recv_x[e, :n]
            ref = want_x[0][e, :n] if use_fp8 else want_x[e, :n]
            _assert_equal(f"recv_x[{e}]", got, ref)
        want_combined, _, _ = reference.low_latency_combine(expert_out, topk_idx, topk_weights, want_handle)
        _assert_close("combined_x", combined, want_combined)
        checked = True

    num_messages = int(recv_count.sum())
    msg_bytes = s.hidden + 4 * math.ceil(s.hidden / 128) if use_fp8 else s.hidden * 2
    timer = Timer(device, s.gpu_lead_us)
    results = {}
    measured = [("", buffer)]
    if s.baseline and buffer.backend_name != "reference":
        measured.append(("reference_", reference))
    for prefix, buf in measured:
        _, _, hdl, _, _ = run_dispatch(buf)
        dispatch_times = timer.run(lambda: run_dispatch(buf), group, s.warmup, s.iters)
        combine_times = timer.run(lambda: buf.low_latency_combine(expert_out, topk_idx, topk_weights, hdl),
                                  group, s.warmup, s.iters)
        results[prefix + "dispatch"] = dict(**_times(dispatch_times), recv_bytes=num_messages * msg_bytes,
                                            link_bytes=None)
        results[prefix + "combine"] = dict(**_times(combine_times), recv_bytes=num_messages * s.hidden * 2,
                                           link_bytes=None)
    backend_name = buffer.backend_name
    for buf in (buffer, reference):
        if buf is not None:
            buf.destroy()
    return dict(rank=rank, backend=backend_name, checked=checked, ops=results)


def _p2p_ceiling_gbps(rank: int, R: int, group) -> Optional[float]:
    """GB/s of a 1 GiB copy into the next rank's GPU, all ranks copying at once (per direction);
    None on one rank, without GPUs, or where ranks share GPUs (no link to measure)."""
    if not torch.cuda.is_available() or R < 2 or R > torch.cuda.device_count():
        return None
    size = 1 << 30
    here, there = rank_device(rank), rank_device((rank + 1) % R)
    src = torch.empty(size, dtype=torch.uint8, device=here)
    dst = torch.empty(size, dtype=torch.uint8, device=there)
    timer = Timer(here)
    times = timer.run(lambda: dst.copy_(src, non_blocking=True), group, 2, 5).gpu_us
    torch.cuda.synchronize(there)
    return size / (statistics.median(times) * 1e-6) / 1e9


def _bench_rank(rank: int, R: int, group, points: List[BenchSettings]) -> List[dict]:
    """Every point of a sweep in one set of processes; the P2P ceiling once."""
    device = rank_device(rank)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    p2p = _p2p_ceiling_gbps(rank, R, group)
    results = []
    for i, s in enumerate(points):
        runner = _normal_rank if s.mode == "normal" else _low_latency_rank
        result = runner(rank, R, group, s, device)
        result.update(p2p_gbps=p2p, device_name=device_name)
        results.append(result)
        if rank == 0 and len(points) > 1:
            show_progress(i + 1, len(points), f"{s.num_tokens} tokens, {s.num_sms or 'config'} SMs")
    return results


def show_progress(done: int, total: int, label: str, width: int = 30) -> None:
    """A one-line progress bar on stderr."""
    filled = width * done // total
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:<40}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


# ---- driver -------------------------------------------------------------------------------------
def aggregate(per_rank: List[dict]) -> Dict[str, dict]:
    ops = {}
    for name in per_rank[0]["ops"]:
        stats = [summarize(r["ops"][name]["times_us"]) for r in per_rank]
        entry = {key: sum(st[key] for st in stats) / len(stats) for key in ("median_us", "p10_us", "p90_us")}
        # The host's time per call (the Python call itself).
        entry["host_median_us"] = statistics.mean(statistics.median(r["ops"][name]["host_us"]) for r in per_rank)
        algo = [r["ops"][name]["recv_bytes"] / (st["median_us"] * 1e-6) / 1e9 for r, st in zip(per_rank, stats)]
        entry["algo_gbps"] = sum(algo) / len(algo)
        links = [r["ops"][name]["link_bytes"] for r in per_rank]
        entry["link_gbps"] = None if links[0] is None else sum(
            b / (st["median_us"] * 1e-6) / 1e9 for b, st in zip(links, stats)) / len(stats)
        if "path" in per_rank[0]["ops"][name]:
            entry["path"] = per_rank[0]["ops"][name]["path"]
        ops[name] = entry
    return ops


def summarize_run(s: BenchSettings, per_rank: List[dict], num_ranks: int) -> dict:
    p2p = [r["p2p_gbps"] for r in per_rank if r["p2p_gbps"] is not None]
    return {"settings": {k: v for k, v in dataclasses.asdict(s).items() if k not in ("sweep",)},
            "backend": per_rank[0]["backend"], "checked": all(r["checked"] for r in per_rank),
            "device_name": per_rank[0]["device_name"], "num_ranks": num_ranks,
            "p2p_gbps": sum(p2p) / len(p2p) if p2p else None, "ops": aggregate(per_rank)}


def default_num_ranks() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() and torch.cuda.device_count() >= 1 else 2


def _gbps(value: float) -> str:
    """One decimal, or three significant digits below 1 GB/s (CPU runs), so that no rate shows as 0.0."""
    return f"{value:.1f}" if value >= 1 else f"{value:.3g}"


def format_table(run: dict) -> str:
    s = run["settings"]
    lines = [f"ep_plugin bench: mode={s['mode']} backend={run['backend']} ranks={run['num_ranks']} "
             f"tokens={s['num_tokens']} hidden={s['hidden']} top-k={s['num_topk']} experts={s['num_experts']} "
             f"dtype={s['dtype']} num_sms={s['num_sms'] if s['num_sms'] is not None else 'config'} "
             f"device={run['device_name']}",
             f"verified against the reference backend: {'yes' if run['checked'] else 'NO (--no-check)'}"]
    if run["p2p_gbps"] is not None:
        lines.append(f"P2P copy ceiling (1 GiB into the next GPU, all ranks at once): {run['p2p_gbps']:.1f} GB/s per direction")
    # host us: the host's time inside each call; where it passes the GPU's, the events timed the host too.
    header = (f"{'operation':<20}{'median us':>12}{'p10 us':>10}{'p90 us':>10}{'algo GB/s':>12}{'link GB/s':>12}"
              f"{'host us':>10}")
    lines += [header, "-" * len(header)]
    for name, e in run["ops"].items():
        link = _gbps(e["link_gbps"]) if e["link_gbps"] is not None else "-"
        path = f"  ({e['path']})" if e.get("path") in ("copy_engine", "sm") + DISPATCH_PATHS else ""
        lines.append(f"{name:<20}{e['median_us']:>12.1f}{e['p10_us']:>10.1f}{e['p90_us']:>10.1f}"
                     f"{_gbps(e['algo_gbps']):>12}{link:>12}{e['host_median_us']:>10.1f}{path}")
    return "\n".join(lines)


def run_bench(s: BenchSettings) -> dict:
    """Run the benchmark (every sweep point in one launch); returns everything `--out` writes."""
    on_gpu = torch.cuda.is_available() and torch.cuda.device_count() >= 1
    num_ranks = s.num_ranks or default_num_ranks()
    if on_gpu and num_ranks > rank_slots():
        raise SystemExit(f"ep-plugin bench: {num_ranks} ranks need {num_ranks} GPUs, found {torch.cuda.device_count()} "
                         f"(ranks can share a GPU only under CUDA MPS: start it and set {RANKS_PER_GPU_ENV})")
    base = s.resolved(on_gpu)
    points = [base]
    if s.sweep:
        (key, values), = s.sweep.items()
        points = [dataclasses.replace(base, **{key: v}) for v in values]
        print(f"ep_plugin bench: sweeping {key} over {values} ({len(values)} points)", file=sys.stderr, flush=True)
    per_rank = parallel_launch(num_ranks, _bench_rank, points, timeout_s=600.0)
    runs = [summarize_run(point, [rank_results[i] for rank_results in per_rank], num_ranks)
            for i, point in enumerate(points)]
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "command": s.command,
            "host": platform.node(), "scaled_down_for_cpu": not on_gpu, "timing": Timer.METHOD,
            "torch": torch.__version__, "runs": runs}


def plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    sweep_key = next(iter(report.get("sweep", {}) or {}), None)
    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(runs[0]["ops"].keys())
    if sweep_key and len(runs) > 1:
        xs = [r["settings"][sweep_key] for r in runs]
        for name in names:
            line, = ax.plot(xs, [r["ops"][name]["algo_gbps"] for r in runs], marker="o", label=f"{name} (algorithm)")
            if runs[0]["ops"][name]["link_gbps"] is not None:  # bytes that crossed NVLink: compare with P2P
                ax.plot(xs, [r["ops"][name]["link_gbps"] for r in runs], marker=".", linestyle=":",
                        color=line.get_color(), label=f"{name} (over the link)")
        ax.set_xlabel(sweep_key)
        if runs[0]["p2p_gbps"]:
            ax.axhline(runs[0]["p2p_gbps"], color="gray", linestyle="--", label="P2P copy ceiling (per direction)")
    else:
        ax.bar(names, [runs[0]["ops"][n]["algo_gbps"] for n in names])
    ax.set_ylabel("GB/s")
    r0 = runs[0]
    ax.set_title(f"ep_plugin {r0['settings']['mode']} {r0['backend']} x{r0['num_ranks']} {r0['device_name']}")
    ax.legend(fontsize=8) if sweep_key else None
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main_bench(s: BenchSettings, out: Optional[str], plot_path: Optional[str]) -> int:
    if plot_path:  # fail before the run, not after it
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SystemExit("--plot needs matplotlib: pip install matplotlib (or ep_plugin[plot])") from None
    report = run_bench(s)
    report["sweep"] = s.sweep
    for run in report["runs"]:
        print(format_table(run))
        print()
    if report["scaled_down_for_cpu"]:
        print("note: no GPU here; ran on CPU processes over gloo with scaled-down sizes")
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as handle:
            json.dump(report, handle, indent=2)
        print(f"wrote {out}")
    if plot_path:
        plot(report, plot_path)
        print(f"wrote {plot_path}")
    return 0
