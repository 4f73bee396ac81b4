"""The fault matrix: what each backend does when a rank misbehaves (docs/faults.md).

Each case runs in fresh processes (a trapped CUDA context cannot be reused): one child process per
case, under a hard wall-clock guard, starts the ranks with `parallel_launch`. Rank R-1 is the
culprit unless the case says otherwise. Every rank reports what it saw; the case is judged into

    hang         the case did not end within the guard, or a rank that should answer never did
    clear_error  every error raised was a structured one (EpCommError / EpTimeoutError, or a
                 ValueError-like error naming the argument), none a bare CUDA error, and the fault
                 was reported where it had to be; an error is read through `structured_error`, as
                 docs/faults.md tells users to for a trap that surfaces outside ep_plugin
                 (`raised_type` in a rank's detail is the type it raised)
    survived     every rank other than the culprit kept a usable device (its CUDA context, or the
                 CPU) and, where it finished, with correct results

and written to `benchmarks/results/faults-<machine>.json` as {"faults": [...]}.

    python3 benchmarks/faults.py --backend native --ranks 2              # GPU machine
    python3 benchmarks/faults.py --backend reference --ranks 2 --timeout-s 3
    python3 benchmarks/faults.py --cases exit_before_dispatch,nan_inf_x --machine cpu
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the repository's ep_plugin first
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import ep_plugin  # noqa: E402
from ep_plugin.launch import finish_rank, parallel_launch, rank_device  # noqa: E402

T, H, K, T_MAX = 32, 256, 4, 32
LOCAL_EXPERTS = 4
STRUCTURED = (ep_plugin.EpCommError, ValueError, TypeError, NotImplementedError)


@dataclass(frozen=True)
class Case:
    name: str
    modes: tuple
    expected: str
    run: Callable  # run(ctx) -> dict of what this rank saw (raises on errors)
    errors_from: tuple = ("reference", "native")  # backends that must report the fault (others: no error)
    culprit_last: bool = True  # rank R-1 injects the fault


class Ctx:
    """One rank's view of a case: its buffer, inputs and helpers."""

    def __init__(self, rank: int, world: int, group, mode: str, backend: str, timeout_s: float,
                 hidden: int = H, shrink: bool = False, create: bool = True) -> None:
        self.rank, self.world, self.group, self.mode = rank, world, group, mode
        self.backend, self.timeout_s, self.hidden = backend, timeout_s, hidden
        self.culprit = world - 1
        self.device = rank_device(rank)
        self.num_experts = LOCAL_EXPERTS * world
        self.buffer = make_buffer(self, shrink) if create else None

    @property
    def low_latency(self) -> bool:
        return self.mode == "low_latency"

    def inputs(self, seed: int = 0, hidden: Optional[int] = None):
        generator = torch.Generator().manual_seed(seed * 1000 + self.rank)
        x = torch.randn(T, hidden or self.hidden, generator=generator).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(self.num_experts, generator=generator)[:K] for _ in range(T)])
        weights = torch.rand(T, K, generator=generator)
        return x.to(self.device), ids.to(self.device), weights.to(self.device)


def config_for(ctx: Ctx, shrink: bool) -> dict:
    config = {"backend": ctx.backend, "timeout_s": ctx.timeout_s}
    if ctx.backend == "native":
        config["transport"] = "nvlink"
    return config


def make_buffer(ctx: Ctx, shrink: bool, hidden: int = 2 * H) -> ep_plugin.Buffer:
    """A buffer sized for rows of up to `hidden` (the largest any case sends)."""
    R = ctx.world
    if ctx.low_latency:
        rdma = ep_plugin.Buffer.get_low_latency_rdma_size_hint(T_MAX, hidden, R, ctx.num_experts)
        return ep_plugin.Buffer(ctx.group, 0, rdma, low_latency_mode=True, enable_shrink=shrink,
                                config=config_for(ctx, shrink))
    nvl = max(ep_plugin.Buffer.get_dispatch_config(R).get_nvl_buffer_size_hint(hidden * 2, R),
              ep_plugin.Buffer.get_combine_config(R).get_nvl_buffer_size_hint(hidden * 2, R))
    return ep_plugin.Buffer(ctx.group, nvl, 0, config=config_for(ctx, shrink))


