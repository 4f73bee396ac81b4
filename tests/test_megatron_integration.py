"""Megatron-Core integration on CPU: real megatron-core, gloo, ep_plugin's reference backend.

The cases (tests/megatron_cases.py) run inside spawned ranks, one launch per layout: 2 ranks
(EP 2) and 4 ranks (EP 2 x expert-TP 2). They make the checks of Megatron's own dispatcher tests
(dropless round trip and gradient, capacity, drop-and-pad, router padding), compare a whole
MoELayer's forward and backward with a dense MoE built from the same modules, and check the
registration and Megatron-LM's command line. One more test runs a script through
`python -m ep_plugin.integrations.megatron`. Skipped only where megatron-core is not installed
(.ci/install_megatron.sh installs it). Set EP_TEST_SEED to replay a run (failures print it).
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap

import pytest

import megatron_env
from case_runner import assert_case_passed

pytestmark = pytest.mark.skipif(not megatron_env.megatron_core_installed(),
                                reason="megatron-core is not installed (.ci/install_megatron.sh)")

BASE_SEED = int(os.environ.get("EP_TEST_SEED", random.SystemRandom().randrange(1 << 30)))
LAYOUTS = {"ep2": (2, 1), "ep2_etp2": (4, 2)}   # name -> (ranks, expert-TP size)
CASES = ("dropless", "router_probs_grad", "capacity", "drop_and_pad", "drop_and_pad_many_experts",
         "router_padding", "moe_layer_vs_dense", "moe_layer_one_ep_rank_idle", "registration", "cli")
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def megatron_worker(rank: int, world: int, group, seed: int, expert_tp: int):
    """Spawned rank: import Megatron only here (megatron_cases prepares the process first)."""
    import megatron_cases
    assert megatron_cases.CASES == CASES, "CASES out of step with tests/megatron_cases.py"
    return megatron_cases.run_all(rank, world, group, seed, expert_tp)


@pytest.fixture(scope="module", params=sorted(LAYOUTS), ids=str)
def launch(request):
    world, expert_tp = LAYOUTS[request.param]
    seed = BASE_SEED + world
    return request.param, seed, megatron_env.cpu_launch(world, megatron_worker, seed, expert_tp, timeout_s=240)


@pytest.mark.parametrize("case", CASES)
def test_megatron(launch, case):
    layout, seed, results = launch
    assert_case_passed(results, case, f"EP_TEST_SEED={BASE_SEED} (seed {seed}), layout {layout}")


def test_launcher_registers_before_the_script(tmp_path):
    """`python -m ep_plugin.integrations.megatron SCRIPT ARGS` registers, then runs an unmodified script
    whose Megatron-LM parser then accepts the ep_plugin flags."""
    config = tmp_path / "ep.yaml"
    config.write_text("mode: normal\nnum_sms: 6\n")
    script = tmp_path / "pretrain_stub.py"
    script.write_text(textwrap.dedent("""
        from megatron.training.arguments import parse_args
        from ep_plugin.integrations.megatron import resolve_config
        args = parse_args(ignore_unknown_args=False)
        print("RESULT", args.moe_token_dispatcher_type, args.ep_plugin_config, resolve_config().num_sms)
    """))
    # The child prepares its interpreter as every test process does (tests/megatron_env.py), then runs
    # the package's __main__ exactly as `python -m` would.
    bootstrap = ("import sys, runpy; sys.path.insert(0, sys.argv.pop(1)); import megatron_env; "
                 "megatron_env.prepare(); runpy.run_module('ep_plugin.integrations.megatron', run_name='__main__', "
                 "alter_sys=True)")
    command = [sys.executable, "-W", "ignore", "-c", bootstrap, TESTS_DIR, str(script),
               "--moe-token-dispatcher-type", "ep_plugin", "--ep-plugin-config", str(config)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"RESULT ep_plugin {config} 6" in done.stdout, done.stdout[-2000:]


def test_benchmark_layer_configs_are_valid():
    """benchmarks/bench_megatron_layer.py's layers (ep_plugin, flex on DeepEP with ep_plugin's SM count,
    alltoall, allgather) pass the installed megatron-core's config checks; the GPU machine then only
    needs `deep_ep` for flex."""
    code = textwrap.dedent("""
        import sys, importlib.util
        sys.path.insert(0, sys.argv[1])
        import megatron_env
        megatron_env.prepare()
        spec = importlib.util.spec_from_file_location("bench", sys.argv[2])
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
        import ep_plugin.integrations.megatron as ep_megatron
        from megatron.core.transformer.transformer_config import TransformerConfig
        ep_megatron.register(config={"num_sms": 16})
        args = bench.parse_args(["--dispatchers", ",".join(bench.DISPATCHERS)] if bench.deep_ep_importable()
                                else ["--dispatchers", "ep_plugin,alltoall,allgather"])
        for name in bench.DISPATCHERS:
            config = TransformerConfig(**bench.layer_config_kwargs(args, name))
            print("CONFIG", name, config.moe_token_dispatcher_type, config.moe_flex_dispatcher_backend,
                  config.moe_flex_dispatcher_num_sms)
    """)
    bench_path = os.path.join(TESTS_DIR, "..", "benchmarks", "bench_megatron_layer.py")
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", code, TESTS_DIR, bench_path],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("CONFIG")]
    assert lines == [["ep_plugin", "ep_plugin", "deepep", "None"], ["flex", "flex", "deepep", "16"],
                     ["alltoall", "alltoall", "deepep", "None"], ["allgather", "allgather", "deepep", "None"]], lines
