"""The `ep-plugin` command: `bench` (the main job) and `config check`, on CPU processes over gloo.

`bench` runs its own check against the reference backend; here the JSON it writes must hold the
resolved configuration and, per operation, the statistics README promises, consistent with each
other (p10 <= median <= p90, bandwidth = bytes / median time).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ep_plugin import cli

ROOT = Path(__file__).resolve().parent.parent
SETTINGS_KEYS = {"mode", "backend", "num_tokens", "hidden", "num_topk", "num_experts", "num_sms", "dtype", "command"}
OP_KEYS = {"median_us", "p10_us", "p90_us", "algo_gbps", "link_gbps", "host_median_us"}


def run_bench(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "--warmup", "1", "--iters", "3", "--out", str(out), *args]) == 0
    return json.loads(out.read_text())


def check_op(name: str, op: dict) -> None:
    assert OP_KEYS <= set(op), f"{name}: missing {OP_KEYS - set(op)}"
    assert 0 < op["p10_us"] <= op["median_us"] <= op["p90_us"], f"{name}: {op}"
    assert op["algo_gbps"] > 0, f"{name}: {op}"
    assert op["host_median_us"] > 0, f"{name}: {op}"


@pytest.mark.parametrize("mode,dtype", [("normal", "bf16"), ("normal", "fp8"), ("low_latency", "fp8"),
                                        ("low_latency", "bf16")])
def test_bench_writes_a_checked_report(tmp_path, mode, dtype):
    report = run_bench(tmp_path, "--mode", mode, "--dtype", dtype, "--tokens", "48", "--hidden", "256",
                       "--topk", "3", "--experts", "8")
    assert report["scaled_down_for_cpu"] is True
    assert report["command"].startswith("ep-plugin bench")
    assert report["date"] and report["timing"]
    (run,) = report["runs"]
    assert run["checked"] is True and run["num_ranks"] == 2 and run["backend"] == "reference"
    settings = run["settings"]
    assert SETTINGS_KEYS <= set(settings)
    assert (settings["mode"], settings["dtype"], settings["num_tokens"], settings["hidden"], settings["num_topk"],
            settings["num_experts"]) == (mode, dtype, 48, 256, 3, 8)
    expected_ops = {"dispatch", "dispatch_cached", "combine"} if mode == "normal" else {"dispatch", "combine"}
    assert set(run["ops"]) == expected_ops
    for name, op in run["ops"].items():
        check_op(name, op)


def test_bench_sweep_runs_every_point_and_plots(tmp_path):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "sweep.png"
    report = run_bench(tmp_path, "--sweep", "tokens=16,40", "--hidden", "128", "--topk", "2", "--experts", "4",
                       "--plot", str(plot))
    assert [run["settings"]["num_tokens"] for run in report["runs"]] == [16, 40]
    assert all(run["checked"] for run in report["runs"])
    assert plot.stat().st_size > 1000 and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("sweep", ["colour=1,2", "tokens=", "tokens=a,b", "num_sms"])
def test_bad_sweep_is_refused(sweep):
    with pytest.raises(SystemExit, match="--sweep"):
        cli.main(["bench", "--sweep", sweep])


def test_console_script_runs_with_no_arguments():
    """README's main-job command, exactly as a user types it (embedded defaults, CPU fallback)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EP_PLUGIN_")}
    done = subprocess.run([sys.executable, "-m", "ep_plugin", "bench"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "verified against the reference backend: yes" in done.stdout
    assert "dispatch" in done.stdout and "combine" in done.stdout


def test_config_check_prints_the_resolved_environment(capsys):
    assert cli.main(["config", "check", str(ROOT / "configs" / "normal_ibrc_dual_port.yaml")]) == 0
    out = capsys.readouterr().out
    assert "ibrc" in out and "NVSHMEM_" in out


def test_config_check_names_the_bad_key(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("mode: normal\nnum_smz: 24\n")
    assert cli.main(["config", "check", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "num_smz" in err and str(bad) in err


def test_bench_backend_comes_from_the_config_unless_given(tmp_path):
    """A file that names the native backend is obeyed (here, without GPUs, that fails loudly); the flag wins."""
    config = tmp_path / "native.yaml"
    config.write_text("backend: native\n")
    sizes = ["--tokens", "16", "--hidden", "128", "--topk", "2", "--experts", "4", "--no-baseline"]
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="backend 'native' requested but unavailable"):
            run_bench(tmp_path, "--config", str(config), *sizes)
    report = run_bench(tmp_path, "--config", str(config), "--backend", "reference", *sizes)
    assert report["runs"][0]["backend"] == "reference" and report["runs"][0]["checked"]
    with pytest.raises(SystemExit):
        cli.main(["bench", "--backend", "fastest"])
