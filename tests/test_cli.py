"""The `ep-plugin` command: `bench` (the main job), `info` and `config check`, on CPU processes over gloo.

`bench` runs its own check against the reference backend; here the JSON it writes must hold the
resolved configuration and, per operation, the statistics README promises, consistent with each
other (p10 <= median <= p90, bandwidth = bytes / median time). Bad arguments end with one line
naming the argument and exit code 2.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ep_plugin import bench as bench_module
from ep_plugin import cli

ROOT = Path(__file__).resolve().parent.parent
SETTINGS_KEYS = {"mode", "backend", "num_tokens", "hidden", "num_topk", "num_experts", "num_sms", "dtype", "command",
                 "style", "baselines"}
OP_KEYS = {"median_us", "p10_us", "p90_us", "algo_gbps", "link_gbps", "host_median_us"}
NORMAL_OPS = {"layout", "dispatch", "dispatch_cached", "combine", "combine_without_weights"}
LOW_LATENCY_OPS = {"dispatch", "combine", "dispatch+combine"}
SMALL = ["--tokens", "48", "--hidden", "256", "--topk", "3", "--experts", "8"]
ON_GPU = torch.cuda.is_available()


def run_bench(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "--warmup", "1", "--iters", "3", "--out", str(out), *args]) == 0
    return json.loads(out.read_text())


def check_op(name: str, op: dict) -> None:
    assert OP_KEYS <= set(op), f"{name}: missing {OP_KEYS - set(op)}"
    assert 0 < op["p10_us"] <= op["median_us"] <= op["p90_us"], f"{name}: {op}"
    assert op["host_median_us"] > 0, f"{name}: {op}"
    if name.endswith("layout"):  # no payload: no bandwidth
        assert op["algo_gbps"] is None and op["link_gbps"] is None
    else:
        assert op["algo_gbps"] > 0, f"{name}: {op}"


@pytest.mark.parametrize("mode,dtype", [("normal", "bf16"), ("normal", "fp8"), ("low_latency", "fp8"),
                                        ("low_latency", "bf16")])
def test_bench_writes_a_checked_report(tmp_path, mode, dtype):
    report = run_bench(tmp_path, "--mode", mode, "--dtype", dtype, *SMALL)
    assert report["scaled_down_for_cpu"] is False  # every size was given
    assert report["command"].startswith("ep-plugin bench")
    assert report["date"] and report["timing"] and set(report["extensions"]) == {"_C", "_C_nvshmem", "_C_torch"}
    (run,) = report["runs"]
    assert run["checked"] is True and run["num_ranks"] == 2
    if not ON_GPU:
        assert run["backend"] == "reference" and run["backend_reason"].startswith("auto: native unavailable")
    settings = run["settings"]
    assert SETTINGS_KEYS <= set(settings)
    assert (settings["mode"], settings["dtype"], settings["num_tokens"], settings["hidden"], settings["num_topk"],
            settings["num_experts"]) == (mode, dtype, 48, 256, 3, 8)
    assert settings["num_sms"] == run["num_sms"] == 24  # resolved from the built-in config
    assert set(run["ops"]) >= (NORMAL_OPS if mode == "normal" else LOW_LATENCY_OPS)
    for name, op in run["ops"].items():
        check_op(name, op)
    if mode == "low_latency":  # the pair moves both operations' bytes
        pair, alone = run["ops"]["dispatch+combine"], run["ops"]["dispatch"]
        assert pair["algo_gbps"] * pair["median_us"] > alone["algo_gbps"] * alone["median_us"]


def test_bench_header_says_what_it_resolved_and_checked(tmp_path, capsys):
    run_bench(tmp_path, *SMALL)
    out = capsys.readouterr().out
    assert "sizes: 48 tokens per rank, hidden 256, top-3 of 8 experts, bf16 payload, 24 SMs" in out
    assert "extensions _C" in out
    if not ON_GPU:
        assert "backend: reference (auto: native unavailable: no CUDA device in this process)" in out
        assert "checks the harness only" in out
    assert "scaled down" not in out


def test_the_scaled_down_note_appears_only_when_sizes_were_scaled(tmp_path, capsys):
    report = run_bench(tmp_path, "--tokens", "16", "--topk", "2")  # hidden and experts from the CPU defaults
    out = capsys.readouterr().out
    assert report["scaled_down_for_cpu"] is (not ON_GPU)
    assert ("scaled down" in out) is (not ON_GPU)


def test_bench_sweep_runs_every_point_and_plots(tmp_path):
    pytest.importorskip("matplotlib")
    plot = tmp_path / "sweep.png"
    report = run_bench(tmp_path, "--sweep", "tokens=16,40", "--hidden", "128", "--topk", "2", "--experts", "4",
                       "--plot", str(plot))
    assert [run["settings"]["num_tokens"] for run in report["runs"]] == [16, 40]
    assert all(run["checked"] for run in report["runs"])
    assert plot.stat().st_size > 1000 and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


BAD_ARGUMENTS = [
    (["--experts", "15"], "--experts 15: must be divisible by the number of ranks (2), e.g. --experts 16"),
    (["--tokens", "-5"], "--tokens -5: must be a positive integer"),
    (["--ranks", "0"], "--ranks 0: must be a positive integer"),
    (["--topk", "9", "--experts", "8"], "--topk 9: must not exceed --experts (8)"),
    (["--num-sms", "7"], "--num-sms 7: must be a positive even number"),
    (["--dtype", "fp8", "--hidden", "200"], "--hidden 200: FP8 payloads need a multiple of 128"),
    (["--sweep", "colour=1,2"], "--sweep colour=1,2: expects KEY=V1,V2"),
    (["--sweep", "tokens=a,b"], "--sweep tokens=a,b: the values must be integers"),
    (["--style", "fast"], "--style fast: unknown condition 'fast'"),
    (["--style", "col_scales"], "--style col_scales: needs --dtype fp8"),
    (["--mode", "low_latency", "--style", "explicit_config"], "--style explicit_config: applies to normal mode only"),
    (["--style", "back_to_back", "--gpu-lead-us", "50"], "--gpu-lead-us: a GPU lead contradicts"),
]


@pytest.mark.parametrize("args,message", BAD_ARGUMENTS, ids=[" ".join(a) for a, _ in BAD_ARGUMENTS])
def test_a_bad_argument_is_one_line_naming_it_with_exit_code_2(capsys, args, message):
    assert cli.main(["bench", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ep-plugin bench: error: {message}"), err
    assert err.count("\n") == 1, err


def test_native_without_a_gpu_is_a_usage_error_from_the_flag_or_the_config(tmp_path, capsys):
    if ON_GPU:
        pytest.skip("this machine has a GPU: the native backend is available")
    config = tmp_path / "native.yaml"
    config.write_text("backend: native\n")
    for args in (["--backend", "native"], ["--config", str(config)]):
        assert cli.main(["bench", *args]) == 2
        err = capsys.readouterr().err
        assert "--backend native (or backend: native in the config): no GPU here" in err and err.count("\n") == 1
    report = run_bench(tmp_path, "--config", str(config), "--backend", "reference", "--tokens", "16", "--hidden",
                       "128", "--topk", "2", "--experts", "4", "--baseline", "none")
    assert report["runs"][0]["backend"] == "reference" and report["runs"][0]["checked"]
    assert report["runs"][0]["backend_reason"] == "backend: reference in the config or --backend"


def test_debug_keeps_the_traceback():
    with pytest.raises(cli.UsageError, match="--experts 15"):
        cli.main(["bench", "--experts", "15", "--debug"])


def test_a_user_error_from_the_console_prints_no_traceback():
    done = subprocess.run([sys.executable, "-m", "ep_plugin", "bench", "--tokens", "-5"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr == "ep-plugin bench: error: --tokens -5: must be a positive integer\n"


@pytest.mark.parametrize("failure", ["rank 1 exited with code -9 (killed by SIGKILL) without a result",
                                     "rank 0: OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
                                     "Traceback ..."])
def test_out_of_memory_is_said_with_the_sizes_asked_for(monkeypatch, capsys, failure):
    def fail(*args, **kwargs):
        raise RuntimeError(failure)

    monkeypatch.setattr(bench_module, "parallel_launch", fail)
    assert cli.main(["bench", "--tokens", "4096", "--hidden", "7168", "--topk", "8", "--experts", "256"]) == 1
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("ep-plugin bench: out of memory (") and failure.splitlines()[0] in err
    assert "asked for 2 ranks x 4096 tokens x hidden 7168 (bf16): 56 MiB of input rows per rank" in err


def test_a_failed_run_is_one_line_with_exit_code_1(monkeypatch, capsys):
    def fail(*args, **kwargs):
        raise RuntimeError("rank 1: AssertionError: recv_x: values differ\nTraceback (most recent call last): ...")

    monkeypatch.setattr(bench_module, "parallel_launch", fail)
    assert cli.main(["bench"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == ("ep-plugin bench: failed: RuntimeError: rank 1: AssertionError: recv_x: values differ "
                       "(--debug shows the traceback)")


def test_console_script_runs_with_no_arguments():
    """README's main-job command, exactly as a user types it (embedded defaults, CPU fallback)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EP_PLUGIN_")}
    done = subprocess.run([sys.executable, "-m", "ep_plugin", "bench"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "verified: " in done.stdout and "verified: NO" not in done.stdout
    assert "dispatch" in done.stdout and "combine" in done.stdout
    for stage in ("buffers:", "verification:", "warm-up and timing, ep_plugin"):  # progress, one line per stage
        assert f"ep-plugin bench: {stage}" in done.stderr, done.stderr


def test_info_says_which_extensions_are_built(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "ep_plugin._C: " in out and "ep_plugin._C_nvshmem: " in out and "deep_ep" in out


def test_config_check_prints_the_resolved_environment_and_ends_with_ok(capsys):
    path = str(ROOT / "configs" / "normal_ibrc_dual_port.yaml")
    assert cli.main(["config", "check", path]) == 0
    out = capsys.readouterr().out
    assert "ibrc" in out and "NVSHMEM_" in out
    assert out.splitlines()[-1] == f"ok: {path}"


def test_config_check_names_the_bad_key(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("mode: normal\nnum_smz: 24\n")
    assert cli.main(["config", "check", str(bad)]) == 2
    captured = capsys.readouterr()
    assert "num_smz" in captured.err and str(bad) in captured.err and captured.err.count("\n") == 1
    assert "ok:" not in captured.out


def test_an_unknown_choice_is_refused_by_the_parser():
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--backend", "fastest"])
    assert exit_info.value.code == 2
