"""vLLM integration (`--all2all-backend ep_plugin`) against the real vLLM 0.33 package, on CPU.

The entry point is discovered and loaded by vLLM's plugin loader; `--all2all-backend ep_plugin`
parses and validates; the manager and prepare/finalize classes are vLLM ABC subclasses with nothing
abstract left; and on 2 gloo ranks (reference backend) vLLM's own distributed set-up, EP communicator,
`maybe_make_prepare_finalize` and `FusedMoEKernel` run dense torch experts through our
prepare/finalize, in both modes, bf16 and block-FP8, matching a single-process dense MoE. One process
launch per mode. Data are random every run: set EP_TEST_SEED to replay one (failures print it).

Skipped only where vLLM is not installed (.ci/install_vllm.sh installs it in CI).
"""
from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (.ci/install_vllm.sh installs it)", allow_module_level=True)

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # vLLM's CPU platform, here and in spawned ranks

from typing import List, Tuple  # noqa: E402

import torch  # noqa: E402

import vllm_moe_case as case_lib  # noqa: E402
from ep_plugin.launch import parallel_launch  # noqa: E402

BASE_SEED = int(os.environ.get("EP_TEST_SEED", random.SystemRandom().randrange(1 << 30)))
WORLD_SIZE = 2
NUM_EXPERTS, TOP_K, INTERMEDIATE, MAX_TOKENS = 8, 3, 48, 16
# Hidden sizes outside DeepEP's closed list: bf16 rows of 200 channels, FP8 with a partial last block.
BF16_HIDDEN, FP8_HIDDEN = 200, 320


@pytest.fixture(scope="module")
def registered():
    """vLLM's own plugin loader, as every vLLM process runs it."""
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    from ep_plugin.integrations.vllm import _patches
    assert _patches._applied
    return _patches


# ---- discovery, CLI, validation -------------------------------------------------------------------------
def test_entry_point_is_discovered():
    from importlib.metadata import entry_points
    found = {ep.name: ep for ep in entry_points(group="vllm.general_plugins")}
    assert "ep_plugin" in found, f"vllm.general_plugins entry points: {sorted(found)}"
    assert found["ep_plugin"].value == "ep_plugin.integrations.vllm:register"
    from ep_plugin.integrations.vllm import register
    assert found["ep_plugin"].load() is register


def test_cli_parses_and_validates(registered):
    from vllm.config import ParallelConfig, VllmConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    (action,) = [a for a in parser._actions if "--all2all-backend" in a.option_strings]
    assert "ep_plugin" in action.choices and "deepep_low_latency" in action.choices  # what --help lists
    args = parser.parse_args(["--enable-expert-parallel", "--all2all-backend", "ep_plugin",
                              "--data-parallel-size", "2", "--tensor-parallel-size", "2"])
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.all2all_backend == "ep_plugin"
    parallel = ParallelConfig(all2all_backend=engine_args.all2all_backend,
                              enable_expert_parallel=engine_args.enable_expert_parallel,
                              data_parallel_size=engine_args.data_parallel_size,
                              tensor_parallel_size=engine_args.tensor_parallel_size)
    assert parallel.all2all_backend == "ep_plugin"
    assert parallel.use_all2all and parallel.use_sequence_parallel_moe
    assert VllmConfig(parallel_config=parallel).parallel_config.all2all_backend == "ep_plugin"
    # Built-in names still parse; unknown ones are still rejected by both.
    assert parser.parse_args(["--all2all-backend", "deepep_low_latency"]).all2all_backend == "deepep_low_latency"
    with pytest.raises(SystemExit):
        parser.parse_args(["--all2all-backend", "ep_plugin_typo"])
    with pytest.raises(ValueError, match="all2all_backend"):
        ParallelConfig(all2all_backend="ep_plugin_typo")


def test_register_is_idempotent(registered):
    from vllm.config import ParallelConfig
    from vllm.model_executor.layers.fused_moe import all2all_utils
    before = (ParallelConfig.use_sequence_parallel_moe, all2all_utils.maybe_make_prepare_finalize)
    registered.apply()
    from ep_plugin.integrations.vllm import register
    register()
    assert (ParallelConfig.use_sequence_parallel_moe, all2all_utils.maybe_make_prepare_finalize) == before


