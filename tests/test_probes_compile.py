"""The CUDA probes under benchmarks/probes compile against the library's current kernels and headers
(staged_reduce.cu includes the copy-engine combine's kernel file itself), and notify_steps.patch applies
to the current sources, which then compile. They run only on GPUs; here nvcc compiles for sm_90a without
a GPU."""
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROBES = sorted((ROOT / "benchmarks" / "probes").glob("*.cu"))
NVCC = shutil.which("nvcc")
GIT = shutil.which("git")


def _include_dirs(csrc: Path = ROOT / "csrc") -> list[str]:
    cccl = Path(NVCC).resolve().parent.parent / "include" / "cccl"  # cuda/std headers from CUDA 13 on
    return [str(csrc)] + ([str(cccl)] if cccl.is_dir() else [])


def _compile(source: Path, output: Path, csrc: Path = ROOT / "csrc") -> subprocess.CompletedProcess:
    command = [NVCC, "-O3", "-std=c++17", "-arch=sm_90a", "-c", "-o", str(output), str(source)]
    command += [f"-I{d}" for d in _include_dirs(csrc)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(NVCC is None, reason="no nvcc on this machine (CI machines have one)")
@pytest.mark.parametrize("probe", PROBES, ids=lambda p: p.name)
def test_probe_compiles(probe, tmp_path):
    run = _compile(probe, tmp_path / "probe.o")
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "probe.o").stat().st_size > 0


@pytest.mark.skipif(NVCC is None or GIT is None, reason="needs nvcc and git (CI machines have both)")
def test_notify_steps_patch_applies_and_the_patched_sources_compile(tmp_path):
    csrc = tmp_path / "csrc"
    shutil.copytree(ROOT / "csrc", csrc)
    patch = ROOT / "benchmarks" / "probes" / "notify_steps.patch"
    applied = subprocess.run([GIT, "apply", str(patch)], cwd=tmp_path, capture_output=True, text=True)
    assert applied.returncode == 0, applied.stderr
    assert "PROBE_STEP" in (csrc / "kernels" / "intranode_notify.cu").read_text()
    for source in (csrc / "kernels" / "intranode_notify.cu", csrc / "runtime.cu"):
        run = _compile(source, tmp_path / f"{source.stem}.o", csrc)
        assert run.returncode == 0, run.stderr[-3000:]


def test_the_probes_are_found():
    assert {"sm_rate.cu", "staged_reduce.cu", "link_probe.cu"} <= {p.name for p in PROBES}
