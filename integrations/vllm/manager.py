"""`EpPluginAll2AllManager`: the EP group's all2all manager for `--all2all-backend ep_plugin`.

vLLM asks its EP communicator's manager for a communication handle per MoE layer configuration
(`get_handle(kwargs)`); ours is an `ep_plugin.Buffer`, created on first request, cached by the
request's arguments (layers of equal shape share one) and released by `destroy()`.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Dict, Mapping, Optional, Tuple

import torch.distributed as dist
from vllm.distributed.device_communicators.base_device_communicator import All2AllManagerBase

from ep_plugin import Buffer, EpConfig, load_config
from ep_plugin.config import CONFIG_ENV_VAR

logger = logging.getLogger("vllm.ep_plugin")

MODES = ("normal", "low_latency")


@functools.lru_cache(maxsize=None)
def _load_serving_config(path: Optional[str]) -> EpConfig:
    return load_config(path)


def serving_config() -> EpConfig:
    """ep_plugin's config for serving: the YAML named by `$EP_PLUGIN_CONFIG`, else the defaults."""
    return _load_serving_config(os.environ.get(CONFIG_ENV_VAR) or None)


def buffer_settings(settings: EpConfig, mode: str, hidden: int, max_dispatch_tokens_per_rank: Optional[int] = None,
                    num_experts: Optional[int] = None) -> EpConfig:
    """`settings` with the mode and the sizes one MoE layer needs (what `Buffer.from_config` sizes from)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not isinstance(hidden, int) or hidden <= 0:
        raise ValueError(f"hidden must be a positive int, got {hidden!r}")
    low_latency = settings.low_latency
    if mode == "low_latency":
        if max_dispatch_tokens_per_rank is None or num_experts is None:
            raise ValueError("a low-latency buffer needs max_dispatch_tokens_per_rank and num_experts")
        low_latency = dataclasses.replace(low_latency, max_dispatch_tokens_per_rank=max_dispatch_tokens_per_rank,
                                          num_experts=num_experts)
    return settings.replace(mode=mode, buffer=dataclasses.replace(settings.buffer, max_hidden=hidden),
                            low_latency=low_latency)


class EpPluginAll2AllManager(All2AllManagerBase):
    """Creates, caches and destroys the `ep_plugin.Buffer`s of one EP group.

    Arguments:
        cpu_group: the EP group's gloo group (vLLM's `cpu_group`).
        tcp_store_group: vLLM's stateless group, when the EP group is one (elastic EP).
        device_group: the EP group's device group (NCCL on GPUs). Buffers use it when given: the
            reference backend moves tensors through it, the native backend only sets up with it.
        settings: ep_plugin's config; by default the serving config (`$EP_PLUGIN_CONFIG`).
    """

    def __init__(self, cpu_group, tcp_store_group=None, device_group: Optional[dist.ProcessGroup] = None,
                 settings: Optional[EpConfig] = None) -> None:
        super().__init__(cpu_group, tcp_store_group)
        self.settings = serving_config() if settings is None else settings
        self.buffer_group = device_group if device_group is not None else cpu_group
        self._buffers: Dict[Tuple, Buffer] = {}

    def get_handle(self, kwargs: Mapping[str, object]) -> Buffer:
        """The buffer for `kwargs`: {"mode", "hidden"} and, in low-latency mode,
        "max_dispatch_tokens_per_rank" and "num_experts". A collective on first use of a key."""
        key = tuple(sorted(kwargs.items()))
        buffer = self._buffers.get(key)
        if buffer is None:
            settings = buffer_settings(self.settings, **kwargs)
            buffer = Buffer.from_config(self.buffer_group, settings, explicitly_destroy=True)
            logger.info("ep_plugin: created a %s buffer (%s backend) for %s on EP rank %d of %d", settings.mode,
                        buffer.backend_name, dict(kwargs), self.rank, self.world_size)
            self._buffers[key] = buffer
        return buffer

    @property
    def num_buffers(self) -> int:
        """How many distinct buffers this manager holds."""
        return len(self._buffers)

    def set_num_sms(self, num_sms: int) -> None:
        """SMs for normal-mode kernels (ep_plugin's class-wide setting, as DeepEP's)."""
        Buffer.set_num_sms(num_sms)

    def max_sms_used(self) -> Optional[int]:
        """SMs normal-mode kernels may occupy; None when only low-latency buffers exist (they use what they need)."""
        if any(not buffer.low_latency_mode for buffer in self._buffers.values()):
            return Buffer.num_sms
        return None

    def destroy(self) -> None:
        """Release every buffer (a collective: all ranks of the EP group call it)."""
        buffers, self._buffers = list(self._buffers.values()), {}
        for buffer in buffers:
            buffer.destroy()
