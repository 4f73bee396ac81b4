"""`ep-plugin bench --baseline deepep` and `--style` on CPU, without DeepEP.

DeepEP V1 is not installed here; ep_plugin.Buffer is a drop-in for `deep_ep.Buffer` (on CPU it runs
the reference backend), so a module named `deep_ep` that is ep_plugin stands in for it. The bench
must then run the peer's calls on the same data, check them against the reference, and put its
figures and the ratio beside ours, in the JSON and in the table.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from ep_plugin import bench, cli

SMALL = ["--tokens", "40", "--hidden", "256", "--topk", "3", "--experts", "8", "--warmup", "1", "--iters", "3"]
PEER_KEYS = {"median_us", "p10_us", "p90_us", "algo_gbps", "host_median_us"}


@pytest.fixture
def deep_ep_is_ep_plugin(tmp_path, monkeypatch):
    """A `deep_ep` module on sys.path (spawned ranks inherit it) that is ep_plugin itself."""
    stand_in = tmp_path / "stand_in"
    stand_in.mkdir()
    (stand_in / "deep_ep.py").write_text("import sys\nimport ep_plugin\nsys.modules[__name__] = ep_plugin\n")
    monkeypatch.syspath_prepend(str(stand_in))
    assert bench.peer_importable()
    yield
    sys.modules.pop("deep_ep", None)  # the bench imported it here too; later tests must not find it


def run(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "bench.json"
    # DeepEP V1's low-latency kernels exist for a few hidden sizes only (bench.PEER_LOW_LATENCY_HIDDENS).
    sizes = SMALL + (["--hidden", "2048"] if "low_latency" in args else [])
    assert cli.main(["bench", "--out", str(out), *sizes, *args]) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("mode,dtype", [("normal", "bf16"), ("normal", "fp8"), ("low_latency", "fp8")])
def test_deepep_runs_beside_ours_checked_with_its_ratio(tmp_path, capsys, deep_ep_is_ep_plugin, mode, dtype):
    report = run(tmp_path, "--baseline", "deepep", "--mode", mode, "--dtype", dtype)
    (result,) = report["runs"]
    assert result["settings"]["baselines"] == ["reference", "deepep"]
    peer = result["deepep"]
    assert peer["checked"] is True and peer["check_error"] is None
    assert peer["module"].endswith("ep_plugin/__init__.py")  # the stand-in, not a DeepEP build
    ours = {name: op for name, op in result["ops"].items() if not name.startswith("reference_")}
    assert set(ours) == (set(bench.NORMAL_OPS) if mode == "normal" else {"dispatch", "combine", "dispatch+combine"})
    for name, op in ours.items():
        assert PEER_KEYS <= set(op["deepep"]), name
        assert op["deepep"]["median_us"] > 0
        assert op["vs_deepep"] == pytest.approx(op["deepep"]["median_us"] / op["median_us"])
        assert (op["deepep"]["algo_gbps"] is None) is (op["algo_gbps"] is None)  # layout moves no payload
        assert op["deepep"]["algo_gbps"] is None or op["deepep"]["algo_gbps"] > 0
    if mode == "normal":  # each dispatch and combine op names the path of its own calls
        assert {name: op.get("path") for name, op in ours.items()} == {
            name: None if name == "layout" else result["backend"] for name in ours}
    table = capsys.readouterr().out
    assert "DeepEP us" in table and "vs DeepEP" in table
    assert "verified against the reference backend: yes" in table
    for name, op in ours.items():
        row = next(line for line in table.splitlines() if line.startswith(f"{name} "))
        assert row.rstrip().split()[-1] == f"{op['vs_deepep']:.2f}x", row


def test_without_deepep_auto_times_the_reference_only(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "peer_importable", lambda: False)
    report = run(tmp_path, "--baseline", "auto")
    (result,) = report["runs"]
    assert "deepep" not in result and result["settings"]["baselines"] == ["reference"]
    assert all("deepep" not in op for op in result["ops"].values())


@pytest.mark.parametrize("condition", sorted(bench.STYLE_CONDITIONS))
def test_each_deepep_program_condition_runs_alone_checked(tmp_path, condition):
    report = run(tmp_path, "--dtype", "fp8", "--style", condition, "--baseline", "none")
    (result,) = report["runs"]
    assert result["checked"] is True
    assert result["settings"]["style"] == [condition]
    assert list(result["style"]) == [condition] and result["style"][condition]


def test_deepep_style_runs_with_bf16_payloads_without_the_scales_condition(tmp_path):
    report = run(tmp_path, "--style", "deepep", "--baseline", "none")
    (result,) = report["runs"]
    assert result["checked"] is True
    assert result["settings"]["style"] == [name for name in bench.STYLE_CONDITIONS if name != "col_scales"]


def test_deepep_style_takes_every_condition_of_the_mode_and_payload():
    assert bench.parse_style("deepep", "normal", "fp8") == tuple(bench.STYLE_CONDITIONS)
    everything_but_scales = tuple(name for name in bench.STYLE_CONDITIONS if name != "col_scales")
    assert bench.parse_style("deepep", "normal", "bf16") == everything_but_scales
    assert bench.parse_style("deepep", "low_latency") == ("back_to_back", "default_device", "default_dtype")
    assert bench.parse_style("plain", "normal") == () and bench.parse_style(None, "normal") == ()


def test_explicit_configs_carry_deepeps_chunks_at_the_run_sm_count():
    settings = bench.BenchSettings(num_sms=8)
    dispatch, combine = bench.explicit_configs(bench.Config, settings, 2)
    assert (dispatch.num_sms, dispatch.num_max_nvl_chunked_send_tokens, dispatch.num_max_nvl_chunked_recv_tokens) \
        == (8, 24, 256)
    assert (combine.num_sms, combine.num_max_nvl_chunked_send_tokens) == (8, 10)
    dispatch, combine = bench.explicit_configs(bench.Config, settings, 3)
    assert dispatch.num_max_nvl_chunked_send_tokens == 6  # 3 ranks: the 4-rank chunks


def test_a_failed_deepep_check_is_reported_not_hidden(capsys):
    run = {"settings": {"mode": "normal", "num_tokens": 8, "hidden": 128, "num_topk": 2, "num_experts": 4,
                        "dtype": "bf16"},
           "backend": "native", "backend_reason": "auto: the native kernels serve this group", "num_sms": 24,
           "checked": True, "style": {}, "device_name": "GPU", "num_ranks": 2, "p2p_gbps": None,
           "deepep": {"module": "deep_ep", "processes": "the same processes", "checked": False,
                      "check_error": "AssertionError: recv_x: values differ"},
           "ops": {"dispatch": {"median_us": 10.0, "p10_us": 9.0, "p90_us": 11.0, "algo_gbps": 1.0,
                                "link_gbps": 0.5, "host_median_us": 5.0}}}
    table = bench.format_table(run)
    assert "verified against the reference backend: FAILED (AssertionError: recv_x: values differ)" in table
    assert "dispatch" in table.splitlines()[-1] and table.splitlines()[-1].split()[-2:] == ["-", "-"]


def test_low_latency_deepep_style_pairs_run_checked_beside_deepep(tmp_path, deep_ep_is_ep_plugin):
    report = run(tmp_path, "--mode", "low_latency", "--style", "deepep", "--baseline", "deepep")
    (result,) = report["runs"]
    assert result["checked"] and result["deepep"]["checked"]
    assert list(result["style"]) == ["back_to_back", "default_device", "default_dtype"]
    assert "processes of its own" in result["deepep"]["processes"]
    assert result["ops"]["dispatch+combine"]["deepep"]["median_us"] > 0


def test_a_deepep_that_fails_to_import_is_named(tmp_path, monkeypatch, capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "deep_ep.py").write_text("raise ImportError('deep_ep_cpp: undefined symbol (built for another torch)')\n")
    monkeypatch.syspath_prepend(str(broken))
    assert bench.resolve_baselines("auto") == ("reference",)
    assert "no DeepEP baseline: importing deep_ep failed: ImportError: deep_ep_cpp: undefined symbol" in \
        capsys.readouterr().err
    with pytest.raises(cli.UsageError, match="--baseline deepep: importing deep_ep failed"):
        bench.resolve_baselines("deepep")
    assert bench.resolve_baselines("none") == () and bench.resolve_baselines("reference") == ("reference",)


def test_sizes_deepep_cannot_run_drop_its_baseline_or_are_an_error_when_it_was_asked_for(tmp_path, capsys,
                                                                                       deep_ep_is_ep_plugin):
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "--out", str(out), *SMALL, "--mode", "low_latency"]) == 0
    (result,) = json.loads(out.read_text())["runs"]
    assert "deepep" not in result and result["checked"]
    assert "no DeepEP baseline: DeepEP V1 has no low-latency kernels for --hidden 256" in capsys.readouterr().err
    assert cli.main(["bench", *SMALL, "--mode", "low_latency", "--baseline", "deepep"]) == 2
    assert "--baseline deepep: DeepEP V1 has no low-latency kernels for --hidden 256" in capsys.readouterr().err


@pytest.mark.parametrize("sizes,why", [(dict(num_topk=12, num_experts=16), "--topk 12"),
                                       (dict(num_tokens=33), "2 x --tokens 33"),
                                       (dict(hidden=7168), "")])
def test_deepep_low_latency_limits(sizes, why):
    settings = bench.BenchSettings(mode="low_latency", num_tokens=40, hidden=2048, num_topk=3, num_experts=8)
    reason = bench.peer_cannot_run(dataclasses.replace(settings, **sizes), 2)
    assert why in reason and bool(reason) == bool(why)
