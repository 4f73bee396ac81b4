"""`ep-plugin bench`: dispatch + combine on random routing, verified against the reference backend,
timed, and compared in the same run with the reference backend, DeepEP V1 (where `deep_ep` is
importable) and the peer-copy ceiling.

Operations (normal mode): layout (`get_dispatch_layout`), dispatch (with notify and host wait),
dispatch_cached (with a handle, as DeepEP's tests time it), combine (with `topk_weights`),
combine_without_weights. Low-latency mode: dispatch, combine (each timed alone, L2 flushed), and
dispatch+combine: eager pairs back to back, no flush, the host's launch time included.

Bandwidth formulas (per rank, averaged over ranks):
    normal dispatch   algo = received tokens (own included) x bytes per token / time
                      link = tokens received from other ranks x bytes per token / time
    normal combine    the same byte counts (every received row goes back), bf16 rows
    low-latency       bytes per (token, expert) message: received messages x message bytes / time
                      (the pair: dispatch and combine bytes over the pair's time)
    bytes per token   hidden x element size (+ 4 bytes per FP8 scale)
DeepEP's figures use the same bytes over DeepEP's time; `vs DeepEP` = DeepEP's time / ours.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist

from .buffer import Buffer
from .cli import UsageError
from .config import EpConfig, load_config
from .testing import raw_bytes
from .tuning import Config
from .launch import RANKS_PER_GPU_ENV, parallel_launch, rank_device, rank_slots

GPU_DEFAULTS = {"normal": dict(num_tokens=4096, hidden=7168, num_topk=8, num_experts=256),
                "low_latency": dict(num_tokens=128, hidden=7168, num_topk=8, num_experts=256)}
CPU_DEFAULTS = {"normal": dict(num_tokens=256, hidden=512, num_topk=4, num_experts=16),
                "low_latency": dict(num_tokens=32, hidden=512, num_topk=4, num_experts=16)}

# DeepEP V1's tuned NVL send chunks (tokens) at 2, 4 and 8 ranks: (dispatch, combine), the values of
# its Buffer.get_dispatch_config / get_combine_config. A DeepEP-style run passes them explicitly.
DEEPEP_V1_NVL_CHUNKS = {2: (24, 10), 4: (6, 9), 8: (6, 4)}
DEEPEP_NVL_RECV_TOKENS = 256

# The conditions a DeepEP program calls under (`--style`), each switchable alone: name -> (modes, what).
STYLE_CONDITIONS = {
    "col_scales": (("normal",), "FP8 scales column-major (scales.T.contiguous().T, as DeepGEMM writes them)"),
    "explicit_config": (("normal",), f"an explicit Config(num_sms, DeepEP's NVL chunk, {DEEPEP_NVL_RECV_TOKENS}) "
                                     "on every call"),
    "combine_after_dispatch": (("normal",), "each timed combine right after a dispatch made with that config"),
    "back_to_back": (("normal", "low_latency"), "calls back to back: no L2 flush, no GPU lead between them"),
    "default_device": (("normal", "low_latency"), "torch.set_default_device(the rank's device)"),
    "default_dtype": (("normal", "low_latency"), "torch.set_default_dtype(torch.bfloat16)"),
}
FP8_ONLY_CONDITIONS = ("col_scales",)  # BF16 payloads carry no scales
PEER_MODULE = "deep_ep"


class OutOfMemory(RuntimeError):
    """A rank ran out of memory (CUDA, or killed by the OS); the message says what was asked for."""


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
    num_sms: Optional[int] = None       # None: the config's
    dtype: str = "bf16"                 # dispatch payload: bf16 or fp8
    warmup: int = 5
    iters: int = 30
    seed: int = 0
    gpu_lead_us: float = 0.0            # a GPU sleep before each timed call's flush (Timer)
    baselines: Tuple[str, ...] = ("reference",)  # timed beside ours: "reference", "deepep"
    peer_required: bool = False         # --baseline deepep: sizes DeepEP cannot run are an error, not a skip
    check: bool = True                  # verify results against the reference backend
    style: Tuple[str, ...] = ()         # DeepEP-program conditions (STYLE_CONDITIONS)
    sweep: Dict[str, List[int]] = field(default_factory=dict)  # e.g. {"num_sms": [8, 16, 24]}
    command: str = ""

    def resolved(self, on_gpu: bool) -> "BenchSettings":
        defaults = (GPU_DEFAULTS if on_gpu else CPU_DEFAULTS)[self.mode]
        values = {k: getattr(self, k) if getattr(self, k) is not None else v for k, v in defaults.items()}
        if self.num_sms is None:
            values["num_sms"] = load_config(self.config_path).num_sms
        return dataclasses.replace(self, **values)

    def scaled_down(self, on_gpu: bool) -> bool:
        """Whether a size came from the CPU defaults, smaller than the GPU's."""
        return not on_gpu and any(getattr(self, k) is None for k in GPU_DEFAULTS[self.mode])


def parse_style(text: Optional[str], mode: str, dtype: str = "bf16") -> Tuple[str, ...]:
    """`--style`: 'deepep' (every condition of the mode and payload), 'plain' / None (none), or a comma list."""
    if not text or text == "plain":
        return ()
    if text == "deepep":
        return tuple(name for name, (modes, _) in STYLE_CONDITIONS.items()
                     if mode in modes and (dtype == "fp8" or name not in FP8_ONLY_CONDITIONS))
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    for name in names:
        if name not in STYLE_CONDITIONS:
            raise UsageError(f"--style {text}: unknown condition {name!r}; use deepep, plain or a comma list of "
                             f"{', '.join(STYLE_CONDITIONS)}")
        if mode not in STYLE_CONDITIONS[name][0]:
            raise UsageError(f"--style {name}: applies to {' and '.join(STYLE_CONDITIONS[name][0])} mode only, "
                             f"not {mode}")
    return names


def peer_importable() -> bool:
    """Whether DeepEP V1 (`deep_ep`) can be found on this Python path (without importing it)."""
    try:
        return importlib.util.find_spec(PEER_MODULE) is not None
    except (ImportError, ValueError):
        return False


def _peer_import_error() -> str:
    """Why DeepEP V1 cannot be imported here ('' where it can)."""
    if not peer_importable():
        return "the module deep_ep is not on this Python path"
    try:
        _import_peer()
        return ""
    except Exception as error:  # noqa: BLE001 - a build for another torch or CUDA fails in many ways
        return f"importing deep_ep failed: {_first_line(error)}"


def resolve_baselines(choice: str) -> Tuple[str, ...]:
    """`--baseline`: auto = the reference, and DeepEP where importable; deepep requires it."""
    if choice == "none":
        return ()
    if choice == "reference":
        return ("reference",)
    why = _peer_import_error()
    if choice == "deepep" and why:
        raise UsageError(f"--baseline deepep: {why}; build DeepEP V1 (github.com/deepseek-ai/DeepEP) and put it on "
                         "PYTHONPATH, or use --baseline auto")
    if why and peer_importable():  # found but broken: say so rather than drop it silently
        print(f"ep-plugin bench: no DeepEP baseline: {why}", file=sys.stderr, flush=True)
    return ("reference",) if why else ("reference", "deepep")


