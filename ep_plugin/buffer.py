"""`ep_plugin.Buffer`: a drop-in for DeepEP V1's `deep_ep.Buffer`.

Switching from DeepEP is a change of import. Names, arguments, defaults, return tuples and
semantics follow DeepEP V1; what ep_plugin adds is keyword-only (`config=`) or a classmethod
(`Buffer.from_config`). docs/design.md spells out the semantics the backends implement.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import weakref
from typing import Callable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch.utils._device import DeviceContext

from . import masking
from . import validation as V
from .backends import select_backend
from .backends.base import Backend, DispatchRoute, GroupInfo
from .backends.waits import join_group
from .config import EpConfig, as_config
from .environment import apply_environment
from .event import EventHandle, EventOverlap
from .handles import DispatchHandle, LowLatencyHandle, all_gather_rows, unwrap
from .topology import resolve_ranks_per_node
from .tuning import Config, default_combine_config, default_dispatch_config
from .tuning import get_low_latency_rdma_size_hint as _ll_size_hint

logger = logging.getLogger("ep_plugin")

XType = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


# NOTE: torch's own test for an active torch-function mode (private; without it nothing is bypassed).
_function_mode_enabled = getattr(torch._C, "_is_torch_function_mode_enabled", lambda: False)
# NOTE: torch.cuda.current_device() without its Python wrapper (private; CUDA builds only).
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def buffer_device() -> torch.device:
    """This process's current GPU, on every backend; the CPU where there is none."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


# NOTE: torch's function-mode stack read in place (torch.overrides._get_current_function_mode_stack builds a
# list), through names bound once: this runs twice in every call under set_default_device.
_function_mode_depth = torch._C._len_torch_function_stack
_function_mode_at = torch._C._get_function_stack_at


def _only_device_modes() -> bool:
    """Whether every active torch-function mode is a default-device one (DeviceContext)."""
    depth = _function_mode_depth()
    if depth == 1:  # set_default_device's mode alone (0.3 us against 0.6 through the loop)
        return isinstance(_function_mode_at(0), DeviceContext)
    return all(isinstance(_function_mode_at(level), DeviceContext) for level in range(depth))


def _without_device_mode(method: Callable) -> Callable:
    """Run `method` without torch's default-device mode.

    `torch.set_default_device` installs a torch-function mode that every torch call then passes through
    in Python (several us per call, tens of calls per dispatch). Every tensor ep_plugin creates names
    its device, so where the default-device mode is the only one active, the call runs with torch
    functions' overrides off; other modes (tracing, user modes) are left in place.
    """
    @functools.wraps(method)
    def call(*args, **kwargs):
        if _function_mode_enabled() and _only_device_modes():
            with torch._C.DisableTorchFunction():
                return method(*args, **kwargs)
        return method(*args, **kwargs)
    return call


