"""vLLM integration: `vllm serve ... --enable-expert-parallel --all2all-backend ep_plugin`.

vLLM loads `register` (entry point `vllm.general_plugins: ep_plugin`) in every process before it
builds its CLI parser, engine and workers. `register()` checks the imported vLLM (0.32.x or 0.33.x,
with the objects `_patches.py` expects) and patches the few places listed there; the MoE layers then
get ep_plugin's prepare/finalize (normal or low-latency mode, from the YAML named by
`$EP_PLUGIN_CONFIG`). On any other vLLM it logs one warning and changes nothing, so vLLM works as
without ep_plugin and rejects `--all2all-backend ep_plugin` as an invalid choice. docs/vllm.md has
the details.
"""
from __future__ import annotations

from ._patches import BACKEND_NAME, RELEASES, VllmVersionError, check_version, logger, vllm_version

_warned = False


def register() -> None:
    """Make `ep_plugin` a vLLM all2all backend in this process (idempotent). Never raises: vLLM's
    plugin loader does not catch what a plugin raises, and every vLLM command would fail.

    Where the imported vLLM is not supported (`VllmVersionError`) or patching fails, one warning
    names the vLLM version, the supported range and the reason; nothing is registered.
    """
    global _warned
    from . import _patches
    try:
        _patches.apply()
    except Exception as error:  # noqa: BLE001 - see the docstring
        if not _warned:
            _warned = True
            logger.warning("ep_plugin: --all2all-backend %s is not available: %s", BACKEND_NAME, _reason(error))


def _reason(error: Exception) -> str:
    """Why registration failed, with the vLLM version and the supported range."""
    if isinstance(error, VllmVersionError):
        return str(error)  # names both
    try:
        version = vllm_version()
    except VllmVersionError:
        version = "(not importable)"
    return (f"patching vLLM {version} failed ({type(error).__name__}: {error}); ep_plugin supports vLLM "
            f"{RELEASES.describe()}")


__all__ = ["BACKEND_NAME", "RELEASES", "VllmVersionError", "check_version", "register", "vllm_version"]
