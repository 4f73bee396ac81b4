"""Low-latency mode: the NVSHMEM kernels of `ep_plugin._C_nvshmem` (any NVSHMEM transport), their
rounds (parities), receive hooks and the zero-copy combine buffer."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import fp8, masking
from .base import DispatchRoute, GroupInfo
from .native_common import (NVSHMEM_IMPORT_ERROR, NativeBase, _C_nvshmem, _C_torch, address_of, logger,
                            raise_failure)

if TYPE_CHECKING:
    from .native import NativeBackend

# Whether the native low-latency kernels pass tests/test_native_low_latency.py on GPUs (2x H200: all
# of them). While False, `backend: auto` keeps the reference backend for
# low-latency mode and only `backend: native` selects them.
LOW_LATENCY_VERIFIED = True

_SEND_RECV = 0 if _C_nvshmem is None else _C_nvshmem.PHASE_SEND | _C_nvshmem.PHASE_RECV


def low_latency_unsupported_reason(info: GroupInfo, requested: str) -> str:
    if _C_nvshmem is None:
        return f"the NVSHMEM extension ep_plugin._C_nvshmem is not built ({NVSHMEM_IMPORT_ERROR})"
    if info.device.type != "cuda":
        return "no CUDA device in this process"
    if info.num_ranks > _C_nvshmem.MAX_RANKS:
        return f"{info.num_ranks} ranks; the low-latency kernels take at most {_C_nvshmem.MAX_RANKS}"
    if not LOW_LATENCY_VERIFIED and requested != "native":
        return ("native low-latency kernels are built but not yet verified on GPU "
                "(select them with backend: native)")
    return ""


class LowLatencyPlan:
    """What every low-latency dispatch (and its combine) of the same sizes and options shares, checked and
    built once per buffer: output shapes, the expert-sum choice and the Args templates of calls without
    a receive hook (their launches happen inside the call, and the runtime copies the Args it is given,
    so each such call rewrites the per-call fields of the same template)."""

    def __init__(self, backend: "LowLatencyMode", num_max_dispatch_tokens_per_rank: int, hidden: int,
                 num_experts: int, num_topk: int, use_fp8: bool, round_scale: bool, use_ue8m0: bool,
                 with_weights: bool) -> None:
        backend._check_low_latency_shapes(num_max_dispatch_tokens_per_rank, hidden, num_experts, num_topk)
        R = backend.info.num_ranks
        self.num_max_dispatch_tokens_per_rank, self.hidden, self.num_experts, self.num_topk = \
            num_max_dispatch_tokens_per_rank, hidden, num_experts, num_topk
        self.use_fp8, self.round_scale, self.use_ue8m0 = use_fp8, round_scale, use_ue8m0
        num_local, num_slots = num_experts // R, R * num_max_dispatch_tokens_per_rank
        self.recv_shape = (num_local, num_slots, hidden)
        self.recv_dtype = fp8.FP8_DTYPE if use_fp8 else torch.bfloat16
        # [E_local, slots, S], column-major in the last two dimensions (as [E_local, S, slots] transposed).
        width = fp8.num_ue8m0_words(hidden) if use_ue8m0 else fp8.num_blocks(hidden)
        self.scales_shape = (num_local, num_slots, width)
        self.scales_strides = (width * num_slots, 1, num_slots)
        self.scales_dtype = torch.int32 if use_ue8m0 else torch.float32
        self.layout_shape, self.src_info_shape = (num_local, R), (num_local, num_slots)
        # A dispatch's outputs: the rows with their scales (FP8) in one allocation, the count, src_info and
        # layout per expert in another (the handle keeps the last two; the count is tiny).
        rows_spec = (self.recv_shape, None, self.recv_dtype)
        scales_spec = (self.scales_shape, self.scales_strides, self.scales_dtype)
        count_spec = ((num_local,), None, torch.int32)
        src_info_spec, layout_spec = (self.src_info_shape, None, torch.int32), (self.layout_shape, None, torch.int64)
        self.dispatch_outputs = backend._output_group(
            (rows_spec, scales_spec) if use_fp8 else (rows_spec,), (count_spec, src_info_spec, layout_spec))
        combined_spec = ((-1, hidden), None, torch.bfloat16)
        self.combine_output = backend._output_group((combined_spec,))
        # Expert-side sums where the weights come with the dispatch and every peer is on NVLink (the
        # same answer on every rank of one NVLink domain; a rank that disagrees gets a device error).
        self.expert_sums = with_weights and backend._low_latency().supports_expert_sums(
            num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank, hidden=hidden, num_experts=num_experts)
        # Fixed here, so that the dispatch announces it (ranks must agree) and its combine follows it.
        self.bf16_partials = self.expert_sums and backend.settings.low_latency.expert_sums_partials == "bf16"
        self.rank_mask = backend._rank_mask_address()
        self.dispatch_args = self.new_dispatch_args()
        self.combine_args = self.new_combine_args()
        # The eager fast path's calls (LowLatencyMode.unchecked_low_latency_dispatch); None where this plan's
        # calls always take the checked path (weights at dispatch: the combine checks their route).
        self.unchecked = None if with_weights else backend._unchecked_calls(self)

    def dispatch_results(self, outputs):
        """(recv_x, recv_count, recv_src_info, recv_layout) of a dispatch's outputs (dispatch_outputs' order);
        recv_x is (data, scales) with FP8."""
        if self.use_fp8:
            data, scales, recv_count, recv_src_info, recv_layout = outputs
            return (data, scales), recv_count, recv_src_info, recv_layout
        return tuple(outputs)

    def new_dispatch_args(self):
        """DispatchArgs with this plan's fields set; the per-call ones are the caller's to write."""
        args = _C_nvshmem.DispatchArgs()
        args.num_max_dispatch_tokens_per_rank, args.hidden, args.num_experts, args.num_topk = \
            self.num_max_dispatch_tokens_per_rank, self.hidden, self.num_experts, self.num_topk
        args.use_fp8, args.round_scale, args.use_ue8m0 = self.use_fp8, self.round_scale, self.use_ue8m0
        args.carry_route, args.bf16_partials, args.topk_weights = self.expert_sums, self.bf16_partials, 0
        args.rank_mask = self.rank_mask
        return args

    def new_combine_args(self):
        """CombineArgs with this plan's fields set; the per-call ones are the caller's to write."""
        args = _C_nvshmem.CombineArgs()
        args.num_max_dispatch_tokens_per_rank, args.hidden, args.num_experts, args.num_topk = \
            self.num_max_dispatch_tokens_per_rank, self.hidden, self.num_experts, self.num_topk
        args.expert_sums, args.bf16_partials, args.rank_mask = self.expert_sums, self.bf16_partials, self.rank_mask
        return args


@dataclass(eq=False)
class LowLatencyHandle:
    """Layout of one low-latency dispatch (opaque to users), for `low_latency_combine`."""
    owner: "NativeBackend"
    num_tokens: int                      # T of the dispatch
    parity: int                          # the round (0 or 1) of symmetric buffer it used
    recv_src_info: torch.Tensor          # [E_local, R * T_max] int32: src_rank << 21 | (t * 32 + k)
    recv_layout: torch.Tensor            # [E_local, R] int64: first slot << 32 | count, per source rank
    plan: LowLatencyPlan
    combine_buffer: Optional[torch.Tensor] = field(default=None)
    dispatch_route: Optional[DispatchRoute] = field(default=None)  # set by the Buffer

    @property
    def recv_shape(self) -> Tuple[int, int, int]:
        """(E_local, R * T_max, H)."""
        return self.plan.recv_shape

    @property
    def hidden(self) -> int:
        return self.plan.hidden

    @property
    def num_max_dispatch_tokens_per_rank(self) -> int:
        return self.plan.num_max_dispatch_tokens_per_rank

    @property
    def num_experts(self) -> int:
        return self.plan.num_experts

    @property
    def num_topk(self) -> int:
        return self.plan.num_topk

    @property
    def expert_sums(self) -> bool:
        """The payloads carried routes: the combine sums on the expert side."""
        return self.plan.expert_sums

    @property
    def bf16_partials(self) -> bool:
        """... and sends its partials to peers as bf16 (else fp32)."""
        return self.plan.bf16_partials


class _SymmetricArray:
    """A device array in NVSHMEM memory, shown to torch through the CUDA array interface (zero-copy)."""

    def __init__(self, address: int, shape: Tuple[int, ...], typestr: str) -> None:
        self.__cuda_array_interface__ = {"data": (address, False), "shape": shape, "typestr": typestr,
                                         "strides": None, "version": 3, "stream": None}


class LowLatencyMode(NativeBase):
    """NativeBackend's low-latency mode."""

    _device_rank_mask: Optional[masking.DeviceRankMask] = None
    # LowLatencyPlan per (T_max, hidden, num_experts, top-k, use_fp8, round_scale, use_ue8m0, with weights).
    _ll_plans: Dict[tuple, LowLatencyPlan]
    # The plan of the last checked dispatch per (T_max, num_experts, use_fp8, round_scale, use_ue8m0), where
    # it has unchecked calls: the fast path's (its hidden and top-k are the C++ side's to compare).
    _ll_unchecked_plans: Dict[tuple, LowLatencyPlan]

    @property
    def device_rank_mask(self) -> Optional[masking.DeviceRankMask]:
        """Set by a Buffer with enable_shrink (ep_plugin/masking.py): the kernels skip the ranks it masks."""
        return self._device_rank_mask

    @device_rank_mask.setter
    def device_rank_mask(self, mask: Optional[masking.DeviceRankMask]) -> None:
        self._device_rank_mask = mask
        self._ll_plans.clear()  # their Args hold the mask's address
        self._ll_unchecked_plans.clear()

    def _rank_mask_address(self) -> int:
        """Device address of the shrink-mode mask for the kernels' Args (0: no mask)."""
        mask = self.device_rank_mask
        return 0 if mask is None else address_of(mask.flags)

    def _start_low_latency(self, num_rdma_bytes: int):
        """NVSHMEM over the process group (unique id from rank 0, every rank a PE) and the symmetric buffer."""
        if num_rdma_bytes <= _C_nvshmem.HEADER_BYTES:
            raise ValueError(f"num_rdma_bytes = {num_rdma_bytes} is too small for native low-latency mode; size it "
                             "with Buffer.get_low_latency_rdma_size_hint")
        unique_id = self._prepare_nvshmem(num_rdma_bytes)
        runtime = _C_nvshmem.LowLatencyRuntime(self.info.rank, self.info.num_ranks, num_rdma_bytes,
                                               self.settings.timeout_s, unique_id)
        direct = runtime.direct_peers()
        logger.info("ep_plugin rank %d: low-latency symmetric buffer of %d bytes; peers over NVLink: %s, over the "
                    "network: %s", self.info.rank, num_rdma_bytes, [r for r, d in enumerate(direct) if d],
                    [r for r, d in enumerate(direct) if not d])
        # NOTE: a fused send + receive launch finishes only once every block of every rank's launch has
        # been resident at the same time (each block's receive waits for blocks of all ranks), and it
        # launches one block per SM the process sees. Ranks that share a GPU (CUDA MPS) have no such
        # guarantee: MPS limits each client's SMs but reserves none. A send launch never waits, so two
        # launches (send, then receive) need no co-residency; that costs one launch per call.
        sharing = _ranks_on_this_gpu(self.info)
        self._ll_split = sharing > 1
        if self._ll_split:
            logger.info("ep_plugin rank %d: %d ranks share this GPU; low-latency send and receive run as separate "
                        "launches", self.info.rank, sharing)
        return runtime

    def _low_latency(self):
        if self._ll is None:
            raise RuntimeError("this native buffer was not created with low_latency_mode=True")
        return self._ll

    def _check_low_latency_shapes(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int,
                                  num_topk: int) -> None:
        """What Buffer does not check but these kernels need; raised before anything runs."""
        if num_max_dispatch_tokens_per_rank > _C_nvshmem.MAX_TOKENS:
            raise ValueError(f"num_max_dispatch_tokens_per_rank = {num_max_dispatch_tokens_per_rank} exceeds the "
                             f"native low-latency limit of {_C_nvshmem.MAX_TOKENS}")
        if num_experts > _C_nvshmem.MAX_EXPERTS:
            raise ValueError(f"num_experts = {num_experts} exceeds the native low-latency limit of "
                             f"{_C_nvshmem.MAX_EXPERTS}")
        if num_topk > _C_nvshmem.MAX_TOPK:
            raise ValueError(f"topk_idx: top-k = {num_topk} exceeds the native low-latency limit of "
                             f"{_C_nvshmem.MAX_TOPK}")
        needed = _C_nvshmem.size_hint(num_max_dispatch_tokens_per_rank, hidden, self.info.num_ranks, num_experts)
        if needed > self.num_rdma_bytes:
            raise ValueError(f"num_rdma_bytes = {self.num_rdma_bytes} is too small for T_max="
                             f"{num_max_dispatch_tokens_per_rank}, hidden={hidden}, num_experts={num_experts}: "
                             f"need {needed} (Buffer.get_low_latency_rdma_size_hint)")

    def _ll_plan(self, key: tuple) -> LowLatencyPlan:
        plan = self._ll_plans.get(key)
        if plan is None:  # checks the sizes: raises before anything runs
            plan = self._ll_plans[key] = LowLatencyPlan(self, *key)
        return plan

    def _unchecked_calls(self, plan: LowLatencyPlan):
        """`plan`'s calls for the eager fast path (_C_torch.LowLatencyCalls), or None where send and receive
        launch separately (ranks sharing a GPU)."""
        if self._ll_split:
            return None
        calls = _C_torch.low_latency_calls(
            plan.dispatch_outputs.group, plan.combine_output.group, _C_nvshmem.low_latency_launchers, self._ll,
            plan.dispatch_args, plan.combine_args, self.info.device, plan.num_max_dispatch_tokens_per_rank,
            plan.hidden, plan.num_topk, plan.recv_shape[0], self.info.num_ranks, plan.use_fp8)
        if calls.__class__ is tuple:
            raise_failure(calls)
        return calls

    # ---- the eager fast path ------------------------------------------------------------------------
    # Buffer's low-latency calls without a hook, async_finish or weights at dispatch, on the current
    # stream, first try these: the plan of an earlier checked dispatch of the same sizes, its checks in
    # C++ as booleans, outputs and launch in one binding call (csrc/torch_outputs.cpp), about half the
    # host time of the checked path. None (nothing launched) sends the call to the checked path, which
    # raises where the arguments are wrong.
    def unchecked_low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                       cumulative_local_expert_recv_stats, use_fp8, round_scale, use_ue8m0):
        """(recv_x, recv_count, handle), or None where the checked path must run."""
        if num_max_dispatch_tokens_per_rank.__class__ is not int or num_experts.__class__ is not int:
            return None  # NOTE: 128.0 would find the plan of 128 (equal keys); the checked path rejects it
        plan = self._ll_unchecked_plans.get((num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale,
                                             use_ue8m0))
        if plan is None or self.failure is not None:
            return None
        parity = self._ll_parity
        launched = plan.unchecked.dispatch(x, topk_idx, cumulative_local_expert_recv_stats, parity, self._stream())
        if launched is None:
            return None
        self._ll_parity = parity ^ 1
        outputs, num_tokens = launched
        recv_x, recv_count, recv_src_info, recv_layout = plan.dispatch_results(outputs)
        return recv_x, recv_count, LowLatencyHandle(self, num_tokens, parity, recv_src_info, recv_layout, plan)

    def unchecked_low_latency_combine(self, x, topk_idx, topk_weights, handle, zero_copy, out):
        """The combined tensor, or None where the checked path must run. `handle`: the backend's."""
        if handle.__class__ is not LowLatencyHandle or handle.owner is not self or self.failure is not None:
            return None
        calls = handle.plan.unchecked
        source = handle.combine_buffer if zero_copy else x
        if calls is None or source is None:
            return None
        return calls.combine(x, source, topk_idx, topk_weights, out, handle.recv_src_info, handle.recv_layout,
                             handle.num_tokens, handle.parity, self._stream())

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                             cumulative_local_expert_recv_stats, use_fp8, round_scale, use_ue8m0,
                             return_recv_hook, topk_weights):
        runtime = self._low_latency()
        T, K = topk_idx.shape
        plan = self._ll_plan((num_max_dispatch_tokens_per_rank, x.shape[1], num_experts, K, use_fp8, round_scale,
                              use_ue8m0, topk_weights is not None))
        recv_x, recv_count, recv_src_info, recv_layout = plan.dispatch_results(plan.dispatch_outputs.empty())
        data, scales = recv_x if use_fp8 else (recv_x, None)

        # A hook launches later, with the Args of its own call: it gets Args of its own.
        args = plan.new_dispatch_args() if return_recv_hook else plan.dispatch_args
        args.x, args.topk_idx, args.num_tokens = (x.data_ptr(), topk_idx.data_ptr(), T) if T else (0, 0, 0)
        args.recv_x, args.recv_scales, args.recv_count = (data.data_ptr(), 0 if scales is None else scales.data_ptr(),
                                                          recv_count.data_ptr())
        args.recv_src_info, args.recv_layout = recv_src_info.data_ptr(), recv_layout.data_ptr()
        args.cumulative_local_expert_recv_stats = address_of(cumulative_local_expert_recv_stats)
        if plan.expert_sums:
            args.topk_weights = address_of(topk_weights)
        # Rounds alternate, so two dispatch/combine rounds can be in flight. Every rank makes the same
        # sequence of calls, so every rank picks the same round. A dispatch the runtime rejects (a bad
        # expert id an earlier dispatch recorded, raised as ValueError) sent nothing and keeps the round.
        # Under CUDA-graph capture the round is fixed into the graph (each replay repeats the captured
        # sequence).
        parity = self._ll_parity
        hook = self._launch_phases(runtime.dispatch, args, parity, return_recv_hook)
        self._ll_parity = parity ^ 1
        if plan.unchecked is not None:  # the next call of these sizes may take the fast path
            self._ll_unchecked_plans[(num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale,
                                      use_ue8m0)] = plan
        handle = LowLatencyHandle(self, T, parity, recv_src_info, recv_layout, plan)
        return recv_x, recv_count, handle, hook

    def _launch_phases(self, launch: Callable[[object, int, int], None], args, parity: int,
                       return_recv_hook: bool) -> Optional[Callable[[], None]]:
        """Send only (and return the hook that receives), send + receive in one launch, or as two when ranks
        share the GPU. `launch`: the runtime's dispatch or combine."""
        if return_recv_hook:
            args.phases = _C_nvshmem.PHASE_SEND
            launch(args, parity, self._stream())
            return _receive_hook(launch, args, parity, self._stream)
        if self._ll_split:
            args.phases = _C_nvshmem.PHASE_SEND
            launch(args, parity, self._stream())
            args.phases = _C_nvshmem.PHASE_RECV
        else:
            args.phases = _SEND_RECV
        launch(args, parity, self._stream())
        return None

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, zero_copy, return_recv_hook, out):
        runtime = self._low_latency()
        handle = self._low_latency_handle(handle)
        plan = handle.plan
        T = handle.num_tokens
        if topk_idx.shape != (T, plan.num_topk):
            raise ValueError(f"low_latency_combine: topk_idx has shape {tuple(topk_idx.shape)} but the dispatch's had "
                             f"{(T, plan.num_topk)}")
        # zero_copy: the caller wrote the expert outputs into the staging area; x's data is not read. NOTE:
        # the staging tensor only then (the caller filled it, so it exists): wrapping the symmetric buffer
        # asks CUDA for the pointer's device, which a graph capture need not allow.
        if zero_copy:
            x = self.get_next_low_latency_combine_buffer(handle)
        combined = out if out is not None else plan.combine_output.empty(T)[0]
        # A hook launches later, with the Args of its own call: it gets Args of its own.
        args = plan.new_combine_args() if return_recv_hook else plan.combine_args
        args.x, args.recv_src_info, args.recv_layout = (x.data_ptr(), handle.recv_src_info.data_ptr(),
                                                        handle.recv_layout.data_ptr())
        args.topk_idx, args.topk_weights, args.out, args.num_tokens = \
            (topk_idx.data_ptr(), topk_weights.data_ptr(), combined.data_ptr(), T) if T else (0, 0, 0, 0)
        hook = self._launch_phases(runtime.combine, args, handle.parity, return_recv_hook)
        return combined, hook

    def get_next_low_latency_combine_buffer(self, handle):
        handle = self._low_latency_handle(handle)
        if handle.combine_buffer is None:
            address = self._low_latency().combine_buffer_address(
                parity=handle.parity, num_max_dispatch_tokens_per_rank=handle.num_max_dispatch_tokens_per_rank,
                hidden=handle.hidden, num_experts=handle.num_experts)
            array = _SymmetricArray(address, handle.recv_shape, "<i2")  # bf16 has no typestr: view int16 bits
            handle.combine_buffer = torch.as_tensor(array, device=self.info.device).view(torch.bfloat16)
        return handle.combine_buffer

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
        """Zero every signal word on every rank (a collective, as in DeepEP)."""
        runtime = self._low_latency()
        self._check_low_latency_shapes(num_max_dispatch_tokens_per_rank, hidden, num_experts, 1)
        torch.cuda.synchronize(self.info.device)
        dist.barrier(group=self.info.group)  # no peer is still writing into this buffer
        runtime.clean(stream=self._stream())
        self._ll_parity = 0
        dist.barrier(group=self.info.group)  # no peer writes before every buffer is clean

    def _low_latency_handle(self, handle: object) -> LowLatencyHandle:
        if not isinstance(handle, LowLatencyHandle):
            raise ValueError(f"expected a handle from low_latency_dispatch, got {type(handle).__name__}")
        return handle


def _ranks_on_this_gpu(info: GroupInfo) -> int:
    """Ranks of the group (this one included) that run on this rank's GPU (several only under CUDA MPS)."""
    props = torch.cuda.get_device_properties(info.device)
    key = str(getattr(props, "uuid", "") or "") or f"{os.uname().nodename}:{info.device.index}"
    keys: List[Optional[str]] = [None] * info.num_ranks
    dist.all_gather_object(keys, key, group=info.group)
    return keys.count(key)


def _receive_hook(launch: Callable[[object, int, int], None], args, parity: int,
                  stream: Callable[[], int]) -> Callable[[], None]:
    """A receive hook: the first call launches the receive (`args`, which no other call shares) on the
    current stream, later calls do nothing."""
    state = {"done": False}

    def hook() -> None:
        if not state["done"]:
            state["done"] = True
            args.phases = _C_nvshmem.PHASE_RECV
            launch(args, parity, stream())

    return hook