# ---- one round, checked --------------------------------------------------------------------------
def dispatch(ctx: Ctx, x, ids, weights, use_fp8: bool = False, t_max: int = T_MAX):
    """One dispatch; returns what its combine needs."""
    if ctx.low_latency:
        recv_x, count, handle, _, _ = ctx.buffer.low_latency_dispatch(x, ids, t_max, ctx.num_experts,
                                                                      use_fp8=use_fp8)
        return recv_x, count, handle
    per_rank, _, per_expert, in_rank, _ = ctx.buffer.get_dispatch_layout(ids, ctx.num_experts)
    recv_x, _, _, _, handle, _ = ctx.buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                     num_tokens_per_expert=per_expert, topk_idx=ids,
                                                     topk_weights=weights)
    return recv_x, None, handle


def combine(ctx: Ctx, dispatched, ids, weights) -> torch.Tensor:
    """Combine with identity experts: normal mode returns x times the ranks a token went to,
    low-latency mode x times the sum of its routed weights (an FP8 dispatch's rows dequantized)."""
    recv_x, _, handle = dispatched
    if ctx.low_latency:
        if isinstance(recv_x, tuple):
            from ep_plugin import fp8
            recv_x = fp8.dequantize(*recv_x).to(torch.bfloat16)
        return ctx.buffer.low_latency_combine(recv_x, ids, weights, handle)[0]
    return ctx.buffer.combine(recv_x, handle)[0]


