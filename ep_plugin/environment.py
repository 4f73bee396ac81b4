"""Environment variables for NCCL / NVSHMEM, applied before either starts.

`env:` entries from the config never override a variable the user already set; what was set and
what was kept is logged.
"""
from __future__ import annotations

import logging
import os
from typing import Dict, Mapping, MutableMapping, Optional, Tuple

from .config import EpConfig

logger = logging.getLogger("ep_plugin")


def requested_environment(cfg: EpConfig, low_latency_mode: Optional[bool] = None) -> Dict[str, str]:
    """Every variable the configuration asks for (its `env:` section)."""
    return dict(cfg.env)


def resolve_environment(cfg: EpConfig, environ: Mapping[str, str],
                        low_latency_mode: Optional[bool] = None) -> Tuple[Dict[str, str], Dict[str, str]]:
    """Split the requested variables into (to_set, kept_from_user)."""
    to_set, kept = {}, {}
    for name, value in requested_environment(cfg, low_latency_mode).items():
        if name in environ:
            kept[name] = environ[name]
        else:
            to_set[name] = value
    return to_set, kept


def apply_environment(cfg: EpConfig, low_latency_mode: Optional[bool] = None,
                      environ: Optional[MutableMapping[str, str]] = None) -> Dict[str, str]:
    """Set the requested variables that the user has not set; returns what was set."""
    environ = os.environ if environ is None else environ
    to_set, kept = resolve_environment(cfg, environ, low_latency_mode)
    for name, value in to_set.items():
        environ[name] = value
        logger.debug("ep_plugin env: set %s=%s", name, value)
    for name, value in kept.items():
        logger.debug("ep_plugin env: kept user value %s=%s", name, value)
    return to_set