def test_version_check(monkeypatch):
    from ep_plugin.integrations.vllm import RELEASES, VllmVersionError, check_version
    for supported, release in (("0.32.0", (0, 32, 0)), ("0.33.0", (0, 33, 0)), ("0.33.4+cu130", (0, 33, 4))):
        assert check_version(supported) == release
    monkeypatch.delenv(RELEASES.allow_untested_env, raising=False)
    for unknown in ("0.31.2", "0.34.0rc1", "1.0.0"):
        with pytest.raises(VllmVersionError, match=f"supports vLLM 0.32.x to 0.33.x, found {unknown}"):
            check_version(unknown)
    with pytest.raises(VllmVersionError, match="cannot parse"):
        check_version("main")
    monkeypatch.setenv(RELEASES.allow_untested_env, "1")
    with pytest.warns(RuntimeWarning, match="0.34.0"):
        check_version("0.34.0")


def test_surface_checks_read_signatures(registered, monkeypatch):
    """The patched objects are checked by what they are, not by the release number."""
    from vllm.config.compilation import CompilationConfig
    from vllm.model_executor.layers.fused_moe import all2all_utils

    from ep_plugin.integrations.vllm import VllmVersionError
    assert registered.surface_problems() == []
    monkeypatch.setattr(all2all_utils, "maybe_make_prepare_finalize", lambda moe, quant_config, manager=None: None)
    monkeypatch.setattr(CompilationConfig, "set_splitting_ops_for_v1", lambda self, backend: None)
    problems = registered.surface_problems()
    assert len(problems) == 2, problems
    assert any("maybe_make_prepare_finalize takes ('moe', 'quant_config', 'manager')" in p for p in problems), problems
    assert any("set_splitting_ops_for_v1 takes ('self', 'backend')" in p for p in problems), problems
    with pytest.raises(VllmVersionError, match="with the objects its patches expect; in vLLM .*maybe_make_prepare"):
        registered.check_surface()


# ---- vLLM's own command line, in a fresh process ----------------------------------------------------------
# Runs vLLM's entry point (`vllm ARGS`, main()) once per argument list, in one process with this checkout's
# ep_plugin first on sys.path; optionally reports vLLM's version as another release; `vllm serve` prints the
# engine config it built instead of serving. Each run's output is framed by markers on stdout and stderr.
CLI_BOOTSTRAP = """
import json, sys
sys.path.insert(0, sys.argv[1])
fake_version, runs = sys.argv[2], json.loads(sys.argv[3])
if fake_version:
    import vllm
    vllm.__version__ = fake_version
import vllm.entrypoints.cli.serve as serve
from vllm.entrypoints.cli.main import main

def print_engine_config(args):
    import vllm
    args.model = args.model_tag or args.model
    config = vllm.AsyncEngineArgs.from_cli_args(args).create_engine_config()
    parallel = config.parallel_config
    print("ENGINE", parallel.all2all_backend, parallel.enable_expert_parallel, parallel.data_parallel_size,
          parallel.use_all2all, parallel.use_sequence_parallel_moe)

serve.ServeSubcommand.cmd = staticmethod(print_engine_config)
for index, argv in enumerate(runs):
    for stream in (sys.stdout, sys.stderr):
        print(f"<<<RUN {index}>>>", file=stream, flush=True)
    sys.argv = ["vllm", *argv]
    try:
        main()
        code = 0
    except SystemExit as exit:
        code = exit.code or 0
    for stream in (sys.stdout, sys.stderr):
        print(f"<<<EXIT {index} {code}>>>", file=stream, flush=True)
"""
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A two-layer Mixtral config: enough for vLLM to build its engine config offline.
TINY_MOE = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_local_experts": 4, "num_experts_per_tok": 2, "vocab_size": 256, "max_position_embeddings": 256,
            "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5, "rope_theta": 10000.0}


