"""benchmarks/bench_low_latency.py on CPU: aggregation over ranks and the plot (the timing needs GPUs)."""
import importlib.util
import math
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_low_latency.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_low_latency", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rank_point(times: dict, received: int, hidden: int) -> dict:
    stats = {op: {"median_us": t, "p10_us": t - 1, "p90_us": t + 1, "min_us": t - 2, "max_us": t + 2}
             for op, t in times.items()}
    return {"tokens": 128, "received_messages": received, "dispatch_bytes": received * (hidden + 4 * 56),
            "combine_bytes": received * 2 * hidden, "native": stats, "reference": {"dispatch": stats["dispatch"]}}


def test_aggregate_averages_ranks_and_counts_kernel_bandwidth_with_the_operation_bytes():
    bench = _load()
    hidden = 7168
    per_rank = [{"points": [_rank_point({"dispatch": 20.0, "dispatch_kernel": 16.0, "combine": 40.0,
                                         "combine_kernel": 36.0}, 1000, hidden)]},
                {"points": [_rank_point({"dispatch": 22.0, "dispatch_kernel": 18.0, "combine": 44.0,
                                         "combine_kernel": 40.0}, 1048, hidden)]}]
    point = bench.aggregate(per_rank)[0]
    assert point["received_messages_per_rank"] == [1000, 1048]
    assert point["native"]["dispatch"]["median_us"] == 21.0
    assert point["native"]["combine_kernel"]["median_us"] == 38.0
    want = (1000 * (hidden + 224) / 16e-6 + 1048 * (hidden + 224) / 18e-6) / 2 / 1e9
    assert math.isclose(point["native"]["dispatch_kernel"]["gbps"], want)
    want = (1000 * 2 * hidden / 36e-6 + 1048 * 2 * hidden / 40e-6) / 2 / 1e9
    assert math.isclose(point["native"]["combine_kernel"]["gbps"], want)


def test_plot_draws_event_and_kernel_times(tmp_path):
    bench = _load()
    hidden = 7168
    points = [bench.aggregate([{"points": [_rank_point({"dispatch": 10.0 + t, "dispatch_kernel": 7.0 + t,
                                                        "combine": 12.0 + t, "combine_kernel": 9.0 + t}, 8 * t, hidden)]}
                               ])[0] for t in (1, 8, 64)]
    for t, point in zip((1, 8, 64), points):
        point["tokens"] = t
    report = {"points": points, "num_ranks": 2, "device_name": "test",
              "settings": {"hidden": hidden, "topk": 8, "experts": 256, "dtype": "fp8"}}
    path = tmp_path / "plot.png"
    bench.plot(report, str(path))
    assert path.stat().st_size > 10_000


def test_kernel_time_per_replay_sums_the_launches_of_split_send_and_receive():
    bench = _load()
    assert bench.per_replay_us("dispatch_kernel", [(30, 3.0), (10, 1.0)], 2) == [1.0, 3.0]
    # Ranks sharing a GPU: send and receive are two launches per replay.
    split = [(40, 4.0), (10, 1.0), (30, 3.0), (20, 2.0)]
    assert bench.per_replay_us("combine_kernel", split, 2) == [3.0, 7.0]
    with pytest.raises(RuntimeError, match="3 dispatch_kernel launches in 2 replays"):
        bench.per_replay_us("dispatch_kernel", [(1, 1.0), (2, 1.0), (3, 1.0)], 2)