def expected_combine(ctx: Ctx, x, ids, weights, masked: tuple = ()) -> torch.Tensor:
    owner = torch.where(ids >= 0, ids // LOCAL_EXPERTS, -1)
    used = (ids >= 0)
    for rank in masked:
        used &= owner != rank
    if ctx.low_latency:
        factor = (weights * used).sum(dim=1, keepdim=True)
    else:
        ranks = torch.zeros(ids.size(0), ctx.world, dtype=torch.bool, device=ids.device)
        ranks.scatter_(1, torch.where(used, owner, 0), used)
        factor = ranks.sum(dim=1, keepdim=True).float()
    return (x.float() * factor).to(torch.bfloat16)


def checked_round(ctx: Ctx, seed: int = 0, masked: tuple = ()) -> dict:
    x, ids, weights = ctx.inputs(seed)
    out = combine(ctx, dispatch(ctx, x, ids, weights), ids, weights)
    want = expected_combine(ctx, x, ids, weights, masked)
    correct = bool(torch.allclose(out.float(), want.float(), rtol=2e-2, atol=2e-2))
    return {"outcome": "ok", "correct": correct}


# ---- the cases -------------------------------------------------------------------------------------
def exit_before(stage: str):
    def run(ctx: Ctx) -> dict:
        x, ids, weights = ctx.inputs()
        if stage == "dispatch" and ctx.rank == ctx.culprit:
            finish_rank({"outcome": "exited"})
        dispatched = dispatch(ctx, x, ids, weights)
        if stage == "combine" and ctx.rank == ctx.culprit:
            sync(ctx)
            finish_rank({"outcome": "exited"})
        combine(ctx, dispatched, ids, weights)
        sync(ctx)
        if not ctx.low_latency:
            # The host does not wait for a combine: an error its kernels met comes from the Buffer's next
            # call, which a training loop always makes (docs/faults.md).
            ctx.buffer.get_dispatch_layout(ids, ctx.num_experts)
        return {"outcome": "ok"}
    return run


def stall_past_timeout(ctx: Ctx) -> dict:
    if ctx.rank == ctx.culprit:
        time.sleep(ctx.timeout_s + 2.0)
    return checked_round(ctx)


def skip_one_call(ctx: Ctx) -> dict:
    """The culprit skips the first round, then joins the second."""
    if ctx.rank != ctx.culprit:
        checked_round(ctx, seed=0)
    return checked_round(ctx, seed=1)


def disagree(what: str):
    def run(ctx: Ctx) -> dict:
        culprit = ctx.rank == ctx.culprit
        x, ids, weights = ctx.inputs(hidden=2 * H if culprit and what == "hidden" else H)
        if what == "t_max":
            dispatched = dispatch(ctx, x, ids, weights, t_max=T_MAX * 2 if culprit else T_MAX)
        elif what == "dtype" and ctx.low_latency:
            dispatched = dispatch(ctx, x, ids, weights, use_fp8=culprit)
        elif what == "dtype":
            from ep_plugin import fp8
            data = fp8.quantize(x, False, False) if culprit else x
            dispatch(ctx, data, ids, weights)
            sync(ctx)
            return {"outcome": "ok"}
        else:
            dispatched = dispatch(ctx, x, ids, weights)
        combine(ctx, dispatched, ids, weights)
        sync(ctx)
        if not ctx.low_latency:
            # The host does not wait for a combine: an error its kernels met comes from the Buffer's next
            # call, which a training loop always makes (docs/faults.md).
            ctx.buffer.get_dispatch_layout(ids, ctx.num_experts)
        return {"outcome": "ok"}
    return run


def bad_expert_id(ctx: Ctx) -> dict:
    """The culprit's topk_idx[0, 0] is one past the last expert. Where the round runs, the id counts as -1
    (native low-latency mode, and the reference without check_inputs) and every rank checks its result
    so; native low-latency mode records the id on the device and raises it at the culprit's next
    low_latency_dispatch, which the culprit makes."""
    x, ids, weights = ctx.inputs()
    if ctx.rank == ctx.culprit:
        ids[0, 0] = ctx.num_experts  # one past the last expert
    out = combine(ctx, dispatch(ctx, x, ids, weights), ids, weights)
    sync(ctx)
    want = expected_combine(ctx, x, torch.where(ids < ctx.num_experts, ids, -1), weights)
    correct = bool(torch.allclose(out.float(), want.float(), rtol=2e-2, atol=2e-2))
    if ctx.low_latency and ctx.backend == "native" and ctx.rank == ctx.culprit:
        dispatch(ctx, x, ids, weights)
    return {"outcome": "ok", "correct": correct}


def nan_inf_x(ctx: Ctx) -> dict:
    """Rank 0 sends a NaN row and an Inf element: they reach their own tokens only."""
    x, ids, weights = ctx.inputs()
    if ctx.rank == 0:
        x[0] = float("nan")
        x[1, 3] = float("inf")
    out = combine(ctx, dispatch(ctx, x, ids, weights), ids, weights)
    want = expected_combine(ctx, x, ids, weights)
    finite = torch.isfinite(want)
    same_finite = bool(torch.allclose(out.float()[finite], want.float()[finite], rtol=2e-2, atol=2e-2))
    same_specials = bool(torch.equal(torch.isnan(out), torch.isnan(want)) and
                         torch.equal(torch.isinf(out), torch.isinf(want)))
    return {"outcome": "ok", "correct": same_finite and same_specials}


def buffer_too_small(ctx: Ctx) -> dict:
    """A buffer sized for hidden H, used with rows of 8 H."""
    ctx.buffer = make_buffer(ctx, False, hidden=H)
    x, ids, weights = ctx.inputs(hidden=8 * H)
    combine(ctx, dispatch(ctx, x, ids, weights), ids, weights)
    sync(ctx)
    return {"outcome": "ok", "note": "no error (this backend needs no buffer of that size)"}


def subset_buffer(ctx: Ctx) -> dict:
    """Every rank but the culprit creates a Buffer and dispatches."""
    if ctx.rank == ctx.culprit:
        time.sleep(ctx.timeout_s + 2.0)
        finish_rank({"outcome": "absent"})
    ctx.buffer = make_buffer(ctx, False)
    return checked_round(ctx)


def masked(fault: str):
    """Shrink mode: the culprit exits (before the dispatch, or after it before the combine) or stalls past
    timeout_s; the others mask it and finish two rounds with it masked. The stalled culprit calls once its
    peers have masked it (they stay alive meanwhile): it masks them in turn and gets its own experts'
    outputs only. (A rank that skips a call without stalling pairs its next call with its peers' skipped
    one, masked or not: see skip_one_call.)"""
    def run(ctx: Ctx) -> dict:
        others = tuple(r for r in range(ctx.world) if r != ctx.rank)
        if ctx.rank == ctx.culprit:
            if fault == "exit_before_dispatch":
                finish_rank({"outcome": "exited"})
            if fault == "exit_before_combine":
                x, ids, weights = ctx.inputs(0)
                dispatch(ctx, x, ids, weights)
                sync(ctx)
                finish_rank({"outcome": "exited"})
            time.sleep(ctx.timeout_s + 2.0)  # stall_past_timeout
            return checked_round(ctx, 0, masked=others)
        first = checked_round(ctx, 0, masked=(ctx.culprit,))
        second = checked_round(ctx, 1, masked=(ctx.culprit,))
        if fault == "stall_past_timeout":
            time.sleep(2 * ctx.timeout_s + 4.0)  # alive while the culprit's late call runs
        return {"outcome": "ok", "correct": first["correct"] and second["correct"]}
    return run


CASES: Dict[str, Case] = {case.name: case for case in [
    Case("exit_before_dispatch", ("normal", "low_latency"),
         "the others raise EpCommError naming the rank within timeout_s", exit_before("dispatch")),
    Case("exit_before_combine", ("normal", "low_latency"),
         "the others raise EpCommError naming the rank within timeout_s", exit_before("combine")),
    Case("stall_past_timeout", ("normal", "low_latency"),
         "the others raise EpTimeoutError naming the rank; the late rank gets a clear error", stall_past_timeout),
    Case("skip_one_call", ("normal", "low_latency"),
         "the others raise EpTimeoutError naming the rank", skip_one_call),
    Case("disagree_t_max", ("low_latency",), "every rank raises an error naming T_max", disagree("t_max")),
    Case("disagree_hidden", ("normal", "low_latency"), "every rank raises an error naming the layout",
         disagree("hidden")),
    Case("disagree_dtype", ("normal", "low_latency"), "every rank raises an error naming the layout / FP8 option",
         disagree("dtype")),
    Case("bad_expert_id", ("normal", "low_latency"),
         "native: every rank raises ValueError naming topk_idx[0, 0] of the culprit before any kernel (normal "
         "mode), or the round treats the id as -1 and the culprit's next low_latency_dispatch raises it "
         "(low-latency mode); reference (check_inputs off): the id counts as -1, results correct",
         bad_expert_id, errors_from=("native",)),
    Case("nan_inf_x", ("normal", "low_latency"),
         "NaN/Inf reach the culprit's own tokens only; every other value is correct", nan_inf_x,
         errors_from=(), culprit_last=False),
    Case("buffer_too_small", ("normal", "low_latency"),
         "ValueError naming the buffer size before any kernel (native); the reference needs no buffer",
         buffer_too_small, errors_from=("native",), culprit_last=False),
    Case("subset_buffer", ("normal", "low_latency"),
         "the ranks with a Buffer raise an error naming the absent rank", subset_buffer),
    Case("masked_exit", ("low_latency",),
         "shrink mode: the others mask the rank and finish with correct results", masked("exit_before_dispatch"),
         errors_from=()),
    Case("masked_exit_before_combine", ("low_latency",),
         "shrink mode: the others mask the rank in the combine and finish with correct results",
         masked("exit_before_combine"), errors_from=()),
    Case("masked_stall_past_timeout", ("low_latency",),
         "shrink mode: the others mask the rank and finish with correct results; the late rank masks them",
         masked("stall_past_timeout"), errors_from=()),
]}


# ---- running a case ---------------------------------------------------------------------------------
def sync(ctx: Ctx) -> None:
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)


