"""The native backend's host code on the CPU (GPUs or not): its kernels replaced by stand-ins.

`stand_in_kernels(runtime)` makes every `Buffer` created inside it a CPU buffer over a real
`NativeBackend` (its own constructor and methods) whose low-latency runtime is `runtime` and whose
normal-mode runtime and layout kernel do nothing. Used by tests/test_low_latency_host.py (what the host code
hands the kernels) and benchmarks/probes/host_overhead.py (what it costs).
"""
from __future__ import annotations

import contextlib
import types
from typing import Dict, List, Tuple
from unittest import mock

import torch

import ep_plugin.buffer
from ep_plugin.backends import intranode, native, native_common

NUM_DEVICE_SMS = 132  # an H100's


class StandInLowLatencyRuntime:
    """`_C_nvshmem.LowLatencyRuntime`'s per-call methods, doing nothing."""

    def dispatch(self, args, parity: int, stream: int) -> None:
        pass

    def combine(self, args, parity: int, stream: int) -> None:
        pass

    def supports_expert_sums(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> bool:
        return True

    def destroy(self, collective: bool = True) -> None:
        pass


class RecordingLowLatencyRuntime(StandInLowLatencyRuntime):
    """Keeps each launch: (operation, its Args' fields as they were at the launch, parity)."""

    def __init__(self) -> None:
        self.launches: List[Tuple[str, Dict[str, object], int]] = []

    def dispatch(self, args, parity: int, stream: int) -> None:
        self.launches.append(("dispatch", fields_of(args), parity))

    def combine(self, args, parity: int, stream: int) -> None:
        self.launches.append(("combine", fields_of(args), parity))


def fields_of(args) -> Dict[str, object]:
    """A bound Args struct's fields and their values."""
    return {name: getattr(args, name) for name in dir(args)
            if not name.startswith("_") and not callable(getattr(args, name))}


class _StandInIntranodeRuntime:
    def destroy(self) -> None:
        pass


def _no_layout_kernel(**kwargs) -> None:
    """`_C.get_dispatch_layout`, doing nothing."""


@contextlib.contextmanager
def stand_in_kernels(runtime: StandInLowLatencyRuntime):
    """NativeBackend's real constructor and methods over stand-in runtimes, on the CPU (current stream 0)."""
    properties = types.SimpleNamespace(multi_processor_count=NUM_DEVICE_SMS)
    with mock.patch.object(native, "unsupported_reason", return_value=""), \
            mock.patch.object(native.NativeBackend, "_start_low_latency", lambda self, num_rdma_bytes: runtime), \
            mock.patch.object(native.NativeBackend, "_start_intranode",
                              lambda self, num_nvl_bytes, low_latency_mode: setattr(
                                  self, "_runtime", _StandInIntranodeRuntime())), \
            mock.patch.object(torch.cuda, "get_device_properties", return_value=properties), \
            mock.patch.object(torch.cuda, "synchronize"), \
            mock.patch.object(native_common, "_current_raw_stream", lambda device_index: 0), \
            mock.patch.object(intranode._C, "get_dispatch_layout", _no_layout_kernel), \
            mock.patch.object(ep_plugin.buffer, "buffer_device", lambda group, backend: torch.device("cpu")), \
            mock.patch.object(ep_plugin.buffer, "select_backend",
                              lambda info, settings, nvl, rdma, low_latency: native.NativeBackend(
                                  info, settings, nvl, rdma, low_latency)):
        yield
