"""benchmarks/soak.py on the CPU: a short soak with the reference backend (the GPU run is the lead's)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "soak.py"


def test_short_soak_runs_both_modes_with_checks_and_cycles(tmp_path):
    out = tmp_path / "soak.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--iters", "12", "--cycles", "2", "--check-every", "3",
                           "--seed", "5", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["settings"]["backend"] == "reference" and len(result["ranks"]) == 2
    for rank in result["ranks"]:
        counts = rank["counts"]
        assert counts["normal"] + counts["low_latency"] == 12 and counts["checks"] == 4, counts
        assert counts["normal"] > 0 and counts["low_latency"] > 0, counts  # seed 5 draws both modes
    assert "create/destroy cycles" in done.stdout