class Buffer:
    """Communication buffers for expert-parallel dispatch and combine.

    Normal mode (training, prefill): `get_dispatch_layout`, `dispatch`, `combine`.
    Low-latency mode (decode): `low_latency_dispatch`, `low_latency_combine`.

    Attributes:
        num_sms: SMs used by normal-mode kernels (class-wide, as in DeepEP; `set_num_sms`).
        rank, group_size, group: this rank, the number of ranks, the process group.
        num_nvl_bytes, num_rdma_bytes: buffer sizes.
        backend_name: 'native' or 'reference', the backend serving this buffer.
    """

    num_sms: int = EpConfig().num_sms
    _num_sms_set_explicitly: bool = False

    def __init__(self, group: Optional[dist.ProcessGroup], num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 use_fabric: bool = False, explicitly_destroy: bool = False, enable_shrink: bool = False,
                 comm: Optional[object] = None, *,
                 config: Union[None, str, dict, EpConfig] = None) -> None:
        """Create the buffers (a collective: every rank of `group` must call it).

        Arguments:
            group: the expert-parallel process group (NCCL or gloo; only used for set-up and by
                the reference backend).
            num_nvl_bytes: NVLink buffer bytes for normal mode (see `Config.get_nvl_buffer_size_hint`).
            num_rdma_bytes: symmetric (NVSHMEM) buffer bytes for internode or low-latency mode
                (see `get_low_latency_rdma_size_hint`).
            low_latency_mode: enable the low-latency kernels.
            num_qps_per_rank: RDMA queue pairs per peer (network transports).
            allow_nvlink_for_low_latency_mode: let low-latency traffic use NVLink where peers share it.
            allow_mnnvl: allow multi-node NVLink.
            use_fabric: DeepEP's fabric-API memory; ep_plugin maps its buffers by CUDA IPC and NVSHMEM,
                so only False is accepted (docs/deepep-compat.md).
            explicitly_destroy: resources are released only by `destroy()`, not by the destructor.
            enable_shrink: low-latency calls may mask ranks (`low_latency_update_mask_buffer`; a peer
                that misses `timeout_s` is masked instead of failing the call): ep_plugin/masking.py.
            comm: DeepEP's mpi4py communicator for a process without `group`; ep_plugin needs a
                torch.distributed group, so only None is accepted.
            config: ep_plugin's YAML config (an `EpConfig`, a path or a mapping); by default
                `$EP_PLUGIN_CONFIG` or the built-in defaults. It supplies what DeepEP's arguments do
                not: backend, transport, SMs, timeouts, tuning and environment.
        """
        settings = as_config(config)
        self._settings = settings.replace(low_latency=dataclasses.replace(
            settings.low_latency, num_qps_per_rank=num_qps_per_rank,
            allow_nvlink=allow_nvlink_for_low_latency_mode, allow_mnnvl=allow_mnnvl))
        if group is None and comm is not None:
            raise NotImplementedError("Buffer(comm=...) (an mpi4py communicator) is not supported: ep_plugin sets up "
                                      "and runs over a torch.distributed ProcessGroup; pass group=")
        if group is None:
            raise ValueError("Buffer needs group (a torch.distributed ProcessGroup)")
        if use_fabric:
            raise NotImplementedError("Buffer(use_fabric=True) is not supported: ep_plugin shares its buffers by CUDA "
                                      "IPC (one NVLink domain) and NVSHMEM; pass use_fabric=False")
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group must be a torch.distributed.ProcessGroup, got {type(group).__name__}")
        for name, value in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if not Buffer._num_sms_set_explicitly:
            Buffer.num_sms = settings.num_sms
        logging.getLogger("ep_plugin").setLevel(settings.log_level.upper())
        apply_environment(self._settings, low_latency_mode=low_latency_mode)

        self.group = group
        self.rank = dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = bool(low_latency_mode)
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = bool(enable_shrink)
        device = buffer_device()
        join_group(group, self.rank, self.group_size, settings.timeout_s)  # before the first collective
        ranks_per_node = resolve_ranks_per_node(group, settings.topology.ranks_per_node)
        self._info = GroupInfo(group=group, rank=self.rank, num_ranks=self.group_size,
                               ranks_per_node=ranks_per_node, device=device)
        self._comm_stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self._default_configs = {}
        self._local_regions = {}  # get_local_buffer_tensor's regions (reference backend)
        self._low_latency_sizes_checked = set()  # (T_max, hidden, num_experts) found to fit num_rdma_bytes
        self._last_checked_ids = None  # (weak reference, facts) of the topk_idx last checked
        # Reused for the two streams' ordering in every call (an event is re-recorded safely: a wait
        # takes the event's state when it is queued).
        self._comm_waits_compute = torch.cuda.Event() if device.type == "cuda" else None
        self._compute_waits_comm = torch.cuda.Event() if device.type == "cuda" else None
        self._backend: Optional[Backend] = select_backend(self._info, self._settings, num_nvl_bytes,
                                                          num_rdma_bytes, self.low_latency_mode)
        self.backend_name = self._backend.name
        # The backend's eager fast paths (backends/low_latency.py, backends/intranode.py), where it has them on
        # a GPU; checking expert ids on the host (check_inputs) takes the checked path.
        fast = self._backend if device.type == "cuda" and not self._settings.check_inputs else None
        self._unchecked_low_latency = (
            fast if self.low_latency_mode and hasattr(fast, "unchecked_low_latency_dispatch") else None)
        self._unchecked_layout = fast if hasattr(fast, "unchecked_dispatch_layout") else None
        self._unchecked_normal = fast if hasattr(fast, "unchecked_dispatch") else None
        try:
            self._rank_mask = masking.attach(self._backend, enable_shrink)
        except NotImplementedError:
            self._release(collective=True)  # every rank raises here alike
            raise

    @classmethod
    def from_config(cls, group: dist.ProcessGroup, cfg: Union[None, str, dict, EpConfig] = None,
                    explicitly_destroy: bool = False) -> "Buffer":
        """Create a buffer whose mode and sizes come from ep_plugin's YAML config.

        Sizes set to `auto` are computed from `buffer.max_hidden` and, in low-latency mode, from
        `low_latency.max_dispatch_tokens_per_rank` and `low_latency.num_experts`.
        """
        settings = as_config(cfg)
        num_ranks = dist.get_world_size(group)
        low_latency = settings.mode == "low_latency"
        num_nvl_bytes, num_rdma_bytes = settings.buffer.num_nvl_bytes, settings.buffer.num_rdma_bytes
        hidden_bytes = settings.buffer.max_hidden * 2
        if num_nvl_bytes == "auto":
            num_nvl_bytes = 0 if low_latency else max(
                cls._dispatch_config_for(settings, num_ranks).get_nvl_buffer_size_hint(hidden_bytes, num_ranks),
                cls._combine_config_for(settings, num_ranks).get_nvl_buffer_size_hint(hidden_bytes, num_ranks))
        if num_rdma_bytes == "auto":
            if low_latency:
                ll = settings.low_latency
                num_rdma_bytes = _ll_size_hint(ll.max_dispatch_tokens_per_rank, settings.buffer.max_hidden,
                                               num_ranks, ll.num_experts)
            else:
                num_rdma_bytes = max(
                    cls._dispatch_config_for(settings, num_ranks).get_rdma_buffer_size_hint(hidden_bytes, num_ranks),
                    cls._combine_config_for(settings, num_ranks).get_rdma_buffer_size_hint(hidden_bytes, num_ranks))
        ll = settings.low_latency
        return cls(group, num_nvl_bytes, num_rdma_bytes, low_latency_mode=low_latency,
                   num_qps_per_rank=ll.num_qps_per_rank, allow_nvlink_for_low_latency_mode=ll.allow_nvlink,
                   allow_mnnvl=ll.allow_mnnvl, explicitly_destroy=explicitly_destroy, config=settings)

    # ---- lifetime ----------------------------------------------------------------------------
    def destroy(self) -> None:
        """Release the buffers (requires `explicitly_destroy=True`, as in DeepEP)."""
        if not self.explicitly_destroy:
            raise RuntimeError("destroy() needs the buffer to be created with explicitly_destroy=True")
        self._release(collective=True)

    def _release(self, collective: bool) -> None:
        self._unchecked_low_latency = self._unchecked_layout = self._unchecked_normal = None
        if self._backend is not None:
            self._backend.destroy(collective)
            self._backend = None

    def __del__(self) -> None:
        if not getattr(self, "explicitly_destroy", True):
            try:
                self._release(collective=False)
            except Exception:  # noqa: BLE001 - never raise from a destructor
                pass

    def _live_backend(self) -> Backend:
        if self._backend is None:
            raise RuntimeError("this Buffer has been destroyed")
        return self._backend

    # ---- class-wide tuning (DeepEP API) ------------------------------------------------------
    @staticmethod
    def is_sm90_compiled() -> bool:
        """Whether the native kernels are built (ep_plugin builds them for each architecture of
        EP_PLUGIN_CUDA_ARCHS, SM90 by default, with no separate SM90-only feature switch)."""
        try:
            from . import _C  # noqa: F401
        except ImportError:
            return False
        return True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Set the SMs used by normal-mode kernels (even: one sender and one receiver per channel)."""
        if not isinstance(new_num_sms, int) or new_num_sms <= 0 or new_num_sms % 2 != 0:
            raise ValueError(f"the SM count must be a positive even int, got {new_num_sms!r}")
        Buffer.num_sms = new_num_sms
        Buffer._num_sms_set_explicitly = True

    @staticmethod
    def capture() -> EventOverlap:
        """An event recorded on the current stream."""
        return EventOverlap(EventHandle())

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Symmetric-buffer bytes that low-latency mode needs for these sizes."""
        return _ll_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """Recommended dispatch tuning for `num_ranks` (any count) with `Buffer.num_sms` SMs."""
        return default_dispatch_config(Buffer.num_sms, num_ranks)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """Recommended combine tuning for `num_ranks` (any count) with `Buffer.num_sms` SMs."""
        return default_combine_config(Buffer.num_sms, num_ranks)

    @staticmethod
    def _tuned(base: Config, section) -> Config:
        return Config(base.num_sms,
                      section.nvl_chunked_send_tokens or base.num_max_nvl_chunked_send_tokens,
                      section.nvl_chunked_recv_tokens or base.num_max_nvl_chunked_recv_tokens,
                      section.rdma_chunked_send_tokens or base.num_max_rdma_chunked_send_tokens,
                      section.rdma_chunked_recv_tokens or base.num_max_rdma_chunked_recv_tokens)

    @classmethod
    def _dispatch_config_for(cls, settings: EpConfig, num_ranks: int) -> Config:
        num_sms = cls.num_sms if cls._num_sms_set_explicitly else settings.num_sms
        return cls._tuned(default_dispatch_config(num_sms, num_ranks), settings.dispatch)

    @classmethod
    def _combine_config_for(cls, settings: EpConfig, num_ranks: int) -> Config:
        num_sms = cls.num_sms if cls._num_sms_set_explicitly else settings.num_sms
        return cls._tuned(default_combine_config(num_sms, num_ranks), settings.combine)

    def _default_config(self, kind: str) -> Config:
        """A call's config when none is given, built once per SM count (`set_num_sms` may change it)."""
        key = (kind, Buffer.num_sms, Buffer._num_sms_set_explicitly)
        config = self._default_configs.get(key)
        if config is None:
            make = self._dispatch_config_for if kind == "dispatch" else self._combine_config_for
            config = self._default_configs[key] = make(self._settings, self.group_size)
        return config

    def get_comm_stream(self) -> Optional[torch.cuda.Stream]:
        """The stream communication kernels run on (None on CPU)."""
        return self._comm_stream

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size] = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        """This rank's raw buffer as a 1-D `dtype` tensor from byte `offset` (or `size`-shaped: the
        first `size.numel()` elements), as DeepEP gives it.

        The reference backend has no communication buffer: it keeps a private region of
        `num_rdma_bytes` (use_rdma_buffer) or `num_nvl_bytes` on the buffer's device, allocated on first
        use. The native backend's buffers hold its kernels' state at offsets of its own, so it raises.
        """
        backend = self._live_backend()
        if backend.name != "reference":
            raise NotImplementedError("get_local_buffer_tensor is not supported by the native backend: its buffers "
                                      "hold kernel state (headers, rings) at offsets that differ from DeepEP's, and "
                                      "writing them would corrupt a later call")
        if not isinstance(offset, int) or offset < 0:
            raise ValueError(f"offset must be a non-negative int (bytes), got {offset!r}")
        key = "rdma" if use_rdma_buffer else "nvl"
        region = self._local_regions.get(key)
        if region is None:
            nbytes = self.num_rdma_bytes if use_rdma_buffer else self.num_nvl_bytes
            region = self._local_regions[key] = torch.zeros(nbytes, dtype=torch.uint8, device=self._device())
        element = dtype.itemsize
        if offset > region.numel() or offset % element != 0:
            raise ValueError(f"offset = {offset} bytes must be a multiple of {element} within the "
                             f"{region.numel()}-byte buffer")
        usable = (region.numel() - offset) // element * element
        tensor = region[offset:offset + usable].view(dtype)
        if size is None:
            return tensor
        size = torch.Size(size)
        if size.numel() > tensor.numel():
            raise ValueError(f"size {tuple(size)} needs {size.numel()} elements; the buffer holds {tensor.numel()} "
                             f"from offset {offset}")
        return tensor[:size.numel()].view(size)

    # ---- stream and event plumbing -------------------------------------------------------------
    def _run(self, fn: Callable[..., tuple], inputs: List, previous_event: Optional[EventOverlap],
             async_finish: bool, allocate_on_comm_stream: bool, args: tuple = ()) -> Tuple[tuple, EventOverlap]:
        """Run `fn(*args)` on the communication stream with DeepEP's event semantics.

        The communication stream first waits for `previous_event` (or the current stream). Without
        `async_finish` the current stream waits for the result; with it, the returned event marks
        completion and every tensor involved is kept alive until then.
        """
        if self._comm_stream is None:
            return fn(*args), EventOverlap(None)
        device_index = self._info.device.index
        if _current_device() != device_index:
            # A caller whose current device is another GPU: set_stream below would switch its device.
            with torch.cuda.device(device_index):
                return self._run(fn, inputs, previous_event, async_finish, allocate_on_comm_stream, args)
        if not async_finish and previous_event is None and not allocate_on_comm_stream:
            # The current stream would wait for the communication stream right away: running on it
            # orders the same and spares two event waits, two stream switches and a record_stream
            # per output (host time of an eager call).
            return fn(*args), EventOverlap(None)
        # NOTE: streams and events by the buffer's device index, and two reused events: torch's
        # no-argument stream helpers look the current device up each time (a few us per call).
        compute_stream = torch.cuda.current_stream(device_index)
        if previous_event is not None and previous_event.event is not None:
            previous_event.event.stream_wait(self._comm_stream)
        else:
            self._comm_waits_compute.record(compute_stream)
            self._comm_stream.wait_event(self._comm_waits_compute)
        torch.cuda.set_stream(self._comm_stream)
        try:
            outputs = fn(*args)
        finally:
            torch.cuda.set_stream(compute_stream)
        capturing = V.is_capturing()
        output_tensors = V.flatten_tensors(outputs)
        if not allocate_on_comm_stream and not capturing:
            for tensor in output_tensors:
                if tensor.is_cuda:
                    tensor.record_stream(compute_stream)
        if async_finish:
            if not capturing:
                for tensor in V.flatten_tensors(inputs):
                    if tensor.is_cuda:
                        tensor.record_stream(self._comm_stream)
            return outputs, EventOverlap(EventHandle(self._comm_stream), V.flatten_tensors(inputs) + output_tensors)
        self._compute_waits_comm.record(self._comm_stream)
        compute_stream.wait_event(self._compute_waits_comm)
        return outputs, EventOverlap(None)

    def _device(self) -> torch.device:
        return self._info.device

    # ---- normal mode -------------------------------------------------------------------------
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False
                            ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor, EventOverlap]:
        """Count what each rank and expert will receive.

        Arguments:
            topk_idx: `[T, K]` int64, the experts each token selects; `-1` = not routed.
            num_experts: total experts, divisible by the number of ranks (expert `e` lives on rank
                `e // (num_experts // num_ranks)`).

        Returns:
            num_tokens_per_rank: `[R]` int32, tokens sent to each rank (a token counts once per rank).
            num_tokens_per_rdma_rank: `[num_nodes]` int32 tokens per node, or None inside one node.
            num_tokens_per_expert: `[E]` int32, tokens per expert.
            is_token_in_rank: `[T, R]` bool, whether token t goes to rank r.
            event: completion event (meaningful with `async_finish`).
        """
        fast = self._unchecked_layout
        if (fast is not None and previous_event is None and not async_finish and not allocate_on_comm_stream
                and self._plain_call()):
            done = fast.unchecked_dispatch_layout(topk_idx, num_experts)
            if done is not None:
                return (*done, EventOverlap(None))
        return self._checked_dispatch_layout(topk_idx, num_experts, previous_event, async_finish,
                                             allocate_on_comm_stream)

    @_without_device_mode
    def _checked_dispatch_layout(self, topk_idx, num_experts, previous_event, async_finish, allocate_on_comm_stream):
        """get_dispatch_layout with every argument checked in Python (a message naming the one that is wrong)."""
        backend = self._live_backend()
        V.check_num_experts(num_experts, self.group_size)
        V.check_topk("topk_idx", topk_idx, None, self._device())
        self._check_expert_ids(topk_idx, num_experts)
        outputs, event = self._run(lambda: backend.get_dispatch_layout(topk_idx.contiguous(), num_experts),
                                   [topk_idx], previous_event, async_finish, allocate_on_comm_stream)
        return (*outputs, event)

    def dispatch(self, x: XType, handle: Optional[object] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """Send every token to each rank that holds one of its experts (once per rank).

        Arguments:
            x: `[T, H]` bf16, or a tuple `(fp8_e4m3fn [T, H], scales [T, S])` (S = H / 128 for
                128-channel blocks; the scales travel with their token): float32, or int32 words
                (packed UE8M0), in any layout; they arrive row-major in their dtype. Rows must be
                a multiple of 16 bytes.
            handle: a handle from an earlier `dispatch`; reuses its layout (cached dispatch, e.g.
                in the backward pass). Then `topk_idx` and `topk_weights` must be None. It indexes
                like DeepEP's tuple (`ep_plugin.handles`; handle[0] is the `[R, R]` rank prefix matrix).
            num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank, num_tokens_per_expert:
                the outputs of `get_dispatch_layout` (required without `handle`).
            topk_idx: `[T, K]` int64, optional: without it rows go by `is_token_in_rank` alone and
                recv_topk_idx / recv_topk_weights are None.
            topk_weights: `[T, K]` float32, optional (needs `topk_idx`).
            expert_alignment: each entry of `num_recv_tokens_per_expert_list` is rounded up to a
                multiple of this.
            num_worst_tokens: if > 0, outputs have exactly this many rows and the host never waits
                for the received count (CUDA-graph capturable); rows past the received tokens are
                padding, with `-1` in `recv_topk_idx`. Must be >= the tokens this rank receives.
            config: tuning (`Buffer.get_dispatch_config` by default).
            previous_event, async_finish, allocate_on_comm_stream: stream control, as in DeepEP.

        Returns:
            recv_x: received tokens like `x` (tensor or tuple), ordered by source rank, then by
                source token index.
            recv_topk_idx: `[N, K]` int64 ids of this rank's local experts (`e - rank * E_local`),
                `-1` where the expert lives elsewhere or the token was not routed (None if cached or
                no topk_idx was given).
            recv_topk_weights: `[N, K]` float32, 0 where `recv_topk_idx` is -1 (None if cached or
                no weights were given).
            num_recv_tokens_per_expert_list: list of E_local ints, tokens per local expert rounded
                up to `expert_alignment`; empty with `num_worst_tokens > 0`; None if cached.
            handle: the layout, for `combine` and cached dispatch.
            event: completion event (meaningful with `async_finish`).
        """
        fast = self._unchecked_normal
        if (fast is not None and previous_event is None and not async_finish and not allocate_on_comm_stream
                and num_worst_tokens.__class__ is int and num_worst_tokens == 0
                and expert_alignment.__class__ is int and expert_alignment >= 1 and self._plain_call()):
            done = self._unchecked_dispatch(fast, x, handle, num_tokens_per_rank, is_token_in_rank,
                                            num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, config)
            if done is not None:
                return done
        return self._checked_dispatch(x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                                      topk_idx, topk_weights, expert_alignment, num_worst_tokens, config,
                                      previous_event, async_finish, allocate_on_comm_stream)

    @_without_device_mode
    def _unchecked_dispatch(self, fast, x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                            topk_idx, topk_weights, expert_alignment, config):
        """dispatch through the backend's eager fast path (backends/intranode.py), or None where the checked
        path must run (having launched nothing)."""
        if config is None:
            config = self._default_config("dispatch")
        elif config.__class__ is not Config:
            return None
        is_pair = x.__class__ is tuple or x.__class__ is list
        if handle is not None:
            if handle.__class__ is not DispatchHandle or topk_idx is not None or topk_weights is not None:
                return None
            done = fast.unchecked_cached_dispatch(x, handle.inner, config)
            if done is None:
                return None
            return (done if is_pair else done[0]), None, None, None, None, EventOverlap(None)
        if V.is_capturing():  # the checked path says why this needs num_worst_tokens
            return None
        done = fast.unchecked_dispatch(x, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
                                       num_tokens_per_expert, expert_alignment, config)
        if done is None:
            return None
        recv_x, recv_scales, recv_topk_idx, recv_topk_weights, per_expert, inner = done
        new_handle = DispatchHandle(inner, is_token_in_rank, self.rank, self._info.is_intranode, self._gather_counts)
        return ((recv_x, recv_scales) if is_pair else recv_x, recv_topk_idx, recv_topk_weights, per_expert,
                new_handle, EventOverlap(None))

    @_without_device_mode
    def _checked_dispatch(self, x, handle, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
                          topk_weights, expert_alignment, num_worst_tokens, config, previous_event, async_finish,
                          allocate_on_comm_stream):
        """dispatch with every argument checked in Python (a message naming the one that is wrong)."""
        backend = self._live_backend()
        device = self._device()
        data, scales = V.split_x(x, device)
        is_tuple = isinstance(x, (tuple, list))
        # No config given: the recommended one with the YAML config's `dispatch:` tuning (as sized).
        config = self._default_config("dispatch") if config is None else config
        self._check_config(config)
        if not isinstance(expert_alignment, int) or expert_alignment < 1:
            raise ValueError(f"expert_alignment must be a positive int, got {expert_alignment!r}")
        if not isinstance(num_worst_tokens, int) or num_worst_tokens < 0:
            raise ValueError(f"num_worst_tokens must be a non-negative int, got {num_worst_tokens!r}")
        if handle is not None:
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("cached dispatch (handle given) takes no topk_idx / topk_weights")
            inner = self._check_handle(handle, DispatchHandle)
            if data.size(0) != backend.handle_num_tokens(inner):
                raise ValueError(f"x has {data.size(0)} tokens but the handle was made for "
                                 f"{backend.handle_num_tokens(inner)}")
            outputs, event = self._run(lambda: backend.cached_dispatch(data, scales, inner, config),
                                       [data, scales], previous_event, async_finish, allocate_on_comm_stream)
            recv_x, recv_scales = outputs
            return (recv_x, recv_scales) if is_tuple else recv_x, None, None, None, None, event

        num_tokens = data.size(0)
        R = self.group_size
        if num_tokens_per_rank is None or is_token_in_rank is None or num_tokens_per_expert is None:
            raise ValueError("dispatch without a handle needs num_tokens_per_rank, is_token_in_rank and "
                             "num_tokens_per_expert (from get_dispatch_layout)")
        if topk_idx is not None:
            V.check_topk("topk_idx", topk_idx, num_tokens, device)
        if topk_weights is not None:
            if topk_idx is None:
                raise ValueError("topk_weights needs topk_idx (the weights travel with the ids)")
            V.check_tensor("topk_weights", topk_weights, (torch.float32,), 2, device, tuple(topk_idx.shape))
        V.check_tensor("num_tokens_per_rank", num_tokens_per_rank, (torch.int32,), 1, device, (R,))
        V.check_tensor("is_token_in_rank", is_token_in_rank, (torch.bool,), 2, device, (num_tokens, R))
        V.check_tensor("num_tokens_per_expert", num_tokens_per_expert, (torch.int32,), 1, device)
        num_experts = num_tokens_per_expert.size(0)
        V.check_num_experts(num_experts, R)
        if topk_idx is not None:
            self._check_expert_ids(topk_idx, num_experts)
        if num_worst_tokens == 0 and V.is_capturing():
            raise RuntimeError("dispatch under CUDA-graph capture needs num_worst_tokens > 0 "
                               "(otherwise the host must wait for the received-token count)")
        inputs = [data, scales, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert]
        outputs, event = self._run(
            lambda: backend.dispatch(data, scales, None if topk_idx is None else topk_idx.contiguous(),
                                     None if topk_weights is None else topk_weights.contiguous(),
                                     num_tokens_per_rank, is_token_in_rank.contiguous(),
                                     num_tokens_per_expert.contiguous(), expert_alignment, num_worst_tokens, config),
            inputs, previous_event, async_finish, allocate_on_comm_stream)
        recv_x, recv_scales, recv_topk_idx, recv_topk_weights, per_expert, inner = outputs
        new_handle = DispatchHandle(inner, is_token_in_rank, self.rank, self._info.is_intranode, self._gather_counts)
        return ((recv_x, recv_scales) if is_tuple else recv_x, recv_topk_idx, recv_topk_weights, per_expert,
                new_handle, event)

    def _gather_counts(self, row: torch.Tensor) -> torch.Tensor:
        """Every rank's send counts (a collective over the group; see `handles.DispatchHandle`)."""
        return all_gather_rows(self.group, row)

    def combine(self, x: torch.Tensor, handle: object, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[None, torch.Tensor, Tuple[torch.Tensor, torch.Tensor]] = None,
                config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor], EventOverlap]:
        """Send every received row back to its source and sum the copies of each token.

        Arguments:
            x: `[N, H]` bf16, one row per row that `dispatch` returned (N includes padding rows
                when `num_worst_tokens` was used; padding rows are ignored).
            handle: from `dispatch`.
            topk_weights: `[N, K]` float32, optional; summed the same way.
            bias: None, or one or two `[T, H]` bf16 tensors added to the result.
            config: tuning (`Buffer.get_combine_config` by default).

        Returns:
            combined_x: `[T, H]` bf16, for each token the fp32 sum over the ranks it was sent to
                (no weighting), plus the biases; zeros (plus bias) for tokens sent nowhere.
            combined_topk_weights: `[T, K]` float32 summed the same way, or None.
            event: completion event (meaningful with `async_finish`).
        """
        fast = self._unchecked_normal
        if (fast is not None and bias is None and previous_event is None and not async_finish
                and not allocate_on_comm_stream and handle.__class__ is DispatchHandle and self._plain_call()):
            done = self._unchecked_combine(fast, x, handle, topk_weights, config)
            if done is not None:
                return done
        return self._checked_combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                                     allocate_on_comm_stream)

    @_without_device_mode
    def _unchecked_combine(self, fast, x, handle, topk_weights, config):
        """combine through the backend's eager fast path, or None where the checked path must run (having
        launched nothing)."""
        config = self._default_config("combine") if config is None else config
        if config.__class__ is not Config:
            return None
        done = fast.unchecked_combine(x, handle.inner, topk_weights, config)
        return None if done is None else (done[0], done[1], EventOverlap(None))

    @_without_device_mode
    def _checked_combine(self, x, handle, topk_weights, bias, config, previous_event, async_finish,
                         allocate_on_comm_stream):
        """combine with every argument checked in Python (a message naming the one that is wrong)."""
        backend = self._live_backend()
        device = self._device()
        handle = self._check_handle(handle, DispatchHandle)
        num_rows = backend.handle_num_recv_rows(handle)
        V.check_tensor("x", x, (torch.bfloat16,), 2, device, (num_rows, None))
        V.check_row_bytes("x", x)
        if topk_weights is not None:
            V.check_tensor("topk_weights", topk_weights, (torch.float32,), 2, device, (num_rows, None))
            if not 1 <= topk_weights.size(1) <= V.MAX_TOPK:
                raise ValueError(f"topk_weights: top-k must be in [1, {V.MAX_TOPK}], got {topk_weights.size(1)}")
        num_tokens = backend.handle_num_tokens(handle)
        bias_0, bias_1 = V.unpack_bias(bias, num_tokens, x.size(1), device)
        config = self._default_config("combine") if config is None else config
        self._check_config(config)
        x = x.contiguous()
        topk_weights = None if topk_weights is None else topk_weights.contiguous()
        outputs, event = self._run(lambda: backend.combine(x, handle, topk_weights, bias_0, bias_1, config),
                                   [x, topk_weights, bias_0, bias_1], previous_event, async_finish,
                                   allocate_on_comm_stream)
        combined_x, combined_weights = outputs
        return combined_x, combined_weights, event

    def internode_dispatch(self, x: XType, handle: Optional[object] = None,
                           num_tokens_per_rank: Optional[torch.Tensor] = None,
                           num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                           is_token_in_rank: Optional[torch.Tensor] = None,
                           num_tokens_per_expert: Optional[torch.Tensor] = None,
                           topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                           expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                           previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                           allocate_on_comm_stream: bool = False):
        """`dispatch` across nodes (DeepEP's entry point; `dispatch` picks it by itself). `config` is required."""
        self._require_internode("internode_dispatch", config)
        return self.dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                             num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
                             config, previous_event, async_finish, allocate_on_comm_stream)

    def internode_combine(self, x: torch.Tensor, handle: Union[tuple, list, object],
                          topk_weights: Optional[torch.Tensor] = None,
                          bias: Union[None, torch.Tensor, Tuple[torch.Tensor, torch.Tensor]] = None,
                          config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                          async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """`combine` across nodes (DeepEP's entry point; `combine` picks it by itself). `config` is required."""
        self._require_internode("internode_combine", config)
        return self.combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                            allocate_on_comm_stream)

    def _require_internode(self, name: str, config: Optional[Config]) -> None:
        if config is None:
            raise ValueError(f"{name} needs config (dispatch / combine choose a default one)")
        if self._info.is_intranode:
            raise RuntimeError(f"{name} needs ranks on more than one node; this group is one node: call "
                               f"{name.split('_')[1]}")

    def _check_expert_ids(self, topk_idx: torch.Tensor, num_experts: int) -> None:
        """With `check_inputs`: every id is -1 or an expert (a host sync). A dispatch given the tensor
        that its layout call just checked, unmodified since (same version counter), skips the second."""
        if not self._settings.check_inputs:
            return
        facts = (topk_idx.data_ptr(), topk_idx._version, tuple(topk_idx.shape), num_experts)
        last = self._last_checked_ids
        if last is not None and last[0]() is topk_idx and last[1] == facts:
            return
        V.check_expert_ids("topk_idx", topk_idx, num_experts)
        self._last_checked_ids = (weakref.ref(topk_idx), facts)

    def _check_handle(self, handle: object, kind: type) -> object:
        """The backend's own handle inside `handle`, which must come from this Buffer's dispatch of the
        mode of `kind` (DispatchHandle: `dispatch`; LowLatencyHandle: `low_latency_dispatch`)."""
        inner = unwrap(handle)
        if getattr(inner, "owner", None) is not self._backend:
            raise ValueError("handle does not come from this Buffer's dispatch "
                             f"(got {type(handle).__name__})")
        if isinstance(handle, (DispatchHandle, LowLatencyHandle)) and not isinstance(handle, kind):
            source = "low_latency_dispatch" if kind is LowLatencyHandle else "(normal-mode) dispatch"
            raise ValueError(f"expected a handle from {source}, got {type(handle).__name__}")
        return inner

    def _check_config(self, config: Config) -> None:
        if not isinstance(config, Config):
            raise TypeError(f"config must be an ep_plugin.Config, got {type(config).__name__}")

    # ---- low-latency mode --------------------------------------------------------------------
    def _require_low_latency(self) -> None:
        if not self.low_latency_mode:
            raise RuntimeError("low-latency kernels need a Buffer created with low_latency_mode=True")

    def _low_latency_backend(self) -> Backend:
        """`_require_low_latency`, then `_live_backend`, with one test where both pass (every low-latency call)."""
        if self.low_latency_mode and self._backend is not None:
            return self._backend
        self._require_low_latency()
        return self._live_backend()

    def _check_low_latency_size(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        sizes = (num_max_dispatch_tokens_per_rank, hidden, num_experts)
        if sizes in self._low_latency_sizes_checked:  # once per sizes: the buffer does not change
            return
        needed = _ll_size_hint(num_max_dispatch_tokens_per_rank, hidden, self.group_size, num_experts)
        if self._backend.name == "native" and self.num_rdma_bytes < needed:
            raise ValueError(f"num_rdma_bytes = {self.num_rdma_bytes} is too small for T_max="
                             f"{num_max_dispatch_tokens_per_rank}, hidden={hidden}, num_experts={num_experts}: "
                             f"need {needed} (Buffer.get_low_latency_rdma_size_hint)")
        self._low_latency_sizes_checked.add(sizes)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Reset low-latency state (needed after normal-mode kernels used the same buffer)."""
        self._require_low_latency()
        self._live_backend().clean_low_latency_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)

    def _plain_call(self) -> bool:
        """Whether a call may take the backend's fast path: the current GPU is the buffer's and
        no torch-function mode but a default-device one is active (the fast paths make few torch calls
        from Python; the normal mode's run with the mode off, `_without_device_mode`)."""
        return _current_device() == self._info.device.index and (not _function_mode_enabled() or _only_device_modes())

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None,
                             use_fp8: bool = True, round_scale: bool = False, use_ue8m0: bool = False,
                             async_finish: bool = False, return_recv_hook: bool = False,
                             topk_weights: Optional[torch.Tensor] = None):
        """Send each (token, selected expert) pair into that expert's slot on its rank.

        Arguments:
            x: `[T, H]` bf16, T <= `num_max_dispatch_tokens_per_rank`, rows a multiple of 16 bytes.
            topk_idx: `[T, K]` int64 expert ids, `-1` = not routed. Without `check_inputs` an id outside
                [-1, num_experts) counts as -1; the native backend then raises a ValueError naming it at
                this rank's next low_latency_dispatch, which launches nothing (docs/faults.md).
            num_max_dispatch_tokens_per_rank: T_max, identical on all ranks.
            num_experts: total experts, divisible by the number of ranks.
            cumulative_local_expert_recv_stats: `[E_local]` int32, incremented by the tokens each
                local expert receives.
            dispatch_wait_recv_cost_stats: not supported (DeepEP's per-peer wait-time statistics);
                must be None.
            use_fp8: cast to FP8 e4m3 in flight with one scale per 128-channel block (the last
                block may be partial). round_scale: round scales up to powers of two.
                use_ue8m0: pack the (power-of-two) scales as UE8M0 bytes, four per int32.
            async_finish, return_recv_hook: with the hook, the call only sends; calling
                `hook()` completes the receive. Not both (as in DeepEP): the receive must be
                ordered after the send on the stream that calls the hook.
            topk_weights: optional `[T, K]` float32, the weights the matching `low_latency_combine`
                will be given (an ep_plugin extension; DeepEP's dispatch has no such argument). The
                native backend then sends them with the tokens and sums each token's rows on the
                expert side: the combine moves one partial per (token, rank) instead of one bf16 row
                per (token, expert). The partial crosses to the token's rank as bf16 (a quarter of the
                bytes at top-8 on 2 ranks; rounded once before the final fp32 sum, as DeepEP's internode
                combine rounds its per-node sums) or, with `low_latency.expert_sums_partials: fp32`, as
                fp32 (half the bytes; only the summation order differs). It does so when every
                peer is reachable by NVLink (at most 16 ranks); otherwise it sums on the token side as
                usual. Either every rank passes topk_weights or none (a device error says so
                otherwise), and the combine must get these same topk_idx and topk_weights tensors,
                unmodified (so no entry can be masked with -1 after such a dispatch).

        Returns:
            recv_x: bf16 `[E_local, R * T_max, H]`, or with FP8 a tuple of the fp8 tensor and its
                scales: float32 `[E_local, R * T_max, ceil(H / 128)]`, or with UE8M0 int32
                `[E_local, R * T_max, ceil(ceil(H / 128) / 4)]`; the scales' last two dimensions
                are column-major (as DeepEP lays them out for TMA). Slots of expert e hold its
                tokens ordered by source rank, then source token index.
            recv_count: `[E_local]` int32 valid slots per local expert.
            handle: for `low_latency_combine`.
            event: completion event (with `async_finish`).
            hook: a callable that completes the receive (with `return_recv_hook`), else None.
        """
        fast = self._unchecked_low_latency
        if (fast is not None and topk_weights is None and dispatch_wait_recv_cost_stats is None and not async_finish
                and not return_recv_hook and self._plain_call()):
            done = fast.unchecked_low_latency_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                                       cumulative_local_expert_recv_stats, use_fp8, round_scale,
                                                       use_ue8m0)
            if done is not None:
                recv_x, recv_count, inner = done
                return recv_x, recv_count, LowLatencyHandle(inner), EventOverlap(None), None
        return self._checked_low_latency_dispatch(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                                  cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats,
                                                  use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook,
                                                  topk_weights)

    @_without_device_mode
    def _checked_low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                      cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8,
                                      round_scale, use_ue8m0, async_finish, return_recv_hook, topk_weights):
        """low_latency_dispatch with every argument checked in Python (a message naming the one that is wrong)."""
        backend = self._low_latency_backend()
        device = self._info.device
        if dispatch_wait_recv_cost_stats is not None:
            raise NotImplementedError("dispatch_wait_recv_cost_stats is not supported by ep_plugin; pass None")
        V.check_tensor("x", x, (torch.bfloat16,), 2, device)
        V.check_row_bytes("x", x)
        num_tokens, hidden = x.shape
        V.check_topk("topk_idx", topk_idx, num_tokens, device)
        V.check_num_experts(num_experts, self.group_size)
        if not isinstance(num_max_dispatch_tokens_per_rank, int) or num_max_dispatch_tokens_per_rank <= 0:
            raise ValueError(f"num_max_dispatch_tokens_per_rank must be a positive int, got "
                             f"{num_max_dispatch_tokens_per_rank!r}")
        if num_tokens > num_max_dispatch_tokens_per_rank:
            raise ValueError(f"x has {num_tokens} tokens, more than num_max_dispatch_tokens_per_rank = "
                             f"{num_max_dispatch_tokens_per_rank}")
        if use_ue8m0 and not round_scale:
            raise ValueError("use_ue8m0=True needs round_scale=True (UE8M0 scales are powers of two)")
        if use_ue8m0 and not use_fp8:
            raise ValueError("use_ue8m0=True needs use_fp8=True")
        V.check_hook_without_async(async_finish, return_recv_hook)
        if cumulative_local_expert_recv_stats is not None:
            V.check_tensor("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats,
                           (torch.int32,), 1, device, (num_experts // self.group_size,))
            if not cumulative_local_expert_recv_stats.is_contiguous():
                raise ValueError("cumulative_local_expert_recv_stats must be contiguous (it is updated in place)")
        if topk_weights is not None:
            V.check_tensor("topk_weights", topk_weights, (torch.float32,), 2, device, topk_idx.shape)
            if not topk_weights.is_contiguous():
                raise ValueError("low_latency_dispatch: topk_weights must be contiguous (the combine must get the "
                                 "same tensor)")
        self._check_low_latency_size(num_max_dispatch_tokens_per_rank, hidden, num_experts)
        if self._settings.check_inputs:
            V.check_expert_ids("topk_idx", topk_idx, num_experts)
        route_idx = topk_idx  # the caller's tensor: the combine must get this one when topk_weights are given
        x, topk_idx = x.contiguous(), topk_idx.contiguous()
        outputs, event = self._run(
            backend.low_latency_dispatch, [x, topk_idx, cumulative_local_expert_recv_stats, topk_weights], None,
            async_finish, False, (x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                  cumulative_local_expert_recv_stats, use_fp8, round_scale, use_ue8m0,
                                  return_recv_hook, topk_weights))
        recv_x, recv_count, inner, hook = outputs
        if topk_weights is not None:
            inner.dispatch_route = DispatchRoute.of(route_idx, topk_weights)
        return recv_x, recv_count, LowLatencyHandle(inner), event, hook

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: object, use_logfmt: bool = False, zero_copy: bool = False,
                            async_finish: bool = False, return_recv_hook: bool = False,
                            out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None):
        """Return expert outputs to their tokens and reduce them with the top-k weights.

        Arguments:
            x: `[E_local, R * T_max, H]` bf16 expert outputs, in the slots `low_latency_dispatch`
                filled. With `zero_copy` the caller has already written them into the tensor of
                `get_next_low_latency_combine_buffer(handle)`, and x's data is not read (only its shape).
            topk_idx: `[T, K]` int64, the ids given to the matching dispatch.
            topk_weights: `[T, K]` float32 weights.
            handle: from `low_latency_dispatch`.
            use_logfmt: not supported (must be False).
            out: optional `[T, H]` bf16 output written in place.

        Returns:
            combined_x: `[T, H]` bf16, `sum_k topk_weights[t, k] * expert_k(x_t)` in fp32.
            event: completion event (with `async_finish`).
            hook: a callable completing the receive (with `return_recv_hook`), else None.
        """
        fast = self._unchecked_low_latency
        if (fast is not None and handle.__class__ is LowLatencyHandle and not use_logfmt and not async_finish
                and not return_recv_hook and combine_wait_recv_cost_stats is None and self._plain_call()):
            combined = fast.unchecked_low_latency_combine(x, topk_idx, topk_weights, handle.inner, zero_copy, out)
            if combined is not None:
                return combined, EventOverlap(None), None
        return self._checked_low_latency_combine(x, topk_idx, topk_weights, handle, use_logfmt, zero_copy,
                                                 async_finish, return_recv_hook, out, combine_wait_recv_cost_stats)

    @_without_device_mode
    def _checked_low_latency_combine(self, x, topk_idx, topk_weights, handle, use_logfmt, zero_copy, async_finish,
                                     return_recv_hook, out, combine_wait_recv_cost_stats):
        """low_latency_combine with every argument checked in Python (a message naming the one that is wrong)."""
        backend = self._low_latency_backend()
        device = self._info.device
        if use_logfmt:
            raise NotImplementedError("use_logfmt=True (DeepEP's LogFMT combine) is not supported by ep_plugin")
        if combine_wait_recv_cost_stats is not None:
            raise NotImplementedError("combine_wait_recv_cost_stats is not supported by ep_plugin; pass None")
        V.check_hook_without_async(async_finish, return_recv_hook)
        handle = self._check_handle(handle, LowLatencyHandle)
        V.check_tensor("x", x, (torch.bfloat16,), 3, device, handle.recv_shape)
        V.check_topk("topk_idx", topk_idx, handle.num_tokens, device)
        V.check_tensor("topk_weights", topk_weights, (torch.float32,), 2, device, topk_idx.shape)
        if handle.dispatch_route is not None:
            V.check_dispatch_route(handle.dispatch_route, topk_idx, topk_weights)
        if out is not None:
            V.check_tensor("out", out, (torch.bfloat16,), 2, device, (handle.num_tokens, x.shape[2]))
            if not out.is_contiguous():
                raise ValueError("out must be contiguous")
        x, topk_idx, topk_weights = x.contiguous(), topk_idx.contiguous(), topk_weights.contiguous()
        outputs, event = self._run(backend.low_latency_combine, [x, topk_idx, topk_weights, out], None, async_finish,
                                   False, (x, topk_idx, topk_weights, handle, zero_copy, return_recv_hook, out))
        combined_x, hook = outputs
        return combined_x, event, hook

    # ---- rank masking (DeepEP's shrink mode) ------------------------------------------------------
    def _mask(self) -> Union[masking.RankMask, masking.DeviceRankMask]:
        """The rank mask (ep_plugin/masking.py); a Buffer without enable_shrink has none, as in DeepEP."""
        if self._rank_mask is None:
            raise RuntimeError("the mask buffer needs a Buffer created with enable_shrink=True")
        self._require_low_latency()
        return self._rank_mask

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask (`mask=True`) or unmask `rank_to_mask`: later low-latency calls of this rank neither send
        to nor receive from it; its experts' outputs count as zero in the combine."""
        if not isinstance(rank_to_mask, int) or not 0 <= rank_to_mask < self.group_size:
            raise ValueError(f"rank_to_mask must be a rank in [0, {self.group_size}), got {rank_to_mask!r}")
        self._mask().update(rank_to_mask, bool(mask))

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Write each rank's mask status into `mask_status` (`[R]` int32: 1 masked, 0 not)."""
        V.check_tensor("mask_status", mask_status, (torch.int32,), 1, self._device(), (self.group_size,))
        self._mask().query(mask_status)

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank."""
        self._mask().clean()

    @_without_device_mode
    def get_next_low_latency_combine_buffer(self, handle: object) -> torch.Tensor:
        """The `[E_local, R * T_max, H]` bf16 tensor to fill before `low_latency_combine(zero_copy=True)`."""
        self._require_low_latency()
        return self._live_backend().get_next_low_latency_combine_buffer(self._check_handle(handle, LowLatencyHandle))
