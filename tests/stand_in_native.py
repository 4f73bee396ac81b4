"""The native backend's host code on the CPU (GPUs or not): its kernels replaced by stand-ins.

`stand_in_kernels(runtime)` makes every `Buffer` created inside it a CPU buffer over a real
`NativeBackend` (its own constructor and methods) whose low-latency runtime is `runtime`, whose
normal-mode runtime is a `StandInIntranodeRuntime` (or the class given as `intranode`) with its output
region in host memory, and whose layout kernel does nothing. Used by tests/test_low_latency_host.py and
tests/test_intranode_host.py (what the host code hands the kernels) and benchmarks/probes/host_overhead.py
(what it costs).
"""
from __future__ import annotations

import contextlib
import time
import types
from typing import Dict, List, Optional, Tuple
from unittest import mock

import torch

import ep_plugin.buffer
from ep_plugin.backends import intranode as intranode_module, native, native_common
from ep_plugin.backends.native_common import _C

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
    """Keeps each launch: (operation, its Args' fields as they were at the launch, parity).

    `bad_input`: the report of an expert id out of range that a dispatch kernel recorded; as the real
    runtime does, the next dispatch's send raises it as ValueError, clears it and launches nothing.
    """

    PHASE_SEND = 1  # _C_nvshmem.PHASE_SEND

    def __init__(self) -> None:
        self.launches: List[Tuple[str, Dict[str, object], int]] = []
        self.bad_input: Optional[str] = None

    def dispatch(self, args, parity: int, stream: int) -> None:
        if args.phases & self.PHASE_SEND and self.bad_input is not None:
            report, self.bad_input = self.bad_input, None
            raise ValueError(report)
        self.launches.append(("dispatch", fields_of(args), parity))

    def combine(self, args, parity: int, stream: int) -> None:
        self.launches.append(("combine", fields_of(args), parity))


def fields_of(args) -> Dict[str, object]:
    """A bound Args struct's fields and their values."""
    return {name: getattr(args, name) for name in dir(args)
            if not name.startswith("_") and not callable(getattr(args, name))}


