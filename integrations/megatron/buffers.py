"""Which ep_plugin config the Megatron dispatcher uses, and one `ep_plugin.Buffer` per process group.

Config precedence (highest first): `register(config=...)`, Megatron-LM's `--ep-plugin-config FILE`,
`$EP_PLUGIN_CONFIG`, the built-in defaults. The config must be in normal mode (the dispatcher uses
`get_dispatch_layout` / `dispatch` / `combine`).

The Buffer's per-call expert-id validation (`check_inputs`, a host sync) is off: the dispatcher builds
the ids itself. Buffers are created on first use by a dispatcher of that group (a collective over the group, as
every MoE layer is built on every rank in the same order), shared by every layer, and re-created
larger if a layer needs more hidden bytes than the cached one was sized for.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from typing import List, Optional, Tuple, Union

import torch.distributed as dist

from ep_plugin import Buffer, EpConfig
from ep_plugin.config import as_config

logger = logging.getLogger("ep_plugin.megatron")

ConfigLike = Union[None, str, dict, EpConfig]

_lock = threading.Lock()
_explicit_config: ConfigLike = None      # register(config=...)
_cli_config_path: Optional[str] = None   # --ep-plugin-config, recorded by cli.py when parsed
_cache: List[Tuple[dist.ProcessGroup, Buffer, int]] = []  # (group, buffer, max hidden it was sized for)


def set_explicit_config(config: ConfigLike) -> None:
    """Set the config passed to `register(config=...)` (None: fall back to the CLI flag / env / defaults)."""
    global _explicit_config
    with _lock:
        _explicit_config = config
        _cache.clear()


def set_cli_config_path(path: Optional[str]) -> None:
    """Record the value of `--ep-plugin-config` (called by the argparse action)."""
    global _cli_config_path
    with _lock:
        _cli_config_path = path
        _cache.clear()


def _megatron_lm_args_path() -> Optional[str]:
    """`args.ep_plugin_config` from Megatron-LM's global args, when they exist."""
    import sys
    global_vars = sys.modules.get("megatron.training.global_vars")
    args = getattr(global_vars, "_GLOBAL_ARGS", None) if global_vars is not None else None
    return getattr(args, "ep_plugin_config", None) if args is not None else None


def resolve_config() -> EpConfig:
    """The `EpConfig` the dispatcher uses now (see the module docstring for the precedence)."""
    source: ConfigLike = _explicit_config
    if source is None:
        source = _cli_config_path or _megatron_lm_args_path()
    settings = as_config(source)  # None: $EP_PLUGIN_CONFIG, else defaults
    if settings.mode != "normal":
        where = settings.source or "<config>"
        raise ValueError(f"{where}: mode is {settings.mode!r}, but the Megatron token dispatcher uses ep_plugin's "
                         f"normal mode (get_dispatch_layout / dispatch / combine); set 'mode: normal'")
    return settings


def get_buffer(group: dist.ProcessGroup, hidden: int) -> Buffer:
    """The buffer of `group`, big enough for rows of `hidden` bf16 elements (created collectively)."""
    with _lock:
        for index, (cached_group, buffer, max_hidden) in enumerate(_cache):
            if cached_group is group:
                if hidden <= max_hidden:
                    return buffer
                del _cache[index]
                break
        # The dispatcher builds the expert ids itself (always in [-1, E)): the Buffer's per-call id
        # validation, a device-to-host sync, would only cost time.
        settings = resolve_config().replace(check_inputs=False)
        if hidden > settings.buffer.max_hidden:
            settings = settings.replace(buffer=dataclasses.replace(settings.buffer, max_hidden=hidden))
        buffer = Buffer.from_config(group, settings)
        logger.info("ep_plugin Megatron dispatcher: %s buffer for %d ranks, max hidden %d, config %s",
                    buffer.backend_name, buffer.group_size, settings.buffer.max_hidden, settings.source or "defaults")
        _cache.append((group, buffer, settings.buffer.max_hidden))
        return buffer


def clear_buffers() -> None:
    """Forget every cached buffer (they are released when no dispatcher holds them any more)."""
    with _lock:
        _cache.clear()