def device_usable(device: torch.device) -> bool:
    if device.type != "cuda":
        return True
    try:
        torch.ones(4, device=device).sum().item()
        torch.cuda.synchronize(device)
        return True
    except Exception:  # noqa: BLE001 - a trapped context
        return False


def case_rank(rank: int, world: int, group, name: str, mode: str, backend: str, timeout_s: float):
    case = CASES[name]
    started = time.monotonic()
    ctx = None
    try:
        create = name not in ("subset_buffer", "buffer_too_small")
        ctx = Ctx(rank, world, group, mode, backend, timeout_s, shrink=name.startswith("masked_"), create=create)
        seen = case.run(ctx)
    except Exception as raised:  # noqa: BLE001 - the error is the observation
        buffer = getattr(ctx, "buffer", None)
        # NOTE: a trap can surface outside ep_plugin (the case's own synchronize), as torch's CUDA error; the
        # harness translates it as docs/faults.md tells users to. `raised_type` keeps what was raised.
        error = ep_plugin.errors.structured_error(raised, ep_plugin.errors.runtimes_of(buffer._backend)
                                                  if buffer is not None and buffer._backend is not None else ())
        seen = {"outcome": "error", "error_type": type(error).__name__, "raised_type": type(raised).__name__,
                "message": str(error)[:600], "structured": isinstance(error, STRUCTURED),
                "peers": list(getattr(error, "peers", ()))}
    seen.update(rank=rank, seconds=round(time.monotonic() - started, 2), device_ok=device_usable(rank_device(rank)))
    finish_rank(seen)  # NOTE: no teardown: a process group with an abandoned collective, or a stopped context


