"""benchmarks/profile_timeline.py and profile_host.py on CPU (reference backend, gloo): steps, tables, traces."""
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "profile_timeline.py"


def test_profile_timeline_reports_every_step_of_every_rank(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), "--backend", "reference", "--ranks", "2", "--tokens", "64",
                          "--hidden", "256", "--topk", "2", "--experts", "8", "--warmup", "1", "--iters", "2",
                          "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((tmp_path / "steps.json").read_text())
    assert [r["rank"] for r in report["steps"]] == [0, 1]
    for rank in report["steps"]:
        assert rank["backend"] == "reference"
        assert [s["step"] for s in rank["steps"]] == ["ep.layout", "ep.dispatch", "ep.combine"]
        assert all(s["host_us"] > 0 for s in rank["steps"])
    for rank in (0, 1):
        assert "ep.dispatch" in (tmp_path / f"kernels_rank{rank}.txt").read_text()
        assert json.loads((tmp_path / f"timeline_rank{rank}.json").read_text())["traceEvents"]
    assert "ep.combine" in run.stdout and "top kernels" in run.stdout


def test_profile_host_times_every_call_of_the_round_on_every_rank():
    script = SCRIPT.parent / "profile_host.py"
    run = subprocess.run([sys.executable, str(script), "--ranks", "2", "--tokens", "32", "--hidden", "256",
                          "--topk", "2", "--experts", "8", "--iters", "3", "--top", "5"],
                         capture_output=True, text=True, timeout=240, cwd=SCRIPT.parent.parent)
    assert run.returncode == 0, run.stderr[-3000:]
    for rank in (0, 1):
        line = next(l for l in run.stdout.splitlines() if l.startswith(f"rank {rank}:"))
        times = dict(part.rsplit(" ", 1) for part in line.split(": ", 1)[1].split(", "))
        assert list(times) == ["layout", "dispatch", "cached_dispatch", "combine"]
        assert all(float(v) > 0 for v in times.values())
    assert "by own time" in run.stdout and "buffer.py" in run.stdout


def _synthetic_combine_trace(path: Path, offset_us: float, rounds: int = 3) -> None:
    """A Chrome trace shaped like a profiled copy-engine combine: caller stream 7 (sleep, flush, markers), copy
    stream 20, reduction stream 21; every time `offset_us` later than rank 0's."""
    def event(name, cat, stream, ts, dur):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}

    events = []
    for i in range(rounds):
        base = i * 1000.0 + offset_us
        events += [event("spin_kernel", "kernel", 7, base, 400), event("fill_kernel", "kernel", 7, base + 400, 20),
                   event("vectorized_elementwise_kernel<CUDAFunctor_add>", "kernel", 7, base + 420, 2),
                   event("staging_wait_kernel", "kernel", 20, base + 425, 4),
                   event("Memcpy PtoP (Device -> Device)", "gpu_memcpy", 20, base + 440 + i, 152),
                   event("staged_reduce_kernel<true, true>", "kernel", 21, base + 426, 180),
                   event("Memset (Device)", "gpu_memset", 21, base + 608, 14),
                   event("elementwise_kernel<MulFunctor>", "kernel", 7, base + 612, 2)]
    path.write_text(json.dumps({"traceEvents": events, "baseTimeNanoseconds": 10 ** 12}))


def test_combine_timeline_puts_both_ranks_on_one_clock(tmp_path):
    script = SCRIPT.parent / "combine_timeline.py"
    traces = [tmp_path / "combine_rank0.json", tmp_path / "combine_rank1.json"]
    _synthetic_combine_trace(traces[0], 0.0)
    _synthetic_combine_trace(traces[1], 3.0)
    run = subprocess.run([sys.executable, str(script), "--traces", *map(str, traces)],
                         capture_output=True, text=True, timeout=120, cwd=SCRIPT.parent.parent)
    assert run.returncode == 0, run.stderr[-3000:]
    rank0 = run.stdout.split("rank 1:")[0]
    rows = {line[:52].strip(): line[52:].split() for line in rank0.splitlines()[2:] if line.strip()}
    # From rank 0's start marker's end (422 us into each round): the rows copy starts 18 + i us in, so its median is 19.
    assert rows["copy:Memcpy PtoP#1"][:3] == ["19.0", "171.0", "152.0"]
    assert rows["reduce:staged_reduce_kernel#1"][:2] == ["4.0", "184.0"]
    assert rows["peer reduce:staged_reduce_kernel#1"][:2] == ["7.0", "187.0"]
    assert rows["caller: end marker starts"][0] == "190.0"
    assert rows["peer: end marker starts"][0] == "193.0"
    assert "rank 0: 3 combines" in run.stdout and "rank 1: 3 combines" in run.stdout
    assert (tmp_path / "summary.txt").read_text() == run.stdout.removesuffix("\n")


def test_combine_timeline_names_each_owners_copy_stream_at_more_ranks():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import combine_timeline
    finally:
        sys.path.remove(str(SCRIPT.parent))

    def event(name, cat, stream):
        return {"name": name, "cat": cat, "stream": stream, "start": 0.0, "end": 1.0}

    copy = "Memcpy PtoP (Device -> Device)"
    three_owners = [event("spin_kernel", "kernel", 7), event(copy, "gpu_memcpy", 31), event(copy, "gpu_memcpy", 30),
                    event("staged_reduce_kernel<true, true>", "kernel", 21), event(copy, "gpu_memcpy", 32),
                    event(copy, "gpu_memcpy", 31)]
    assert combine_timeline.stream_roles(three_owners) == {7: "s7", 31: "copy1", 30: "copy2", 21: "reduce",
                                                           32: "copy3"}
    one_owner = [event("staging_wait_kernel", "kernel", 20), event(copy, "gpu_memcpy", 20)]
    assert combine_timeline.stream_roles(one_owner) == {20: "copy"}
