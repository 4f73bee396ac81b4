"""examples/ run as README says, through torchrun (`python -m torch.distributed.run`), 2 CPU ranks
over gloo (NCCL on GPUs): each example checks its own result and exits non-zero if it is wrong."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import megatron_env

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def torchrun(script: Path, *args: str, ranks: int = 2, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                           str(script), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_dispatch_combine_example_matches_plain_torch():
    done = torchrun(EXAMPLES / "dispatch_combine.py", "--tokens", "64", "--hidden", "128")
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in range(2):
        assert f"rank {rank}/2 (" in done.stdout and "combined output matches plain torch" in done.stdout


def test_megatron_example_matches_the_dense_layer():
    if not megatron_env.megatron_core_installed():
        pytest.skip("megatron-core is not installed (.ci/install_megatron.sh)")
    done = torchrun(EXAMPLES / "megatron_moe_layer.py")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("EpPluginTokenDispatcher") == 2 and "output matches the dense layer" in done.stdout


def test_a_clone_named_ep_plugin_beside_the_script_gets_a_clear_hint(tmp_path):
    """`import ep_plugin` finds a folder without __init__.py first (a namespace package)."""
    (tmp_path / "ep_plugin").mkdir()
    script = tmp_path / "dispatch_combine.py"
    shutil.copy(EXAMPLES / "dispatch_combine.py", script)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert f"`import ep_plugin` found the folder {tmp_path / 'ep_plugin'}, not the package" in done.stderr