def judge(case: Case, backend: str, world: int, ranks: List[dict]) -> dict:
    """The record's judgement of what the ranks saw (see the module docstring)."""
    culprit = world - 1 if case.culprit_last else -1
    others = [r for r in ranks if r["rank"] != culprit]
    errors = [r for r in ranks if r["outcome"] == "error"]
    bare_cuda = any("CUDA error" in r["message"] and not r["structured"] for r in errors)
    all_structured = all(r["structured"] for r in errors) and not bare_cuda
    if backend in case.errors_from:
        reported = any(r["outcome"] == "error" for r in ranks)
        clear = all_structured and reported
    else:
        clear = not errors
    survived = all(r["device_ok"] and r.get("correct", True) for r in others)
    observed = "; ".join(
        f"rank {r['rank']}: " + (f"{r['error_type']}: {r['message'][:160]}" if r["outcome"] == "error"
                                 else r["outcome"] + ("" if r.get("correct", True) else " (WRONG RESULT)"))
        for r in sorted(ranks, key=lambda r: r["rank"]))
    return {"observed": observed, "clear_error": clear, "survived": survived}


def run_case(name: str, mode: str, args) -> dict:
    """The case in a child process under a hard guard; its record."""
    case = CASES[name]
    guard_s = 4 * args.timeout_s + 60
    command = [sys.executable, str(Path(__file__).resolve()), "--run-case", name, "--mode", mode,
               "--backend", args.backend, "--ranks", str(args.ranks), "--timeout-s", str(args.timeout_s)]
    started = time.monotonic()
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True, cwd=str(ROOT))
    try:
        stdout, stderr = child.communicate(timeout=guard_s)
        hang = False
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)  # the child and every rank it started
        stdout, stderr = child.communicate()
        hang = True
    seconds = round(time.monotonic() - started, 1)
    record = {"name": name, "mode": mode, "backend": args.backend, "expected": case.expected, "seconds": seconds,
              "hang": hang}
    ranks = _ranks_from(stdout)
    if hang or ranks is None:
        tail = _stderr_tail(stderr or "")
        record.update(observed=("no end within %d s" % guard_s) if hang else "no report: " + " | ".join(tail),
                      clear_error=False, survived=False)
        return record
    record.update(judge(case, args.backend, args.ranks, ranks))
    record["detail"] = ranks
    return record


