"""benchmarks/probes/profile_timeline.py and benchmarks/profile_host.py on CPU (reference backend, gloo)."""
import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPT = BENCHMARKS / "probes" / "profile_timeline.py"


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
