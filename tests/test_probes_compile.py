"""The CUDA probes under benchmarks/probes compile against the library's current kernels and headers
(staged_reduce.cu includes the copy-engine combine's kernel file itself). They run only on GPUs; here
nvcc compiles them for sm_90a without a GPU."""
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROBES = sorted((ROOT / "benchmarks" / "probes").glob("*.cu"))
NVCC = shutil.which("nvcc")


def _include_dirs() -> list[str]:
    cccl = Path(NVCC).resolve().parent.parent / "include" / "cccl"  # cuda/std headers from CUDA 13 on
    return [str(ROOT / "csrc")] + ([str(cccl)] if cccl.is_dir() else [])


@pytest.mark.skipif(NVCC is None, reason="no nvcc on this machine (CI machines have one)")
@pytest.mark.parametrize("probe", PROBES, ids=lambda p: p.name)
def test_probe_compiles(probe, tmp_path):
    command = [NVCC, "-O3", "-std=c++17", "-arch=sm_90a", "-c", "-o", str(tmp_path / "probe.o"), str(probe)]
    command += [f"-I{d}" for d in _include_dirs()]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "probe.o").stat().st_size > 0


def test_the_probes_are_found():
    assert {"sm_rate.cu", "staged_reduce.cu", "link_probe.cu"} <= {p.name for p in PROBES}