# DeepEP V1's low-latency kernels exist for these hidden sizes only (its launch switch), with at most
# this many top-k, and its TMA needs ranks x tokens to be a multiple of 4.
PEER_LOW_LATENCY_HIDDENS = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)
PEER_LOW_LATENCY_MAX_TOPK = 11


def peer_cannot_run(s: BenchSettings, num_ranks: int) -> str:
    """Why DeepEP V1 cannot run these (resolved) sizes ('' where it can)."""
    if s.mode != "low_latency":
        return ""
    if s.hidden not in PEER_LOW_LATENCY_HIDDENS:
        return (f"has no low-latency kernels for --hidden {s.hidden} "
                f"(only {', '.join(map(str, PEER_LOW_LATENCY_HIDDENS))})")
    if s.num_topk > PEER_LOW_LATENCY_MAX_TOPK:
        return f"takes at most top-{PEER_LOW_LATENCY_MAX_TOPK} in low-latency mode, not --topk {s.num_topk}"
    if num_ranks * s.num_tokens % 4:
        return (f"needs ranks x tokens to be a multiple of 4 in low-latency mode, not {num_ranks} x "
                f"--tokens {s.num_tokens}")
    return ""


def fit_peer(points: List[BenchSettings], num_ranks: int) -> List[BenchSettings]:
    """The points, without the DeepEP baseline where DeepEP cannot run their sizes (said on stderr);
    with --baseline deepep that is an error instead."""
    if "deepep" not in points[0].baselines:
        return points
    why = next((reason for reason in (peer_cannot_run(p, num_ranks) for p in points) if reason), "")
    if not why:
        return points
    if points[0].peer_required:
        raise UsageError(f"--baseline deepep: DeepEP V1 {why}; use --baseline auto to run without it")
    print(f"ep-plugin bench: no DeepEP baseline: DeepEP V1 {why}", file=sys.stderr, flush=True)
    return [dataclasses.replace(p, baselines=tuple(b for b in p.baselines if b != "deepep")) for p in points]


