"""Backend selection: `native` (csrc kernels) where built and able, else `reference` (torch.distributed)."""
from __future__ import annotations

import logging

from ..config import EpConfig
from .base import Backend, GroupInfo

logger = logging.getLogger("ep_plugin")


def native_support(info: GroupInfo, low_latency_mode: bool, num_nvl_bytes: int, requested: str = "auto") -> str:
    """Why the native backend cannot serve this request ('' if it can); `requested`: 'auto' or 'native'."""
    from . import native
    return native.unsupported_reason(info, low_latency_mode, num_nvl_bytes, requested)


def select_backend(info: GroupInfo, settings: EpConfig, num_nvl_bytes: int, num_rdma_bytes: int,
                   low_latency_mode: bool) -> Backend:
    """Build the backend named by `settings.backend`; `auto` prefers native and logs the choice."""
    choice = settings.backend
    reason = ""
    if choice in ("auto", "native"):
        reason = native_support(info, low_latency_mode, num_nvl_bytes, requested=choice)
        if choice == "native" and reason:
            raise RuntimeError(f"backend 'native' requested but unavailable: {reason}")
        if not reason:
            choice = "native"
        else:
            choice = "reference"
    if choice == "native":
        from .native import NativeBackend
        backend_cls = NativeBackend
    else:
        from .reference import ReferenceBackend
        backend_cls = ReferenceBackend
    mode = "low_latency" if low_latency_mode else "normal"
    if settings.backend == "auto":
        why = f" (native: {reason})" if reason else ""
        logger.info("ep_plugin rank %d: backend auto -> %s for %s mode%s", info.rank, choice, mode, why)
    return backend_cls(info, settings, num_nvl_bytes, num_rdma_bytes, low_latency_mode)