def run_vllm(*runs: List[str], fake_version: str = "") -> List[Tuple[int, str, str]]:
    """(exit code, stdout, stderr) of `vllm ARGS` for each argument list in `runs` (one process)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_TARGET_DEVICE="cpu")
    done = subprocess.run([sys.executable, "-c", CLI_BOOTSTRAP, REPO_ROOT, fake_version, json.dumps(runs)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    results = []
    for index in range(len(runs)):
        outputs = [text.split(f"<<<RUN {index}>>>")[1].split(f"<<<EXIT {index} ")[0]
                   for text in (done.stdout, done.stderr)]
        code = int(done.stdout.split(f"<<<EXIT {index} ")[1].split(">>>")[0])
        results.append((code, *outputs))
    return results


def _choices_line(help_text: str) -> str:
    (line,) = [line for line in help_text.splitlines() if line.strip().startswith("--all2all-backend {")]
    return line


def test_vllm_serve_lists_and_parses_the_backend(tmp_path):
    model = tmp_path / "tiny-moe"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_MOE))
    shown, built, typo = run_vllm(
        ["serve", "--help=all2all-backend"],
        ["serve", str(model), "--skip-tokenizer-init", "--enable-expert-parallel", "--all2all-backend", "ep_plugin",
         "--data-parallel-size", "2", "--tensor-parallel-size", "1"],
        ["serve", "--all2all-backend", "ep_plugin_typo"])
    assert shown[0] == 0, shown[2][-3000:]
    assert ",ep_plugin," in _choices_line(shown[1])
    assert built[0] == 0, built[2][-3000:]
    assert "ENGINE ep_plugin True 2 True False" in built[1], built[1][-2000:] + built[2][-2000:]
    assert typo[0] == 2 and "invalid choice: 'ep_plugin_typo'" in typo[2], typo[2][-2000:]


def test_unsupported_vllm_keeps_working_and_says_why():
    """On a vLLM outside the range, every vLLM command works; choosing the backend fails with vLLM's
    'invalid choice', after one warning that names the release and the supported range."""
    chosen, version, shown = run_vllm(["serve", "--enable-expert-parallel", "--all2all-backend", "ep_plugin"],
                                      ["--version"], ["serve", "--help=all2all-backend"], fake_version="0.31.0")
    assert chosen[0] == 2
    warning = ("ep_plugin: --all2all-backend ep_plugin is not available: ep_plugin supports vLLM 0.32.x to 0.33.x, "
               "found 0.31.0")
    output = chosen[1] + chosen[2]
    assert output.count(warning) == 1, output[-3000:]
    assert "invalid choice: 'ep_plugin'" in chosen[2]
    assert output.index(warning) < output.index("invalid choice")
    assert version[0] == 0 and version[1].strip(), version[2][-3000:]
    assert shown[0] == 0, shown[2][-3000:]
    assert "ep_plugin" not in _choices_line(shown[1])
    assert warning not in version[1] + version[2] + shown[1] + shown[2]  # one warning per process


# ---- the previous vLLM release --------------------------------------------------------------------------------
PREVIOUS_VLLM_DIR = os.environ.get("EP_PLUGIN_VLLM_PREVIOUS_DIR", os.path.expanduser("~/.cache/ep_plugin/vllm-0.32"))
IN_PREVIOUS_VLLM = "EP_PLUGIN_TESTING_PREVIOUS_VLLM"


@pytest.mark.skipif(os.environ.get(IN_PREVIOUS_VLLM) == "1", reason="this run is the one against the previous vLLM")
def test_previous_vllm_release():
    """This file's tests, in a child pytest with vLLM 0.32 (installed by .ci/install_vllm.sh into its own
    directory) ahead of the installed vLLM on sys.path."""
    if not os.path.isdir(os.path.join(PREVIOUS_VLLM_DIR, "vllm")):
        pytest.skip(f"vLLM 0.32 is not installed in {PREVIOUS_VLLM_DIR} (.ci/install_vllm.sh installs it)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [PREVIOUS_VLLM_DIR, os.environ.get("PYTHONPATH")])),
               VLLM_TARGET_DEVICE="cpu", **{IN_PREVIOUS_VLLM: "1"})
    version = subprocess.run([sys.executable, "-c", "import vllm; print(vllm.__version__, vllm.__file__)"], env=env,
                             capture_output=True, text=True, timeout=300)
    assert version.stdout.startswith("0.32.") and PREVIOUS_VLLM_DIR in version.stdout, version.stdout + version.stderr
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__], env=env,
                           cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    summary = child.stdout.strip().splitlines()[-1] if child.stdout.strip() else ""
    assert child.returncode == 0 and " failed" not in summary, child.stdout[-6000:] + child.stderr[-3000:]


@pytest.mark.parametrize("mode,graphs_kept", [("normal", False), ("low_latency", True)])
def test_cuda_graphs_follow_the_mode(registered, tmp_path, monkeypatch, mode, graphs_kept):
    """As vLLM does for DeepEP high-throughput: normal mode turns CUDA graphs off, low-latency keeps them."""
    from vllm.config.compilation import CompilationConfig, CompilationMode, CUDAGraphMode

    config_file = tmp_path / f"{mode}.yaml"
    config_file.write_text(f"mode: {mode}\n")
    monkeypatch.setenv("EP_PLUGIN_CONFIG", str(config_file))
    for backend, dp_size, kept in (("ep_plugin", 2, graphs_kept), ("ep_plugin", 1, True), ("allgather_reducescatter", 2, True)):
        compilation = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode.PIECEWISE)
        compilation.set_splitting_ops_for_v1(all2all_backend=backend, data_parallel_size=dp_size)
        assert (compilation.cudagraph_mode != CUDAGraphMode.NONE) == kept, (backend, dp_size, mode)

# ---- interfaces and capability answers ---------------------------------------------------------------------
def test_classes_satisfy_vllm_interfaces(registered):
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm.distributed.device_communicators.base_device_communicator import All2AllManagerBase

    from ep_plugin.integrations.vllm.manager import EpPluginAll2AllManager
    from ep_plugin.integrations.vllm.prepare_finalize import (EpPluginLowLatencyPrepareAndFinalize,
                                                              EpPluginPrepareAndFinalize)
    assert issubclass(EpPluginAll2AllManager, All2AllManagerBase)
    assert EpPluginAll2AllManager.get_handle is not All2AllManagerBase.get_handle
    for cls in (EpPluginPrepareAndFinalize, EpPluginLowLatencyPrepareAndFinalize):
        assert issubclass(cls, mk.FusedMoEPrepareAndFinalizeModular)
        assert not cls.__abstractmethods__, f"{cls.__name__} leaves {sorted(cls.__abstractmethods__)} abstract"
        for hook in ("prepare_async", "finalize_async"):
            assert getattr(cls, hook) is not getattr(mk.FusedMoEPrepareAndFinalizeModular, hook)


def _quant_config(kind: str):
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG, fp8_w8a8_moe_quant_config
    ones = torch.ones(2, 1, 1)
    return {
        "unquantized": lambda: FUSED_MOE_UNQUANTIZED_CONFIG,
        "block_fp8": lambda: fp8_w8a8_moe_quant_config(w1_scale=ones, w2_scale=ones, block_shape=[128, 128]),
        "per_tensor_fp8": lambda: fp8_w8a8_moe_quant_config(w1_scale=ones, w2_scale=ones, a1_scale=torch.ones(1)),
        "per_token_fp8": lambda: fp8_w8a8_moe_quant_config(w1_scale=ones, w2_scale=ones, per_act_token_quant=True),
    }[kind]()


@pytest.mark.parametrize("kind, expected", [("unquantized", "bf16"), ("block_fp8", "block_fp8")])
def test_carried_quantisation(registered, kind, expected):
    from ep_plugin.integrations.vllm.prepare_finalize import activation_transport
    assert activation_transport(_quant_config(kind), defer_input_quant=False) == expected
    assert activation_transport(_quant_config(kind), defer_input_quant=True) == "bf16"


@pytest.mark.parametrize("kind", ["per_tensor_fp8", "per_token_fp8"])
def test_uncarried_quantisation_is_rejected(registered, kind):
    from ep_plugin.integrations.vllm.prepare_finalize import activation_transport
    with pytest.raises(NotImplementedError, match="--all2all-backend"):
        activation_transport(_quant_config(kind), defer_input_quant=False)
    # Experts that quantise their own input get bf16, whatever their scheme.
    assert activation_transport(_quant_config(kind), defer_input_quant=True) == "bf16"


def test_buffer_settings_follow_the_layer(registered):
    from ep_plugin import EpConfig
    from ep_plugin.integrations.vllm.manager import buffer_settings
    base = EpConfig()
    low_latency = buffer_settings(base, "low_latency", 2880, max_dispatch_tokens_per_rank=64, num_experts=32)
    assert (low_latency.mode, low_latency.buffer.max_hidden) == ("low_latency", 2880)
    assert (low_latency.low_latency.max_dispatch_tokens_per_rank, low_latency.low_latency.num_experts) == (64, 32)
    normal = buffer_settings(base, "normal", 2880)
    assert (normal.mode, normal.buffer.max_hidden, normal.low_latency) == ("normal", 2880, base.low_latency)
    with pytest.raises(ValueError, match="mode"):
        buffer_settings(base, "fast", 2880)
    with pytest.raises(ValueError, match="max_dispatch_tokens_per_rank"):
        buffer_settings(base, "low_latency", 2880)
    with pytest.raises(ValueError, match="hidden"):
        buffer_settings(base, "normal", 0)


# ---- prepare -> dense experts -> finalize on 2 ranks ---------------------------------------------------------
def _write_config(tmp_path, mode: str) -> str:
    path = tmp_path / f"{mode}.yaml"
    path.write_text(f"mode: {mode}\nbackend: reference\nlow_latency:\n  max_dispatch_tokens_per_rank: {MAX_TOKENS}\n")
    return str(path)


def _cases(seed: int):
    generator = torch.Generator().manual_seed(seed)
    common = dict(num_ranks=WORLD_SIZE, num_experts=NUM_EXPERTS, top_k=TOP_K, intermediate=INTERMEDIATE,
                  max_tokens=MAX_TOKENS, generator=generator)
    return [case_lib.make_case("bf16", False, hidden=BF16_HIDDEN, **common),
            case_lib.make_case("block_fp8", True, hidden=FP8_HIDDEN, **common)]


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_prepare_experts_finalize_match_dense_moe(registered, tmp_path, mode):
    seed = BASE_SEED + (0 if mode == "normal" else 1)
    cases = _cases(seed)
    results = parallel_launch(WORLD_SIZE, case_lib.run_rank, _write_config(tmp_path, mode), cases, MAX_TOKENS,
                              timeout_s=240)
    low_latency = mode == "low_latency"
    for rank, result in enumerate(results):
        facts = result["facts"]
        assert facts["manager"] == "EpPluginAll2AllManager"
        assert facts["oracle_sees_patch"], "the unquantized oracle still holds vLLM's own maybe_make_prepare_finalize"
        assert facts["batched_format"] is low_latency
        assert facts["pf_class"] == ("EpPluginLowLatencyPrepareAndFinalize" if low_latency
                                     else "EpPluginPrepareAndFinalize")
        assert facts["activation_format"] == ("BatchedExperts" if low_latency else "Standard")
        assert facts["topk_indices_dtype"] == "torch.int64"
        assert facts["max_num_tokens"] == (MAX_TOKENS if low_latency else None)
        assert facts["num_dispatchers"] == WORLD_SIZE
        assert facts["output_is_reduced"] is True and facts["supports_async"] is True
        assert facts["backend"] == "reference"
        if low_latency:
            assert "must get the topk_ids, topk_weights and apply_router_weight_on_input of the matching prepare" \
                in facts["finalize_mismatch_error"]
            assert "max_dispatch_tokens_per_rank" in facts["too_many_tokens_error"]
            assert f"up to {MAX_TOKENS + 1} tokens" in facts["too_many_tokens_error"]
        else:
            assert facts["too_many_tokens_error"] is None  # normal mode has no per-call token limit
        # One buffer per distinct layer shape: the bf16 and FP8 cases differ in hidden size.
        assert facts["num_buffers"] == 2 and facts["num_buffers_after_destroy"] == 0
        for case in cases:
            expected = case_lib.dense_moe(case.xs[rank], case.topk_ids[rank], case.topk_weights[rank], case.w1,
                                          case.w2, case.block_fp8)
            for path in ("kernel", "sync"):
                dtype, shape, scales = facts[f"{case.name}/{path}/expert_input"]
                hidden = case.xs[rank].size(1)
                assert dtype == ("torch.float8_e4m3fn" if case.block_fp8 else "torch.bfloat16")
                if low_latency:
                    assert shape == (NUM_EXPERTS // WORLD_SIZE, WORLD_SIZE * MAX_TOKENS, hidden)
                assert scales == ((*shape[:-1], -(-hidden // 128)) if case.block_fp8 else None)
                out = torch.tensor(result["outputs"][f"{case.name}/{path}"], dtype=torch.float32)
                assert out.shape == case.xs[rank].shape
                torch.testing.assert_close(out, expected, rtol=3e-2, atol=3e-2,
                                           msg=lambda m: f"{mode} {case.name} {path} rank {rank} "
                                                         f"(EP_TEST_SEED={seed}): {m}")