def validate(s: BenchSettings, num_ranks: int, on_gpu: bool) -> None:
    """Reject bad sizes and combinations before any process starts (resolved settings)."""
    for flag, value in (("--tokens", s.num_tokens), ("--hidden", s.hidden), ("--topk", s.num_topk),
                        ("--experts", s.num_experts), ("--iters", s.iters), ("--ranks", num_ranks)):
        if value < 1:
            raise UsageError(f"{flag} {value}: must be a positive integer")
    if s.warmup < 0:
        raise UsageError(f"--warmup {s.warmup}: must be 0 or more")
    if s.num_experts % num_ranks != 0:
        fix = (s.num_experts // num_ranks + 1) * num_ranks
        raise UsageError(f"--experts {s.num_experts}: must be divisible by the number of ranks ({num_ranks}), "
                         f"e.g. --experts {fix}")
    if s.num_topk > s.num_experts:
        raise UsageError(f"--topk {s.num_topk}: must not exceed --experts ({s.num_experts})")
    if s.num_sms < 2 or s.num_sms % 2:
        raise UsageError(f"--num-sms {s.num_sms}: must be a positive even number (one sender and one receiver "
                         "SM per channel)")
    if s.dtype == "fp8" and s.hidden % 128:
        raise UsageError(f"--hidden {s.hidden}: FP8 payloads need a multiple of 128 (one scale per 128 channels)")
    if "back_to_back" in s.style and s.gpu_lead_us > 0:
        raise UsageError("--gpu-lead-us: a GPU lead contradicts --style back_to_back; drop one")
    for name in FP8_ONLY_CONDITIONS:
        if name in s.style and s.dtype != "fp8":
            raise UsageError(f"--style {name}: needs --dtype fp8 (BF16 payloads carry no scales)")
    if s.backend == "native" and not on_gpu:
        raise UsageError("--backend native (or backend: native in the config): no GPU here "
                         "(torch.cuda.is_available() is False); use --backend reference or auto")
    extension = "_C" if s.mode == "normal" else "_C_nvshmem"
    state = built_extensions()[extension]
    if s.backend == "native" and state.startswith("not built"):
        raise UsageError(f"--backend native: ep_plugin.{extension} is {state}; reinstall where a CUDA toolkit is "
                         "found (`pip install -v .` prints why it skipped), or use --backend auto")
    if on_gpu and num_ranks > rank_slots():
        raise UsageError(f"--ranks {num_ranks}: needs {num_ranks} GPUs, found {torch.cuda.device_count()} (ranks "
                         f"can share a GPU only under CUDA MPS: start it and set {RANKS_PER_GPU_ENV})")


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
class Inputs:
    """One rank's data (the same for every buffer measured): bf16 rows [T, H], top-k experts int64
    [T, K] and weights float32 [T, K], the dispatch payload (x, or FP8 rows and float32 scales
    [T, H / 128], column-major with `col_scales`), and the generator for later draws."""
    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    payload: object
    generator: torch.Generator


def make_inputs(rank: int, s: BenchSettings, device: torch.device) -> Inputs:
    generator = torch.Generator().manual_seed(s.seed * 1000 + rank)
    x = torch.randn(s.num_tokens, s.hidden, generator=generator).to(torch.bfloat16).to(device)
    topk_idx = random_routing(s.num_tokens, s.num_experts, s.num_topk, device, generator)
    topk_weights = torch.rand(s.num_tokens, s.num_topk, generator=generator).to(device)
    payload = x
    if s.mode == "normal" and s.dtype == "fp8":
        rows, scales = per_token_fp8(x)
        payload = (rows, scales.T.contiguous().T if "col_scales" in s.style else scales)
    return Inputs(x, topk_idx, topk_weights, payload, generator)


@contextlib.contextmanager
def torch_defaults(style: Iterable[str], device: torch.device):
    """The global defaults a DeepEP program sets (`default_device`, `default_dtype`), while inside."""
    saved_dtype = torch.get_default_dtype()
    with contextlib.ExitStack() as stack:
        if "default_device" in style:
            stack.enter_context(device)
        if "default_dtype" in style:
            torch.set_default_dtype(torch.bfloat16)
        try:
            yield
        finally:
            torch.set_default_dtype(saved_dtype)


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
    length before each flush: the host then runs ahead and the events time the GPU alone. Without
    `flush` the calls follow each other with nothing between them (a program's eager calls).
    `before`, where given, runs before each call outside the timed region (after the flush).
    """

    METHOD = "warm-up, one barrier, back-to-back calls, L2 flushed before each (untimed), CUDA events"

    def __init__(self, device: torch.device, gpu_lead_us: float = 0.0, flush: bool = True) -> None:
        self.device = device
        on_gpu = device.type == "cuda"
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device=device) if on_gpu and flush else None
        self.lead_cycles = _sleep_cycles(gpu_lead_us) if gpu_lead_us > 0 and on_gpu else 0

    def run(self, fn: Callable[[], object], group, warmup: int, iters: int,
            before: Optional[Callable[[], object]] = None) -> Times:
        if self.device.type != "cuda":
            return self._run_on_host(fn, group, warmup, iters, before)
        for _ in range(warmup):
            if before is not None:
                before()
            fn()
        torch.cuda.synchronize()
        dist.barrier(group=group)
        events, host_us = [], []
        for _ in range(iters):
            if self.lead_cycles:
                torch.cuda._sleep(self.lead_cycles)
            if self.flush is not None:
                self.flush.zero_()
            if before is not None:
                before()
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
    def _run_on_host(fn: Callable[[], object], group, warmup: int, iters: int,
                     before: Optional[Callable[[], object]]) -> Times:
        times = []
        for i in range(warmup + iters):
            if before is not None:
                before()
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


class Progress:
    """Rank 0's stage lines on stderr, and over repeated work a bar (tqdm where installed, else a line
    per step). Other ranks stay quiet."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def stage(self, text: str) -> None:
        if self.enabled:
            print(f"ep-plugin bench: {text}", file=sys.stderr, flush=True)

    def steps(self, label: str, names: List[str]) -> Iterable[str]:
        if not self.enabled:
            yield from names
            return
        tqdm = None
        if sys.stderr.isatty():  # a bar redraws in place; logs get one line per step
            try:
                from tqdm import tqdm
            except ImportError:
                pass
        if tqdm is not None:
            with tqdm(names, desc=f"ep-plugin bench: {label}", file=sys.stderr, leave=False,
                      bar_format="{desc} {bar:20} {n_fmt}/{total_fmt} {postfix}") as bar:
                for name in bar:
                    bar.set_postfix_str(name)
                    yield name
            self.stage(f"{label}: done ({len(names)} operations)")
            return
        for i, name in enumerate(names):
            self.stage(f"{label}: {name} ({i + 1}/{len(names)})")
            yield name


DISPATCH_PATHS = ("direct", "direct, fell back to rings", "rings")


def _dispatch_path(buf) -> str:
    """Which intranode dispatch ran last: one of DISPATCH_PATHS (native), else the backend's name."""
    backend = getattr(buf, "_backend", None)
    if backend is None:  # DeepEP's Buffer
        return ""
    path = getattr(backend, "last_dispatch_path", "") or buf.backend_name
    if path == "direct" and backend.direct_fell_back():
        return "direct, fell back to rings"
    return path


def _combine_path(buf) -> str:
    backend = getattr(buf, "_backend", None)
    return "" if backend is None else getattr(backend, "last_combine_path", "") or buf.backend_name


def _op_path(buf, op: str) -> str:
    """The path of a normal-mode op's last call ("" for the layout and for DeepEP's Buffer)."""
    if op.startswith("dispatch"):
        return _dispatch_path(buf)
    return _combine_path(buf) if op.startswith("combine") else ""


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


def _assert_close(name: str, got: Optional[torch.Tensor], want: Optional[torch.Tensor]) -> None:
    if got is None or want is None:
        if got is not want:
            raise AssertionError(f"{name}: one backend returned None")
        return
    try:
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    except AssertionError as error:
        raise AssertionError(f"{name}: {error}") from None


def _first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


# ---- buffers --------------------------------------------------------------------------------------
def _make_config(s: BenchSettings, backend: Optional[str]) -> EpConfig:
    """The run's config: the file (if any), then the bench's flags; `backend` None keeps the file's."""
    overrides = {"mode": s.mode, "check_inputs": False, "num_sms": s.num_sms, "buffer.max_hidden": s.hidden}
    if backend is not None:
        overrides["backend"] = backend
    if s.mode == "low_latency":
        overrides["low_latency.max_dispatch_tokens_per_rank"] = s.num_tokens
        overrides["low_latency.num_experts"] = s.num_experts
    return load_config(s.config_path, overrides=overrides)


def explicit_configs(config_cls, s: BenchSettings, num_ranks: int) -> Tuple[object, object]:
    """(dispatch, combine) `Config(num_sms, DeepEP's NVL chunk, 256)` of `config_cls` (ep_plugin's or
    DeepEP's), as a DeepEP program passes them; the chunks of the nearest tuned rank count."""
    ranks = min((r for r in DEEPEP_V1_NVL_CHUNKS if r >= num_ranks), default=max(DEEPEP_V1_NVL_CHUNKS))
    dispatch_chunk, combine_chunk = DEEPEP_V1_NVL_CHUNKS[ranks]
    return (config_cls(s.num_sms, dispatch_chunk, DEEPEP_NVL_RECV_TOKENS),
            config_cls(s.num_sms, combine_chunk, DEEPEP_NVL_RECV_TOKENS))


def _our_buffer(group, s: BenchSettings, num_ranks: int) -> Tuple[Buffer, str]:
    """The buffer under test and why it has its backend. With `explicit_config` it is sized as a
    DeepEP program sizes it: the largest NVL size hint of the configs it will pass."""
    Buffer.set_num_sms(s.num_sms)
    cfg = _make_config(s, s.backend)
    if "explicit_config" in s.style:
        configs = explicit_configs(Config, s, num_ranks) + (
            Buffer.get_dispatch_config(num_ranks), Buffer.get_combine_config(num_ranks))
        num_nvl_bytes = max(c.get_nvl_buffer_size_hint(s.hidden * 2, num_ranks) for c in configs)
        buffer = Buffer(group, num_nvl_bytes, 0, explicitly_destroy=True, config=cfg)
    else:
        buffer = Buffer.from_config(group, cfg, explicitly_destroy=True)
    return buffer, _backend_reason(buffer, cfg)


def _backend_reason(buffer: Buffer, cfg: EpConfig) -> str:
    """Why the buffer has its backend: named in the config, or auto's choice and its reason."""
    if cfg.backend != "auto":
        return f"backend: {cfg.backend} in the config or --backend"
    if buffer.backend_name == "native":
        return "auto: the native kernels serve this group"
    from .backends import native_support
    return "auto: native unavailable: " + native_support(buffer._info, buffer.low_latency_mode, buffer.num_nvl_bytes)


def _needs_reference(s: BenchSettings) -> bool:
    return s.check or "reference" in s.baselines


def _reference_buffer(group, s: BenchSettings) -> Buffer:
    return Buffer.from_config(group, _make_config(s, "reference"), explicitly_destroy=True)


def _import_peer():
    """DeepEP V1's module (`deep_ep`)."""
    return importlib.import_module(PEER_MODULE)


def _peer_normal_buffer(deep_ep, group, s: BenchSettings, num_ranks: int):
    """DeepEP's buffer as a DeepEP program makes it: `set_num_sms`, then NVL bytes from its configs' hints."""
    deep_ep.Buffer.set_num_sms(s.num_sms)
    configs = [deep_ep.Buffer.get_dispatch_config(num_ranks), deep_ep.Buffer.get_combine_config(num_ranks)]
    if "explicit_config" in s.style:
        configs += explicit_configs(deep_ep.Config, s, num_ranks)
    num_nvl_bytes = max(c.get_nvl_buffer_size_hint(s.hidden * 2, num_ranks) for c in configs)
    return deep_ep.Buffer(group, num_nvl_bytes, 0, explicitly_destroy=True)


def _peer_low_latency_buffer(deep_ep, group, s: BenchSettings, num_ranks: int):
    """DeepEP's low-latency buffer: the size hint, one QP per local expert (as its docs ask). Without
    an RDMA NIC its NVSHMEM needs NVSHMEM_REMOTE_TRANSPORT=none: the bench runs on one host."""
    os.environ.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")
    num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(s.num_tokens, s.hidden, num_ranks, s.num_experts)
    return deep_ep.Buffer(group, 0, num_rdma_bytes, low_latency_mode=True,
                          num_qps_per_rank=max(1, s.num_experts // num_ranks), explicitly_destroy=True)


# ---- normal mode ----------------------------------------------------------------------------------
class NormalCalls:
    """One buffer's normal-mode calls on the run's inputs (ep_plugin's and DeepEP's `Buffer` alike);
    `configs`: (dispatch, combine) passed on every call, or (None, None) for the buffer's defaults."""

    def __init__(self, buffer, inputs: Inputs, num_experts: int, configs=(None, None)) -> None:
        self.buffer, self.inputs, self.num_experts = buffer, inputs, num_experts
        self.dispatch_config, self.combine_config = configs
        self._layout = None

    def layout(self):
        return self.buffer.get_dispatch_layout(self.inputs.topk_idx, self.num_experts)

    def dispatch(self):
        """A dispatch with notify and host wait (the layout computed once, outside)."""
        if self._layout is None:
            self._layout = self.layout()
        num_tokens_per_rank, _, num_tokens_per_expert, is_token_in_rank, _ = self._layout
        return self.buffer.dispatch(self.inputs.payload, num_tokens_per_rank=num_tokens_per_rank,
                                    is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert,
                                    topk_idx=self.inputs.topk_idx, topk_weights=self.inputs.topk_weights,
                                    config=self.dispatch_config)

    def cached(self, handle):
        return self.buffer.dispatch(self.inputs.payload, handle=handle, config=self.dispatch_config)

    def combine(self, x: torch.Tensor, handle, topk_weights: Optional[torch.Tensor]):
        return self.buffer.combine(x, handle, topk_weights=topk_weights, config=self.combine_config)


def _recv_rows(recv_x) -> torch.Tensor:
    return recv_x[0] if isinstance(recv_x, tuple) else recv_x


def _normal_outputs(calls: NormalCalls, expert_out: torch.Tensor) -> dict:
    """Every checked output of one buffer: layout, dispatch, cached dispatch, both combines."""
    recv = calls.dispatch()
    return {"layout": calls.layout(), "recv": recv, "cached": calls.cached(recv[4]),
            "combined": calls.combine(expert_out, recv[4], recv[2]),
            "combined_without_weights": calls.combine(expert_out, recv[4], None)}


def _compare_normal(got: dict, want: dict) -> None:
    """Routing metadata and copied rows exactly; combines within bf16 summation-order tolerance."""
    for i, name in ((0, "num_tokens_per_rank"), (2, "num_tokens_per_expert"), (3, "is_token_in_rank")):
        _assert_equal(name, got["layout"][i], want["layout"][i])
    for i, name in enumerate(("recv_x", "recv_topk_idx", "recv_topk_weights", "num_recv_tokens_per_expert")):
        _assert_equal(name, got["recv"][i], want["recv"][i])
    _assert_equal("cached recv_x", got["cached"][0], want["recv"][0])
    _assert_close("combined_x", got["combined"][0], want["combined"][0])
    _assert_close("combined_topk_weights", got["combined"][1], want["combined"][1])
    _assert_close("combined_x without topk_weights", got["combined_without_weights"][0],
                  want["combined_without_weights"][0])


NORMAL_OPS = ("layout", "dispatch", "dispatch_cached", "combine", "combine_without_weights")


def _time_normal(calls: NormalCalls, timer: Timer, group, s: BenchSettings, fp8_expert_out: Optional[torch.Tensor],
                 progress: Progress, label: str) -> Dict[str, dict]:
    """Each operation's times on one buffer, with its byte counts and (ours) the path it took."""
    out = calls.dispatch()
    rows, handle, recv_weights = _recv_rows(out[0]), out[4], out[2]
    combine_x = rows if fp8_expert_out is None else fp8_expert_out  # BF16: the dispatched rows themselves
    latest = {"handle": handle, "weights": recv_weights}  # what the combines take

    def dispatch_first():
        latest.clear()  # one dispatch's outputs alive at a time, as in a program's step
        fresh = calls.dispatch()
        latest.update(handle=fresh[4], weights=fresh[2])

    before_combine = dispatch_first if "combine_after_dispatch" in s.style else None
    steps = {
        "layout": (calls.layout, None),
        "dispatch": (calls.dispatch, None),
        "dispatch_cached": (lambda: calls.cached(handle), None),
        "combine": (lambda: calls.combine(combine_x, latest["handle"], latest["weights"]), before_combine),
        "combine_without_weights": (lambda: calls.combine(combine_x, latest["handle"], None), before_combine),
    }
    times, paths = {}, {}
    for name in progress.steps(f"warm-up and timing, {label} ({s.warmup} + {s.iters} calls each)", list(steps)):
        fn, before = steps[name]
        times[name] = timer.run(fn, group, s.warmup, s.iters, before)
        paths[name] = _op_path(calls.buffer, name)  # the path of this op's last call
    num_recv = rows.size(0)
    own = int(calls.layout()[0][dist.get_rank(group)])  # this rank's tokens to itself
    dispatch_bytes = s.hidden * (1 if s.dtype == "fp8" else 2) + (4 * (s.hidden // 128) if s.dtype == "fp8" else 0)
    sizes = {"layout": None, "dispatch": dispatch_bytes, "dispatch_cached": dispatch_bytes,
             "combine": s.hidden * 2, "combine_without_weights": s.hidden * 2}
    ops = {}
    for name, t in times.items():
        per_token = sizes[name]
        ops[name] = dict(times_us=t.gpu_us, host_us=t.host_us,
                         recv_bytes=None if per_token is None else num_recv * per_token,
                         link_bytes=None if per_token is None else (num_recv - own) * per_token)
        if paths[name]:
            ops[name]["path"] = paths[name]
    return ops


def _normal_rank(rank: int, R: int, group, s: BenchSettings, device: torch.device, progress: Progress) -> dict:
    inputs = make_inputs(rank, s, device)
    progress.stage(f"buffers: ep_plugin ({s.backend or 'config'} backend, {s.num_sms} SMs)"
                   + (" and the reference backend" if _needs_reference(s) else ""))
    buffer, backend_reason = _our_buffer(group, s, R)
    reference = _reference_buffer(group, s) if _needs_reference(s) else None
    our_configs = explicit_configs(Config, s, R) if "explicit_config" in s.style else (None, None)
    ours = NormalCalls(buffer, inputs, s.num_experts, our_configs)
    result = dict(rank=rank, backend=buffer.backend_name, backend_reason=backend_reason, num_sms=s.num_sms)
    with torch_defaults(s.style, device):
        first = ours.dispatch()
    # The expert output the combines take: BF16, the received rows; FP8, random BF16 rows of their shape.
    num_recv = _recv_rows(first[0]).size(0)
    expert_out = (_recv_rows(first[0]).clone() if s.dtype == "bf16" else
                  torch.randn(num_recv, s.hidden, generator=inputs.generator).to(torch.bfloat16).to(device))
    # NOTE: outputs are dropped before the timing: a dispatch's outputs may live in the direct
    # dispatch's output region (`buffer.dispatch_output_bytes: auto` holds two dispatches' at once).
    del first
    # The reference is the oracle, not a program under test: it runs outside the style's torch defaults.
    want = _normal_outputs(NormalCalls(reference, inputs, s.num_experts), expert_out) if s.check else None
    fp8_expert_out = expert_out if s.dtype == "fp8" else None
    timer = Timer(device, s.gpu_lead_us, flush="back_to_back" not in s.style)
    with torch_defaults(s.style, device):
        if s.check:
            progress.stage("verification: ep_plugin against the reference backend on this run's data")
            _compare_normal(_normal_outputs(ours, expert_out), want)
        result["ops"] = _time_normal(ours, timer, group, s, fp8_expert_out, progress, "ep_plugin")
    if "reference" in s.baselines and buffer.backend_name != "reference":
        progress.stage("baseline: the reference backend")
        ref_ops = _time_normal(NormalCalls(reference, inputs, s.num_experts), timer, group, s, fp8_expert_out,
                               progress, "reference")
        result["ops"].update({"reference_" + name: op for name, op in ref_ops.items()})
    result["checked"] = s.check
    for buf in (buffer, reference):
        if buf is not None:
            buf.destroy()
    if "deepep" in s.baselines:
        result["deepep"] = _peer_normal(rank, R, group, s, device, inputs, expert_out, want, timer, progress)
    return result


def _peer_normal(rank: int, R: int, group, s: BenchSettings, device: torch.device, inputs: Inputs,
                 expert_out: torch.Tensor, want: Optional[dict], timer: Timer, progress: Progress) -> dict:
    """DeepEP V1 on the same data in the same process group, checked against the reference's outputs."""
    configs = "explicit Configs" if "explicit_config" in s.style else "its tuned Configs"
    progress.stage(f"baseline: DeepEP V1 ({s.num_sms} SMs, {configs})")
    deep_ep = _import_peer()
    peer = _peer_normal_buffer(deep_ep, group, s, R)
    configs = explicit_configs(deep_ep.Config, s, R) if "explicit_config" in s.style else (None, None)
    calls = NormalCalls(peer, inputs, s.num_experts, configs)
    report = {"module": getattr(deep_ep, "__file__", None) or PEER_MODULE, "checked": False, "check_error": None,
              "processes": "the same processes and process group as ep_plugin's"}
    with torch_defaults(s.style, device):
        if want is not None:
            progress.stage("verification: DeepEP V1 against the reference backend on this run's data")
            try:
                _compare_normal(_normal_outputs(calls, expert_out), want)
                report["checked"] = True
            except AssertionError as error:
                report["check_error"] = _first_line(error)
        report["ops"] = _time_normal(calls, timer, group, s, expert_out if s.dtype == "fp8" else None, progress,
                                     "DeepEP V1")
    peer.destroy()
    return report


# ---- low-latency mode -----------------------------------------------------------------------------
class LowLatencyCalls:
    """One buffer's low-latency calls on the run's inputs (ep_plugin's and DeepEP's `Buffer` alike)."""

    def __init__(self, buffer, inputs: Inputs, s: BenchSettings) -> None:
        self.buffer, self.inputs, self.s = buffer, inputs, s

    def dispatch(self):
        return self.buffer.low_latency_dispatch(self.inputs.x, self.inputs.topk_idx, self.s.num_tokens,
                                                self.s.num_experts, use_fp8=self.s.dtype == "fp8")

    def combine(self, expert_out: torch.Tensor, handle):
        return self.buffer.low_latency_combine(expert_out, self.inputs.topk_idx, self.inputs.topk_weights, handle)

    def pair(self, expert_out: torch.Tensor):
        """A decode step's two calls, eagerly: dispatch, then combine with its handle."""
        return self.combine(expert_out, self.dispatch()[2])


def _expert_rows(recv_x, expert: int, count: int):
    if isinstance(recv_x, tuple):
        return recv_x[0][expert, :count], recv_x[1][expert, :count]
    return recv_x[expert, :count]


def _compare_low_latency_dispatch(got, want, peer: bool) -> None:
    """Counts exactly; each expert's rows. ep_plugin's exactly, in slot order; DeepEP's (`peer`) as a set
    of rows (it places each source's rows in the order its atomics hand out slots) and, for FP8,
    within one FP8 step of the reference's values (its quantizer may round an element the other way)."""
    (got_x, got_count), (want_x, want_count) = got, want
    _assert_equal("recv_count", got_count, want_count)
    for e in range(want_count.numel()):
        n = int(want_count[e])
        g, w = _expert_rows(got_x, e, n), _expert_rows(want_x, e, n)
        if not peer:
            _assert_equal(f"recv_x[{e}]", g, w)
        elif isinstance(g, tuple):
            got_rows, want_rows = _dequantized(g), _dequantized(w)
            paired = want_rows[_nearest_rows(f"recv_x[{e}]", got_rows, want_rows)]
            _assert_within_fp8_step(f"recv_x[{e}]", got_rows, paired)
        else:
            _assert_equal(f"recv_x[{e}]", _sorted_rows(g), _sorted_rows(w))


def _dequantized(rows) -> torch.Tensor:
    from .fp8 import dequantize
    return dequantize(*rows)


def _nearest_rows(name: str, got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """For each row of `got`, the index of the nearest row of `want`; each of `want` must be chosen once
    (rows one FP8 rounding apart: sorting by a projection would not pair them reliably)."""
    match = torch.cdist(got, want).argmin(dim=1) if got.size(0) else torch.zeros(0, dtype=torch.long, device=got.device)
    if not torch.equal(match.sort().values, torch.arange(want.size(0), device=match.device)):
        raise AssertionError(f"{name}: the rows are not the same set (no one-to-one match)")
    return match


def _assert_within_fp8_step(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """|got - want| within one e4m3 step of `want` (1/8 of its binade; the row's subnormal step near 0)."""
    row_max = want.abs().amax(dim=-1, keepdim=True)
    bad = (got - want).abs() > want.abs() / 8 + row_max * 2.0 ** -9
    if bool(bad.any()):
        row, col = (int(i) for i in bad.nonzero()[0])
        raise AssertionError(f"{name}: row {row} column {col}: {float(got[row, col])} vs {float(want[row, col])}, "
                             "more than one FP8 step apart")


def _sorted_rows(rows):
    """The rows (and their scales) ordered by a random projection of their bytes: equal sets of
    distinct rows come out in the same order."""
    data = rows[0] if isinstance(rows, tuple) else rows
    raw = raw_bytes(data).reshape(data.size(0), -1).double()
    projection = torch.rand(raw.size(1), generator=torch.Generator().manual_seed(7), dtype=torch.float64,
                            device="cpu")
    order = (raw @ projection.to(raw.device)).argsort()
    return tuple(r[order] for r in rows) if isinstance(rows, tuple) else rows[order]


def _token_expert_out(recv_x) -> torch.Tensor:
    """Expert output that is a function of the token alone (its dispatched row, dequantized): the
    combine's result then does not depend on where a buffer placed each row."""
    if isinstance(recv_x, tuple):
        from .fp8 import dequantize
        return dequantize(*recv_x).to(torch.bfloat16)
    return recv_x.clone()


def _low_latency_outputs(calls: LowLatencyCalls, expert_out: Optional[torch.Tensor]) -> tuple:
    """(recv_x, recv_count, combined): a dispatch, then a combine of `expert_out`, or where None of
    the dispatched rows themselves (`_token_expert_out`)."""
    recv_x, recv_count, handle, _, _ = calls.dispatch()
    combine_x = _token_expert_out(recv_x) if expert_out is None else expert_out
    return recv_x, recv_count, calls.combine(combine_x, handle)[0]


def _low_latency_bytes(s: BenchSettings, num_messages: int) -> Dict[str, int]:
    dispatch = num_messages * (s.hidden + 4 * math.ceil(s.hidden / 128) if s.dtype == "fp8" else s.hidden * 2)
    combine = num_messages * s.hidden * 2
    return {"dispatch": dispatch, "combine": combine, "dispatch+combine": dispatch + combine}


def _time_low_latency(calls: LowLatencyCalls, group, device: torch.device, s: BenchSettings,
                      expert_out: torch.Tensor, num_messages: int, progress: Progress, label: str) -> Dict[str, dict]:
    """dispatch and combine timed alone (flushed L2 unless back_to_back), then eager pairs back to back."""
    handle = calls.dispatch()[2]
    timer = Timer(device, s.gpu_lead_us, flush="back_to_back" not in s.style)
    eager = Timer(device, flush=False)  # the pair: nothing between calls, as in a decode loop
    steps = {"dispatch": (timer, calls.dispatch), "combine": (timer, lambda: calls.combine(expert_out, handle)),
             "dispatch+combine": (eager, lambda: calls.pair(expert_out))}
    sizes = _low_latency_bytes(s, num_messages)
    ops = {}
    for name in progress.steps(f"warm-up and timing, {label} ({s.warmup} + {s.iters} calls each)", list(steps)):
        run_timer, fn = steps[name]
        t = run_timer.run(fn, group, s.warmup, s.iters)
        ops[name] = dict(times_us=t.gpu_us, host_us=t.host_us, recv_bytes=sizes[name], link_bytes=None)
    return ops


def _low_latency_rank(rank: int, R: int, group, s: BenchSettings, device: torch.device, progress: Progress) -> dict:
    inputs = make_inputs(rank, s, device)
    progress.stage(f"buffers: ep_plugin low-latency ({s.backend or 'config'} backend, {s.num_tokens} tokens per "
                   "rank at most)" + (" and the reference backend" if _needs_reference(s) else ""))
    buffer, backend_reason = _our_buffer(group, s, R)
    reference = _reference_buffer(group, s) if _needs_reference(s) else None
    ours = LowLatencyCalls(buffer, inputs, s)
    result = dict(rank=rank, backend=buffer.backend_name, backend_reason=backend_reason, num_sms=s.num_sms,
                  checked=False)
    with torch_defaults(s.style, device):
        recv_x, recv_count, handle, _, _ = ours.dispatch()
    expert_out = torch.randn(_recv_rows(recv_x).shape, generator=inputs.generator).to(torch.bfloat16).to(device)
    if s.check:
        progress.stage("verification: ep_plugin against the reference backend on this run's data")
        with torch_defaults(s.style, device):
            combined = ours.combine(expert_out, handle)[0]
        want = _low_latency_outputs(LowLatencyCalls(reference, inputs, s), expert_out)
        _compare_low_latency_dispatch((recv_x, recv_count), want[:2], peer=False)
        _assert_close("combined_x", combined, want[2])
        result["checked"] = True
        del combined, want
    num_messages = int(recv_count.sum())
    del recv_x, handle
    with torch_defaults(s.style, device):
        result["ops"] = _time_low_latency(ours, group, device, s, expert_out, num_messages, progress, "ep_plugin")
    if "reference" in s.baselines and buffer.backend_name != "reference":
        progress.stage("baseline: the reference backend")
        ref_ops = _time_low_latency(LowLatencyCalls(reference, inputs, s), group, device, s, expert_out,
                                    num_messages, progress, "reference")
        result["ops"].update({"reference_" + name: op for name, op in ref_ops.items()})
    for buf in (buffer, reference):
        if buf is not None:
            buf.destroy()
    return result


def _peer_low_latency(rank: int, R: int, group, s: BenchSettings, device: torch.device, progress: Progress) -> dict:
    """DeepEP V1's low-latency calls on the same data (same seeds), checked against the reference."""
    deep_ep = _import_peer()
    inputs = make_inputs(rank, s, device)
    progress.stage(f"baseline: DeepEP V1 low-latency ({s.num_tokens} tokens per rank at most)")
    peer = _peer_low_latency_buffer(deep_ep, group, s, R)
    report = {"module": getattr(deep_ep, "__file__", None) or PEER_MODULE, "checked": False, "check_error": None,
              "processes": "processes of its own (one NVSHMEM per process), the same ranks and data"}
    calls = LowLatencyCalls(peer, inputs, s)
    with torch_defaults(s.style, device):
        recv_x, recv_count, handle, _, _ = calls.dispatch()
        expert_out = _token_expert_out(recv_x)
        combined = calls.combine(expert_out, handle)[0]
    num_messages = int(recv_count.sum())
    if s.check:
        progress.stage("verification: DeepEP V1 against the reference backend on this run's data")
        reference = _reference_buffer(group, s)
        want = _low_latency_outputs(LowLatencyCalls(reference, inputs, s), None)
        try:
            _compare_low_latency_dispatch((recv_x, recv_count), want[:2], peer=True)
            if isinstance(recv_x, tuple):  # each token's rows were its FP8 values, one step apart at most
                _assert_within_fp8_step("combined_x", combined.float(), want[2].float())
            else:
                _assert_close("combined_x", combined, want[2])
            report["checked"] = True
        except AssertionError as error:
            report["check_error"] = _first_line(error)
        reference.destroy()
        del want
    del recv_x, handle, combined
    with torch_defaults(s.style, device):
        report["ops"] = _time_low_latency(calls, group, device, s, expert_out, num_messages, progress, "DeepEP V1")
    peer.destroy()
    return report


def _peer_low_latency_points(rank: int, R: int, group, points: List[BenchSettings]) -> List[dict]:
    """DeepEP's low-latency runs, in processes of their own: its NVSHMEM and ep_plugin's cannot both
    start in one process."""
    device = rank_device(rank)
    progress = Progress(rank == 0)
    return [_peer_low_latency(rank, R, group, s, device, progress) for s in points]


# ---- one rank -------------------------------------------------------------------------------------
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
    progress = Progress(rank == 0)
    if device.type == "cuda" and R >= 2:
        progress.stage("P2P copy ceiling: 1 GiB into the next GPU, all ranks at once")
    p2p = _p2p_ceiling_gbps(rank, R, group)
    results = []
    for i, s in enumerate(points):
        if len(points) > 1:
            progress.stage(f"point {i + 1}/{len(points)}: {s.num_tokens} tokens, {s.num_sms} SMs, hidden {s.hidden}")
        runner = _normal_rank if s.mode == "normal" else _low_latency_rank
        result = runner(rank, R, group, s, device, progress)
        result.update(p2p_gbps=p2p, device_name=device_name)
        results.append(result)
    return results


# ---- driver -------------------------------------------------------------------------------------
def _aggregate_op(per_rank_ops: List[dict]) -> dict:
    """Medians and quantiles averaged over ranks; GB/s = each rank's bytes / its median, averaged."""
    stats = [summarize(op["times_us"]) for op in per_rank_ops]
    entry = {key: statistics.mean(st[key] for st in stats) for key in ("median_us", "p10_us", "p90_us")}
    entry["host_median_us"] = statistics.mean(statistics.median(op["host_us"]) for op in per_rank_ops)
    for key, bytes_key in (("algo_gbps", "recv_bytes"), ("link_gbps", "link_bytes")):
        counts = [op[bytes_key] for op in per_rank_ops]
        entry[key] = None if counts[0] is None else statistics.mean(
            b / (st["median_us"] * 1e-6) / 1e9 for b, st in zip(counts, stats))
    if per_rank_ops[0].get("path"):
        entry["path"] = per_rank_ops[0]["path"]
    return entry


def aggregate(per_rank: List[dict]) -> Dict[str, dict]:
    """Every operation of one run, over ranks (`per_rank`: each rank's result with its `ops`)."""
    return {name: _aggregate_op([r["ops"][name] for r in per_rank]) for name in per_rank[0]["ops"]}


def _peer_summary(peer_per_rank: List[dict], ops: Dict[str, dict]) -> dict:
    """DeepEP's run: its check, and per operation of ours its figures and the ratio beside ours."""
    peer_ops = aggregate(peer_per_rank)
    for name, entry in ops.items():
        if name in peer_ops:
            theirs = peer_ops[name]
            entry["deepep"] = {k: theirs[k] for k in ("median_us", "p10_us", "p90_us", "algo_gbps", "host_median_us")}
            entry["vs_deepep"] = theirs["median_us"] / entry["median_us"]
    errors = [p["check_error"] for p in peer_per_rank if p["check_error"]]
    return {"module": peer_per_rank[0]["module"], "processes": peer_per_rank[0]["processes"],
            "checked": all(p["checked"] for p in peer_per_rank),
            "check_error": errors[0] if errors else None}


def summarize_run(s: BenchSettings, per_rank: List[dict], num_ranks: int,
                  peer_per_rank: Optional[List[dict]] = None) -> dict:
    p2p = [r["p2p_gbps"] for r in per_rank if r["p2p_gbps"] is not None]
    run = {"settings": {k: v for k, v in dataclasses.asdict(s).items() if k not in ("sweep",)},
           "backend": per_rank[0]["backend"], "backend_reason": per_rank[0]["backend_reason"],
           "num_sms": per_rank[0]["num_sms"], "checked": all(r["checked"] for r in per_rank),
           "style": {name: STYLE_CONDITIONS[name][1] for name in s.style},
           "device_name": per_rank[0]["device_name"], "num_ranks": num_ranks,
           "p2p_gbps": sum(p2p) / len(p2p) if p2p else None, "ops": aggregate(per_rank)}
    if peer_per_rank is not None:
        run["deepep"] = _peer_summary(peer_per_rank, run["ops"])
    return run


def default_num_ranks() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() and torch.cuda.device_count() >= 1 else 2


def _gbps(value: Optional[float]) -> str:
    """One decimal, or three significant digits below 1 GB/s (CPU runs), so that no rate shows as 0.0."""
    if value is None:
        return "-"
    return f"{value:.1f}" if value >= 1 else f"{value:.3g}"


def _verification_line(run: dict) -> str:
    if not run["checked"]:
        return "verified: NO (--no-check)"
    what = "routing metadata and received rows exact, combines within 1e-2"
    if run["backend"] == "reference":
        return (f"verified: the reference backend against itself ({what}): this checks the harness only; "
                "the native kernels need a GPU")
    return f"verified: ep_plugin ({run['backend']}) against the reference backend on this run's data ({what})"


def _peer_line(run: dict) -> Optional[str]:
    peer = run.get("deepep")
    if peer is None:
        return None
    if peer["checked"]:
        verdict = "yes"
    elif peer["check_error"]:
        verdict = f"FAILED ({peer['check_error']})"
    else:
        verdict = "not checked (--no-check)"
    return (f"DeepEP V1 ({peer['module']}), in {peer['processes']}; verified against the reference backend: "
            f"{verdict}")


def format_table(run: dict) -> str:
    s = run["settings"]
    style = ", ".join(run["style"]) if run["style"] else "plain (ep-plugin's own calls)"
    lines = [f"ep_plugin bench: mode={s['mode']} ranks={run['num_ranks']} device={run['device_name']}",
             f"  backend: {run['backend']} ({run['backend_reason']})",
             f"  sizes: {s['num_tokens']} tokens per rank, hidden {s['hidden']}, top-{s['num_topk']} of "
             f"{s['num_experts']} experts, {s['dtype']} payload"
             + (f", {run['num_sms']} SMs" if s["mode"] == "normal" else ""),
             f"  style: {style}",
             _verification_line(run)]
    peer_line = _peer_line(run)
    if peer_line:
        lines.append(peer_line)
    if run["p2p_gbps"] is not None:
        lines.append(f"P2P copy ceiling (1 GiB into the next GPU, all ranks at once): {run['p2p_gbps']:.1f} GB/s per direction")
    with_peer = "deepep" in run
    # host us: the host's time inside each call; where it passes the GPU's, the events timed the host too.
    header = (f"{'operation':<26}{'median us':>11}{'p10 us':>11}{'p90 us':>11}{'algo GB/s':>11}{'link GB/s':>11}"
              f"{'host us':>11}" + (f"{'DeepEP us':>11}{'vs DeepEP':>11}" if with_peer else ""))
    lines += [header, "-" * len(header)]
    for name, e in run["ops"].items():
        path = f"  ({e['path']})" if e.get("path") in ("copy_engine", "pull", "sm") + DISPATCH_PATHS else ""
        peer = ""
        if with_peer:
            peer = (f"{e['deepep']['median_us']:>11.1f}{e['vs_deepep']:>10.2f}x" if "deepep" in e
                    else f"{'-':>11}{'-':>11}")
        lines.append(f"{name:<26}{e['median_us']:>11.1f}{e['p10_us']:>11.1f}{e['p90_us']:>11.1f}"
                     f"{_gbps(e['algo_gbps']):>11}{_gbps(e['link_gbps']):>11}{e['host_median_us']:>11.1f}{peer}{path}")
    return "\n".join(lines)


def built_extensions() -> Dict[str, str]:
    """Each native extension: 'built', or 'not built: why' (its import error)."""
    status = {}
    for name, purpose in (("_C", "normal-mode kernels"), ("_C_nvshmem", "low-latency and internode kernels"),
                          ("_C_torch", "outputs allocated by torch from C++, for both")):
        try:
            importlib.import_module(f"ep_plugin.{name}")
            status[name] = f"built ({purpose})"
        except ImportError as error:
            status[name] = f"not built ({purpose}): {error}"
    return status


def _asked_for(s: BenchSettings, num_ranks: int) -> str:
    """The sizes a run asked for, in words (for an out-of-memory message)."""
    row_bytes = s.hidden * 2
    received = s.num_tokens * min(num_ranks, s.num_topk) * row_bytes
    return (f"{num_ranks} ranks x {s.num_tokens} tokens x hidden {s.hidden} ({s.dtype}): "
            f"{s.num_tokens * row_bytes / 2**20:.0f} MiB of input rows per rank, up to {received / 2**20:.0f} MiB "
            "received per rank; try a smaller --tokens or --hidden, or fewer --ranks")


def _is_out_of_memory(text: str) -> bool:
    return "OutOfMemoryError" in text or "out of memory" in text.lower() or "exited with code -9" in text


def _launch(num_ranks: int, fn: Callable, points: List[BenchSettings]) -> List:
    try:
        return parallel_launch(num_ranks, fn, points, timeout_s=600.0)
    except RuntimeError as error:
        first = str(error).splitlines()[0]
        if _is_out_of_memory(str(error)):
            raise OutOfMemory(f"out of memory ({first}): asked for {_asked_for(points[0], num_ranks)}") from None
        raise


def run_bench(s: BenchSettings) -> dict:
    """Run the benchmark (every sweep point in one launch); returns everything `--out` writes."""
    on_gpu = torch.cuda.is_available() and torch.cuda.device_count() >= 1
    num_ranks = s.num_ranks if s.num_ranks is not None else default_num_ranks()
    base = s.resolved(on_gpu)
    points = [base]
    if s.sweep:
        (key, values), = s.sweep.items()
        points = [dataclasses.replace(base, **{key: v}) for v in values]
    for point in points:
        validate(point, num_ranks, on_gpu)
    points = fit_peer(points, num_ranks)
    base = dataclasses.replace(base, baselines=points[0].baselines)
    where = "one GPU each, NCCL" if on_gpu else "CPU processes, gloo"
    print(f"ep-plugin bench: {num_ranks} ranks ({where}); "
          + (f"sweeping {key} over {values}" if s.sweep else f"baselines: {', '.join(base.baselines) or 'none'}"),
          file=sys.stderr, flush=True)
    per_rank = _launch(num_ranks, _bench_rank, points)
    peer = [None] * len(points)
    if "deepep" in base.baselines and base.mode == "normal":
        peer = [[rank_results[i]["deepep"] for rank_results in per_rank] for i in range(len(points))]
    elif "deepep" in base.baselines:
        print("ep-plugin bench: DeepEP V1 low-latency in processes of their own (one NVSHMEM per process), "
              "same ranks and data", file=sys.stderr, flush=True)
        peer_results = _launch(num_ranks, _peer_low_latency_points, points)
        peer = [[rank_results[i] for rank_results in peer_results] for i in range(len(points))]
    runs = [summarize_run(point, [rank_results[i] for rank_results in per_rank], num_ranks, peer[i])
            for i, point in enumerate(points)]
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "command": s.command,
            "host": platform.node(), "on_gpu": on_gpu, "scaled_down_for_cpu": s.scaled_down(on_gpu),
            "timing": Timer.METHOD, "torch": torch.__version__, "extensions": built_extensions(), "runs": runs}


def plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    sweep_key = next(iter(report.get("sweep", {}) or {}), None)
    fig, ax = plt.subplots(figsize=(7, 4))
    names = [n for n in runs[0]["ops"] if runs[0]["ops"][n]["algo_gbps"] is not None]
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
        ax.tick_params(axis="x", labelrotation=30)
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
            raise UsageError("--plot needs matplotlib: pip install matplotlib (or ep_plugin[plot])") from None
    report = run_bench(s)
    report["sweep"] = s.sweep
    extensions = ", ".join(f"{name} {state.split(' (')[0]}" for name, state in report["extensions"].items())
    print(f"ep_plugin {_version()}: extensions {extensions} (`ep-plugin info` says why)")
    for run in report["runs"]:
        print(format_table(run))
        print()
    if report["scaled_down_for_cpu"]:
        print("note: no GPU here; sizes not given were scaled down for CPU processes over gloo")
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as handle:
            json.dump(report, handle, indent=2)
        print(f"wrote {out}")
    if plot_path:
        plot(report, plot_path)
        print(f"wrote {plot_path}")
    return 0


def _version() -> str:
    from . import __version__
    return __version__
