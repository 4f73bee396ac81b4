"""The intranode kernels under compute-sanitizer's memcheck: no access outside the tensors and buffers they
are given (a read past a tensor's end goes unseen until that tensor ends its allocator segment)."""
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

from memcheck_rounds import rounds
from native_helpers import multi_gpu_ranks, needs_ranks

RANKS = multi_gpu_ranks()  # 2 unless EP_TEST_RANKS says otherwise
HELPER = Path(__file__).with_name("memcheck_rounds.py")


def find_sanitizer() -> Optional[str]:
    """compute-sanitizer on PATH, or in the CUDA toolkit torch builds extensions with (its CUDA_HOME)."""
    from torch.utils.cpp_extension import CUDA_HOME
    in_toolkit = Path(CUDA_HOME) / "bin" / "compute-sanitizer" if CUDA_HOME else None
    return shutil.which("compute-sanitizer") or (str(in_toolkit) if in_toolkit and in_toolkit.exists() else None)


@needs_ranks(RANKS)
def test_intranode_kernels_touch_nothing_outside_their_memory():
    sanitizer = find_sanitizer()
    if sanitizer is None:
        pytest.skip("compute-sanitizer is not installed (it comes with the CUDA toolkit)")
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    command = [sanitizer, "--tool", "memcheck", "--target-processes", "all", "--error-exitcode", "3",
               "--print-limit", "10", sys.executable, str(HELPER), str(RANKS)]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "ERROR SUMMARY: 0 errors" in output, output[-6000:]
    assert output.count("memcheck rounds:") == len(rounds(RANKS)), output[-6000:]