def _stderr_tail(stderr: str) -> List[str]:
    """What explains a rank that died: faulthandler's "Fatal Python error" line (the signal) and the Python
    stack of the thread it stopped (else the last lines), then the launcher's last line."""
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    fatal = [i for i, line in enumerate(lines) if line.startswith("Fatal Python error")]
    if not fatal:
        return lines[-3:]
    after = lines[fatal[-1] + 1:]
    current = next((i for i, line in enumerate(after) if line.startswith("Current thread")), 0)
    stack = [line for line in after[current:] if line.startswith(("Current thread", "Thread", "File"))]
    return [lines[fatal[-1]]] + stack[:12] + lines[-1:]


def _ranks_from(stdout: str) -> Optional[List[dict]]:
    for line in reversed((stdout or "").splitlines()):
        if line.startswith("FAULT_RANKS "):
            return json.loads(line[len("FAULT_RANKS "):])
    return None


def child_main(args) -> None:
    """In the child: run the ranks; print what each saw."""
    launch_s = 4 * args.timeout_s + 30  # the process group's own timeout: a backstop for the backends
    try:
        ranks = parallel_launch(args.ranks, case_rank, args.run_case, args.mode, args.backend, args.timeout_s,
                                timeout_s=launch_s)
    except RuntimeError as error:  # a rank that died without a report
        print(f"launch failed: {str(error)[:400]}", file=sys.stderr)
        return
    for rank, seen in enumerate(ranks):  # a culprit that ended itself reported its outcome only
        seen.setdefault("rank", rank)
        seen.setdefault("device_ok", True)
    print("FAULT_RANKS " + json.dumps(ranks))


def merged(path: Path, records: List[dict]) -> List[dict]:
    """The file's records with this run's replacing those of the same (name, mode, backend): runs split
    by mode, case or backend fill one file."""
    key = lambda r: (r["name"], r["mode"], r["backend"])  # noqa: E731
    fresh = {key(r) for r in records}
    kept = json.loads(path.read_text())["faults"] if path.exists() else []
    return [r for r in kept if key(r) not in fresh] + records


def machine_name(args) -> str:
    if args.machine:
        return args.machine
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0).replace("NVIDIA ", "").split()[0].lower()
        return f"{name}x{torch.cuda.device_count()}"
    return platform.machine() or "cpu"


TABLE_HEADER = f"{'case':24} {'mode':12} {'s':>6}  hang  clear  survived  observed"


def table_row(r: dict) -> str:
    return (f"{r['name']:24} {r['mode']:12} {r['seconds']:6.1f}  {str(r['hang'])[0]:4}  {str(r['clear_error'])[0]:5}  "
            f"{str(r['survived'])[0]:8}  {r['observed'][:110]}")


def print_totals(records: List[dict]) -> None:
    hangs = sum(r["hang"] for r in records)
    print(f"{len(records)} cases: {hangs} hangs, {sum(not r['clear_error'] for r in records)} unclear, "
          f"{sum(not r['survived'] for r in records)} not survived")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("reference", "native"), default="reference")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=5.0)
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--modes", default="normal,low_latency")
    parser.add_argument("--machine", default="")
    parser.add_argument("--out", default="", help="default: benchmarks/results/faults-<machine>.json")
    parser.add_argument("--run-case", default="", help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="normal", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> List[dict]:
    args = parse_args(argv)
    if args.run_case:
        child_main(args)
        return []
    names = [n for n in args.cases.split(",") if n] or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; known: {', '.join(CASES)}")
    modes = [m for m in args.modes.split(",") if m]
    print(TABLE_HEADER, flush=True)
    records = []
    for name in names:
        for mode in (m for m in CASES[name].modes if m in modes):
            records.append(run_case(name, mode, args))
            print(table_row(records[-1]), flush=True)  # each row as its case ends: a long matrix shows progress
    print_totals(records)
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"faults-{machine_name(args)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"faults": merged(out, records)}, indent=1) + "\n")
    print(f"wrote {out}")
    return records


if __name__ == "__main__":
    main()
