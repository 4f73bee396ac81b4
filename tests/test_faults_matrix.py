"""benchmarks/faults.py on the CPU: a few cases with the reference backend (gloo), checked in the JSON."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "faults.py"
FIELDS = {"name", "mode", "backend", "expected", "observed", "seconds", "hang", "clear_error", "survived"}


def test_fault_matrix_cases_on_the_reference_backend(tmp_path):
    out = tmp_path / "faults-cpu.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--backend", "reference", "--ranks", "2", "--timeout-s", "2",
                           "--cases", "exit_before_combine,nan_inf_x", "--modes", "low_latency", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    records = json.loads(out.read_text())["faults"]
    assert [(r["name"], r["mode"]) for r in records] == [("exit_before_combine", "low_latency"),
                                                         ("nan_inf_x", "low_latency")]
    for record in records:
        assert FIELDS <= set(record), record
        assert record["backend"] == "reference" and not record["hang"], record
        assert record["clear_error"] and record["survived"], record
    exited, nan = records
    assert "EpCommError" in exited["observed"] and "peer 1" in exited["observed"], exited
    survivor = exited["detail"][0]
    assert survivor["error_type"] == survivor["raised_type"] == "EpCommError", survivor  # raised as it is reported
    assert exited["seconds"] < 60, exited
    assert "WRONG" not in nan["observed"] and "error" not in nan["observed"].lower(), nan
    assert "nan_inf_x" in done.stdout and "0 hangs" in done.stdout, done.stdout


def test_a_dead_rank_keeps_the_signal_and_the_stack_of_its_stopped_thread():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import faults
    finally:
        sys.path.remove(str(SCRIPT.parent))
    stderr = "\n".join([
        "some log line", "Fatal Python error: Aborted", "",
        "Thread 0x0001 (most recent call first):", '  File "other.py", line 1 in idle', "",
        "Current thread 0x0002 (most recent call first):", '  File "faults.py", line 120 in combine',
        '  File "faults.py", line 190 in run', "", "Extension modules: numpy, torch._C (total: 2)",
        "launch failed: rank 0 exited with code -6 without a result"])
    assert faults._stderr_tail(stderr) == [
        "Fatal Python error: Aborted", "Current thread 0x0002 (most recent call first):",
        'File "faults.py", line 120 in combine', 'File "faults.py", line 190 in run',
        "launch failed: rank 0 exited with code -6 without a result"]
    assert faults._stderr_tail("a\nb\nc\nd") == ["b", "c", "d"]