class StandInIntranodeRuntime:
    """`_C.IntranodeRuntime` on the host: the same constructor, its output region in host memory, kernels
    that do nothing. `wait_notify` answers as if every rank sent this rank all of its tokens (as many as
    this rank's notify had); each local expert gets an even share, rounded up to the alignment.

    `notified_at` / `wait_returned_at` / `launched_at`: time.perf_counter() as notify was launched, as
    `wait_notify` returned and as the last dispatch (rings or direct) was launched."""

    def __init__(self, rank: int, num_ranks: int, num_nvl_bytes: int, timeout_s: float, staging_bytes: int = 0,
                 output_bytes: int = 0, direct_max_blocks: int = 16, direct_chunk_tokens: int = 1) -> None:
        self.rank, self.num_ranks = rank, num_ranks
        self._region = torch.empty(output_bytes + _C.REGION_ALIGNMENT, dtype=torch.uint8)
        self.output_region_address = -(-self._region.data_ptr() // _C.REGION_ALIGNMENT) * _C.REGION_ALIGNMENT
        self._notify = None
        self.wait_returned_at = self.launched_at = 0.0

    def ipc_handle(self) -> bytes:
        return b""

    def connect(self, handles) -> None:
        pass

    def check_device_error(self) -> None:
        pass

    def destroy(self) -> None:
        pass

    def staging_rows(self, staging_bytes: int, hidden: int) -> int:
        return _C.staging_rows(self.num_ranks, staging_bytes, hidden)

    def notify(self, args, stream: int) -> None:
        self.notified_at = time.perf_counter()
        self._notify = (args.num_tokens, args.expert_alignment, args.host_tag)

    def received(self, num_tokens: int, num_local_experts: int, alignment: int) -> Tuple[int, List[int], List[int]]:
        """(rows received, rows from each rank, aligned rows per local expert) after a notify of `num_tokens`."""
        per_rank = [num_tokens] * self.num_ranks
        share = -(-sum(per_rank) // num_local_experts)
        return sum(per_rank), per_rank, [-(-share // alignment) * alignment] * num_local_experts

    def wait_notify(self, tag: int, stream: int) -> int:
        num_tokens, alignment, notified_tag = self._notify
        if tag != notified_tag:
            raise AssertionError(f"wait_notify for tag {tag}; the last notify had tag {notified_tag}")
        self.wait_returned_at = time.perf_counter()
        return num_tokens * self.num_ranks

    def notify_counts(self, num_local_experts: int) -> Tuple[List[int], List[int], int]:
        num_tokens, alignment, _ = self._notify
        per_rank, per_expert = self.received(num_tokens, num_local_experts, alignment)[1:]
        return per_rank, per_expert, max(per_rank)

    def dispatch(self, args, stream: int) -> None:
        self.launched_at = time.perf_counter()

    def direct_dispatch(self, args, num_recv_rows: int, has_room: bool, stream: int, own_runs_tag: int = 0,
                        own_runs=None) -> None:
        """No copy engine here: the own rows' runs are never used (None)."""
        self.launched_at = time.perf_counter()

    def direct_fell_back(self) -> bool:
        return False

    def combine(self, args, stream: int) -> None:
        pass

    def staged_combine(self, args, rows_from: List[int], staging_bytes: int, num_sms: int, stream: int,
                       side_stream: int) -> None:
        pass


class RecordingIntranodeRuntime(StandInIntranodeRuntime):
    """Keeps each call: (operation, its Args' fields at the call, the call's other arguments but streams)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.launches: List[Tuple[str, Dict[str, object], tuple]] = []

    def notify(self, args, stream: int) -> None:
        super().notify(args, stream)
        self.launches.append(("notify", fields_of(args), ()))

    def wait_notify(self, tag: int, stream: int) -> int:
        rows = super().wait_notify(tag, stream)
        self.launches.append(("wait_notify", {}, (tag,)))
        return rows

    def notify_counts(self, num_local_experts: int) -> Tuple[List[int], List[int], int]:
        self.launches.append(("notify_counts", {}, (num_local_experts,)))
        return super().notify_counts(num_local_experts)

    def dispatch(self, args, stream: int) -> None:
        self.launches.append(("dispatch", fields_of(args), ()))

    def direct_dispatch(self, args, num_recv_rows: int, has_room: bool, stream: int, own_runs_tag: int = 0,
                        own_runs=None) -> None:
        self.launches.append(("direct_dispatch", fields_of(args), (num_recv_rows, has_room)))

    def combine(self, args, stream: int) -> None:
        self.launches.append(("combine", fields_of(args), ()))

    def staged_combine(self, args, rows_from: List[int], staging_bytes: int, num_sms: int, stream: int,
                       side_stream: int) -> None:
        self.launches.append(("staged_combine", fields_of(args), (list(rows_from), staging_bytes, num_sms)))


def _no_layout_kernel(*args) -> None:
    """`_C.get_dispatch_layout`, doing nothing."""


@contextlib.contextmanager
def stand_in_kernels(runtime: StandInLowLatencyRuntime, intranode: Optional[type] = None):
    """NativeBackend's real constructor and methods over stand-in runtimes, on the CPU (current stream 0,
    side streams stand-ins, no graph capture): `runtime` for low latency, a new `intranode` (default
    StandInIntranodeRuntime) for the normal mode of each Buffer."""
    properties = types.SimpleNamespace(multi_processor_count=NUM_DEVICE_SMS)
    with mock.patch.object(native, "unsupported_reason", return_value=""), \
            mock.patch.object(native.NativeBackend, "_start_low_latency", lambda self, num_rdma_bytes: runtime), \
            mock.patch.object(intranode_module._C, "IntranodeRuntime", intranode or StandInIntranodeRuntime), \
            mock.patch.object(torch.cuda, "get_device_properties", return_value=properties), \
            mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: False), \
            mock.patch.object(torch.cuda, "Stream", lambda device=None: types.SimpleNamespace(cuda_stream=0)), \
            mock.patch.object(torch.cuda, "synchronize"), \
            mock.patch.object(native_common, "_current_raw_stream", lambda device_index: 0), \
            mock.patch.object(intranode_module._C, "get_dispatch_layout", _no_layout_kernel), \
            mock.patch.object(ep_plugin.buffer, "buffer_device", lambda: torch.device("cpu")), \
            mock.patch.object(ep_plugin.buffer, "select_backend",
                              lambda info, settings, nvl, rdma, low_latency: native.NativeBackend(
                                  info, settings, nvl, rdma, low_latency)):
        yield
