"""Make the real megatron-core importable in a test process, without importing it.

Two things in a CPU-only Python 3.11 environment stop the stock wheels from importing; `prepare()`
works around each where (and only where) it happens:

- megatron-core 0.17+ imports FlashInfer when it is installed, catching only ImportError. On a
  CPU-only PyTorch, FlashInfer's own import can raise something else (it queries CUDA device
  properties at import), so without CUDA FlashInfer (a CUDA kernel library, useless there) is
  blocked: `import flashinfer` raises ImportError and Megatron takes its no-FlashInfer path.
- Megatron-LM's `megatron.training` (shipped in the megatron-core wheel from 0.17 on) targets
  Python 3.12 and imports `typing.override`; on 3.11 `typing_extensions.override` (the same
  decorator, a no-op at run time) is put there.

Call it first in every process that imports Megatron (test workers, spawned ranks, subprocesses).
"""
from __future__ import annotations

import importlib.util
import os
import sys
import typing
from typing import Any, Callable, List


def megatron_core_installed() -> bool:
    """Whether megatron-core is installed (looked up without importing it)."""
    try:
        return importlib.util.find_spec("megatron") is not None and \
            importlib.util.find_spec("megatron.core") is not None
    except (ImportError, ValueError):
        return False


def _block_flashinfer_without_cuda() -> None:
    import torch
    if torch.cuda.is_available() or "flashinfer" in sys.modules:
        return
    sys.modules["flashinfer"] = None  # later imports raise ImportError


def _backport_typing_override() -> None:
    if not hasattr(typing, "override"):
        import typing_extensions
        typing.override = typing_extensions.override


def prepare() -> None:
    """Apply both work-arounds (idempotent)."""
    _block_flashinfer_without_cuda()
    _backport_typing_override()


def cpu_launch(world_size: int, fn: Callable, *args: Any, timeout_s: float) -> List[Any]:
    """`parallel_launch` of the CPU cases over gloo, on GPU machines too: the spawned ranks inherit an
    environment that shows them no GPU (these cases build Megatron's layers on the CPU)."""
    from ep_plugin.launch import parallel_launch
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        return parallel_launch(world_size, fn, *args, backend="gloo", timeout_s=timeout_s)
    finally:
        if visible is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
