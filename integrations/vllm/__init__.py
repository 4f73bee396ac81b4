"""vLLM integration: `vllm serve ... --enable-expert-parallel --all2all-backend ep_plugin`.

vLLM loads `register` (entry point `vllm.general_plugins: ep_plugin`) in every process before it
builds its CLI parser, engine and workers. `register()` checks the installed vLLM (0.33.x) and
patches the few places listed in `_patches.py`; the MoE layers then get ep_plugin's prepare/finalize
(normal or low-latency mode, from the YAML named by `$EP_PLUGIN_CONFIG`). docs/vllm.md has the details.
"""
from __future__ import annotations

from ._patches import BACKEND_NAME, VllmVersionError, check_version, vllm_version


def register() -> None:
    """Make `ep_plugin` a vLLM all2all backend in this process (idempotent).

    Raises `VllmVersionError` for a vLLM release the patches were not checked against (unless
    `EP_PLUGIN_VLLM_ALLOW_UNTESTED=1`) or one missing a symbol they touch.
    """
    from . import _patches
    _patches.apply()


__all__ = ["BACKEND_NAME", "VllmVersionError", "check_version", "register", "vllm_version"]
