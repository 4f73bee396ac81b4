"""benchmarks/probes/profile_timeline.py and benchmarks/profile_host.py on CPU (reference backend, gloo)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPT = BENCHMARKS / "probes" / "profile_timeline.py"


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_profile_timeline_reports_every_step_of_every_rank(tmp_path, dtype):
    run = subprocess.run([sys.executable, str(SCRIPT), "--backend", "reference", "--ranks", "2", "--tokens", "64",
                          "--hidden", "256", "--topk", "2", "--experts", "8", "--warmup", "1", "--iters", "2",
                          "--dtype", dtype, "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((tmp_path / "steps.json").read_text())
    assert [r["rank"] for r in report["steps"]] == [0, 1]
    for rank in report["steps"]:
        assert rank["backend"] == "reference"
        assert [s["step"] for s in rank["steps"]] == ["ep.layout", "ep.dispatch", "ep.cached_dispatch", "ep.combine"]
        assert all(s["host_us"] > 0 for s in rank["steps"])
    for rank in (0, 1):
        assert "ep.dispatch" in (tmp_path / f"kernels_rank{rank}.txt").read_text()
        assert json.loads((tmp_path / f"timeline_rank{rank}.json").read_text())["traceEvents"]
    assert "ep.combine" in run.stdout and "top kernels" in run.stdout


def test_step_summary_lists_each_steps_kernels_with_the_idle_gap_before_each(tmp_path):
    sys.path.insert(0, str(SCRIPT.parent))
    import profile_timeline

    def step(cat, ts, dur):
        return {"ph": "X", "name": "ep.dispatch", "cat": cat, "ts": ts, "dur": dur}

    def kernel(name, ts, dur):
        return {"ph": "X", "name": name, "cat": "kernel", "ts": ts, "dur": dur}

    events = []
    # Two rounds: notify, an idle gap that differs per round, then the dispatch kernel; and a third
    # round with another sequence of kernels, which the medians leave out.
    for start, gap, notify, rows in ((1000, 40, 20, 500), (5000, 60, 22, 510), (9000, 0, 0, 300)):
        events.append(step("user_annotation", start - 50, 900))
        if notify:
            events.append(kernel("void ep_plugin::notify_kernel<4>(Args)", start, notify))
        rows_start = start + notify + gap
        events.append(kernel("ep_plugin::direct_dispatch_kernel(Args)", rows_start, rows))
        events.append(step("gpu_user_annotation", start, rows_start + rows - start))
    events.append(kernel("other_kernel", 20000, 5))  # outside every step
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    (row,) = profile_timeline.step_summary(str(trace))
    assert row["step"] == "ep.dispatch" and row["host_us"] == 900
    assert row["work"] == [{"name": "notify_kernel", "gap_us": 0.0, "dur_us": 21.0},
                           {"name": "direct_dispatch_kernel", "gap_us": 50.0, "dur_us": 505.0}]


def test_profile_host_times_every_call_of_the_round_on_every_rank():
    script = BENCHMARKS / "profile_host.py"
    run = subprocess.run([sys.executable, str(script), "--ranks", "2", "--tokens", "32", "--hidden", "256",
                          "--topk", "2", "--experts", "8", "--iters", "3", "--top", "5"],
                         capture_output=True, text=True, timeout=240, cwd=BENCHMARKS.parent)
    assert run.returncode == 0, run.stderr[-3000:]
    for rank in (0, 1):
        line = next(l for l in run.stdout.splitlines() if l.startswith(f"rank {rank}:"))
        times = dict(part.rsplit(" ", 1) for part in line.split(": ", 1)[1].split(", "))
        assert list(times) == ["layout", "dispatch", "cached_dispatch", "combine"]
        assert all(float(v) > 0 for v in times.values())
    assert "by own time" in run.stdout and "buffer.py" in run.stdout


def test_profile_host_eager_reports_every_ranks_host_loop():
    script = BENCHMARKS / "profile_host.py"
    run = subprocess.run([sys.executable, str(script), "--eager", "--ranks", "2", "--tokens", "8", "--hidden", "256",
                          "--topk", "2", "--experts", "8", "--iters", "3", "--top", "5"],
                         capture_output=True, text=True, timeout=240, cwd=BENCHMARKS.parent)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    for label in ("ep_plugin ", "ep_plugin (global default cuda/bf16) "):
        row = next(i for i, line in enumerate(lines) if line.startswith(label))
        loops = lines[row + 1].split("the timed host loops, rank by rank: ", 1)[1]
        for name in ("get_dispatch_layout", "ll_dispatch+combine"):
            part = next(p for p in loops.split("; ") if p.startswith(name + ": "))
            ranks = part.split(": ", 1)[1].split(" | ")
            assert len(ranks) == 2
            for report in ranks:
                fields = report.split()
                assert fields[0] == "host" and float(fields[1]) > 0
                assert fields[2] == "cpu" and fields[3].endswith("%")
                assert fields[4] == "runqueue" and fields[5].endswith("%")
                assert fields[6] == "switches" and all(int(n) >= 0 for n in fields[7].split("/"))
                assert fields[12:15] == ["busiest", "other", "thread"] and fields[16].endswith("%")
