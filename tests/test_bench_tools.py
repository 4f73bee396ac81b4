"""The Megatron layer benchmark's bookkeeping, benchmarks/probes/trace_gaps.py, benchmarks/probes/host_parts.py and
benchmarks/probes/eager_rounds.py, on CPU (no GPU, no Megatron)."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

from ep_plugin.launch import parallel_launch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name.replace("/", "."), BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rank(round_ms: float, stand_in_ms: float, layer_ms: float) -> dict:
    return {"round_ms": {"median": round_ms}, "stand_in_ms": {"median": stand_in_ms},
            "dispatcher_ms": round_ms - stand_in_ms, "layer_step_ms": {"median": layer_ms}}


def test_dispatcher_time_is_the_slowest_ranks_round_less_its_stand_in():
    bench = _load("bench_megatron_layer")
    args = bench.parse_args(["--dispatchers", "ep_plugin,alltoall", "--tokens", "100", "--topk", "2",
                             "--hidden", "64"])
    per_rank = [{"ep_plugin": _rank(6.0, 3.0, 15.0), "alltoall": _rank(11.0, 3.5, 20.0)},
                {"ep_plugin": _rank(6.5, 3.0, 16.0), "alltoall": _rank(10.0, 3.0, 21.0)}]
    report = bench._combine_ranks(per_rank, args)
    ours, theirs = report["results"]["ep_plugin"], report["results"]["alltoall"]
    assert ours["dispatcher_ms"] == 3.5 and theirs["dispatcher_ms"] == 7.5
    assert ours["round_ms"] == 6.5 and ours["stand_in_ms"] == 3.0 and ours["layer_step_ms"] == 16.0
    assert report["targets"]["dispatcher_time_ratio_vs_alltoall"] == 3.5 / 7.5
    assert report["targets"]["dispatcher_target_met (<= 0.5)"] is True
    assert report["targets"]["layer_speedup_vs_alltoall"] == 21.0 / 16.0
    expected_gbps = 4 * 100 * 2 * 64 * 2 / 3.5e-3 / 1e9
    assert abs(ours["dispatcher_algorithmic_gbps"] - expected_gbps) < 1e-9


def test_trace_gaps_reports_busy_time_and_names_the_host_op_behind_the_longest_gap(tmp_path):
    events = [
        {"ph": "X", "cat": "kernel", "name": "k1", "ts": 0, "dur": 100},
        {"ph": "X", "cat": "gpu_memcpy", "name": "copy", "ts": 50, "dur": 100},   # overlaps k1: busy 0..150
        {"ph": "X", "cat": "kernel", "name": "k2", "ts": 400, "dur": 100},        # gap of 250 us after 150
        {"ph": "X", "cat": "kernel", "name": "k3", "ts": 520, "dur": 80},         # gap of 20 us
        {"ph": "X", "cat": "cpu_op", "name": "outer_op", "ts": 100, "dur": 400},
        {"ph": "X", "cat": "python_function", "name": "slow_python", "ts": 140, "dur": 200},
    ]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    run = subprocess.run([sys.executable, str(BENCHMARKS / "probes" / "trace_gaps.py"), str(trace), "--top", "2"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("span 0.600 ms, GPU busy 0.330 ms (55%), idle 0.270 ms in 2 gaps")
    assert lines[2].split() == ["250.0", "0.150", "slow_python"]
    assert lines[3].split() == ["20.0", "0.500", "outer_op"]


def test_host_parts_parses_its_arguments():
    run = subprocess.run([sys.executable, str(BENCHMARKS / "probes" / "host_parts.py"), "--help"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "--op {layout,ll_pair,combine}" in run.stdout


def host_parts_worker(rank: int, num_ranks: int, group, op: str, global_defaults: bool) -> str:
    from stand_in_native import StandInLowLatencyRuntime, stand_in_kernels
    host_parts = _load("probes/host_parts")
    with stand_in_kernels(StandInLowLatencyRuntime()), mock.patch.object(torch.cuda, "synchronize"):
        return host_parts.probe_rank(rank, num_ranks, group, op, "ep_plugin", 4, global_defaults)


@pytest.mark.parametrize("global_defaults", [False, True], ids=["plain", "global_defaults"])
@pytest.mark.parametrize("op", ["layout", "ll_pair"])
def test_host_parts_pieces_run_on_stand_in_kernels(op, global_defaults):
    """Every piece of the probe runs against the current code (stand-in kernels: the numbers mean nothing),
    also under torch's global default device and dtype."""
    pytest.importorskip("ep_plugin._C_nvshmem", reason="ep_plugin._C_nvshmem is not built here")
    lines = parallel_launch(2, host_parts_worker, op, global_defaults, backend="gloo",
                            timeout_s=120)[0].splitlines()
    assert all("p50" in line for line in lines) and len(lines) == (9 if op == "layout" else 21), lines


def test_host_parts_combine_pieces_run_on_stand_in_kernels():
    """The normal combine's pieces (stand-in kernels: the numbers mean nothing)."""
    pytest.importorskip("ep_plugin._C", reason="the native extension is not built here")
    lines = parallel_launch(2, host_parts_worker, "combine", False, backend="gloo", timeout_s=120)[0].splitlines()
    assert all("p50" in line for line in lines) and len(lines) == 8, lines


def test_notify_steps_orders_the_stamps_by_epoch_and_times_each_step():
    notify_steps = _load("probes/notify_steps")
    steps = len(notify_steps.STEPS)

    def row(epoch, start_ns):  # step k takes k + 1 us
        stamps = [start_ns]
        for k in range(steps):
            stamps.append(stamps[-1] + (k + 1) * 1000)
        return stamps + [epoch]

    # Epochs 1-3 start 100 us apart; epoch 5 follows no notify of the block; the rest never written.
    rows = [row(3, 200_000), row(1, 0), row(5, 900_000), row(2, 100_000)]
    words = [w for r in rows for w in r] + [0] * notify_steps.WORDS * (notify_steps.NOTIFIES - len(rows))
    ordered = notify_steps.stamp_rows(words)
    assert [r[-1] for r in ordered] == [1, 2, 3, 5]
    medians = notify_steps.step_medians_us(ordered)
    assert [medians[name] for name in notify_steps.STEPS] == [float(k + 1) for k in range(steps)]
    assert medians["between notify kernels"] == pytest.approx(100 - steps * (steps + 1) / 2)


def test_eager_rounds_times_each_round_from_its_start_to_the_next():
    eager_rounds = _load("probes/eager_rounds")
    # Rounds start every 100 us but one, which takes 300; each call's host time grows by 1 us a round.
    starts = [0, 100, 200, 500, 600, 700]
    stamps = [(t * 1e-6, (t + 10 + i) * 1e-6, (t + 60 + 2 * i) * 1e-6, (t + 90 + 2 * i) * 1e-6)  # 10+i, 50+i, 30
              for i, t in enumerate(starts)]
    stats = eager_rounds.round_stats(stamps)
    assert [round(stats[q], 6) for q in ("p10", "p50", "p90")] == [100.0, 100.0, 300.0]
    # Six rounds: the median is the third of each call's sorted times (as the bench's quantiles round).
    assert [round(stats[call], 6) for call in ("layout", "dispatch", "combine")] == [12.0, 52.0, 30.0]


def test_eager_rounds_reports_the_calls_of_its_rounds():
    eager_rounds = _load("probes/eager_rounds")
    # Dispatch-only rounds: a start and the dispatch's end per round, every 80 us, the dispatch taking 60 + i.
    stamps = [(t * 1e-6, (t + 60 + i) * 1e-6) for i, t in enumerate(range(0, 400, 80))]
    stats = eager_rounds.round_stats(stamps, eager_rounds.DISPATCH_ONLY)
    assert round(stats["p50"], 6) == 80.0 and round(stats["dispatch"], 6) == 62.0
    assert "layout" not in stats and "combine" not in stats
    line = eager_rounds.format_stats("ep_plugin", 0, stats, eager_rounds.DISPATCH_ONLY)
    assert line.endswith("host p50: dispatch   62.0"), line


def eager_rounds_worker(rank: int, num_ranks: int, group, explicit: bool, global_defaults: bool,
                        dispatch_only: bool) -> list:
    from stand_in_native import StandInLowLatencyRuntime, stand_in_kernels
    eager_rounds = _load("probes/eager_rounds")
    with stand_in_kernels(StandInLowLatencyRuntime()):
        return eager_rounds.probe_rank(rank, num_ranks, group, ["ep_plugin"], 16, 3, 2, explicit, global_defaults,
                                       dispatch_only)


@pytest.mark.parametrize("explicit, global_defaults, dispatch_only",
                         [(True, True, False), (False, False, False), (True, True, True)],
                         ids=["deepep_style", "plain", "dispatch_only"])
def test_eager_rounds_run_on_stand_in_kernels(explicit, global_defaults, dispatch_only):
    """The probe's rounds run against the current code (stand-in kernels: the numbers mean nothing) and
    leave torch's global defaults as they found them; dispatch-only rounds report the dispatch alone."""
    pytest.importorskip("ep_plugin._C", reason="the native extension is not built here")
    lines = parallel_launch(2, eager_rounds_worker, explicit, global_defaults, dispatch_only, backend="gloo",
                            timeout_s=120)[0]
    assert [line.split(":")[0] for line in lines] == ["ep_plugin block 0", "ep_plugin block 1"], lines
    assert all("round p10" in line and "dispatch" in line for line in lines), lines
    assert all(("combine" in line) != dispatch_only for line in lines), lines
    assert torch.get_default_dtype() == torch.float32


def test_eager_rounds_takes_the_libraries_it_is_named():
    eager_rounds = _load("probes/eager_rounds")
    assert eager_rounds.parse_args(["--libraries", "deep_ep"]).libraries == ["deep_ep"]
    assert eager_rounds.parse_args(["--libraries", "ep_plugin,deep_ep"]).libraries == ["ep_plugin", "deep_ep"]
    with pytest.raises(SystemExit):
        eager_rounds.parse_args(["--libraries", "deepep"])
