"""Normal mode inside one NVLink domain: notify, the ring and direct dispatches, the SM and copy-engine
combines (`_C.IntranodeRuntime` over CUDA-IPC-mapped buffers). Also the intranode stage of internode mode."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..output_region import OutputRegion
from ..tuning import (MAX_TOPK, Config, block_takes_copy_engines, output_region_bytes, pulls_rows,
                      staging_bytes)
from ..validation import FP8_DTYPE
from .native_common import NativeBase, OutputGroup, _C, _C_torch, address_of, local_experts, raise_failure

if TYPE_CHECKING:
    from .native import NativeBackend


# `_prepare_dispatch`'s top-k of a cached dispatch: (K, ids, has_weights, weights), none.
_NO_TOPK = (0, 0, False, 0)
_NOTIFY_WORDS = (((-1,), None, torch.int32),)  # NotifyOutputs' one allocation, an OutputGroup block


def _payload(x: torch.Tensor, x_scales: Optional[torch.Tensor]):
    """A dispatch payload as Buffer.dispatch takes it: x, or (x, x_scales)."""
    return x if x_scales is None else (x, x_scales)


class NotifyOutputs:
    """What notify writes for one dispatch, in one int32 allocation, each part 16-byte aligned:
    send_pos [T, R] (row of token t on rank r, or -1), recv_rank_offsets [R + 1] (first row of each
    source rank), src_num_tokens [R] (T of every rank) and the received count [1]. One allocation
    instead of four, on the host's path before notify's launch (a torch.empty from Python costs about
    4.5 us on an H100 host); the kernels take the parts' addresses, so views are made only where a
    caller asks."""

    __slots__ = ("words", "num_tokens", "num_ranks", "send_pos_address", "recv_rank_offsets_address",
                 "src_num_tokens_address", "num_recv_address")

    def __init__(self, words_of: Callable[[int], torch.Tensor], num_tokens: int, num_ranks: int) -> None:
        """`words_of(n)`: n int32 words on the buffer's device."""
        starts = self.starts(num_tokens, num_ranks)
        self.words, self.num_tokens, self.num_ranks = words_of(starts[4]), num_tokens, num_ranks
        base = self.words.data_ptr()
        self.send_pos_address = base if num_tokens > 0 else 0
        self.recv_rank_offsets_address = base + 4 * starts[1]
        self.src_num_tokens_address = base + 4 * starts[2]
        self.num_recv_address = base + 4 * starts[3]

    @staticmethod
    def starts(num_tokens: int, num_ranks: int) -> Tuple[int, int, int, int, int]:
        """First word of each part, then the total."""
        send_pos_words = (num_tokens * num_ranks + 3) // 4 * 4
        offsets_words = (num_ranks + 4) // 4 * 4
        counts_words = (num_ranks + 3) // 4 * 4
        first = send_pos_words + offsets_words
        return 0, send_pos_words, first, first + counts_words, first + counts_words + 4

    def part(self, index: int, *shape: int) -> torch.Tensor:
        start = self.starts(self.num_tokens, self.num_ranks)[index]
        size = 1
        for extent in shape:
            size *= extent
        return self.words[start:start + size].view(*shape)


@dataclass
class NativeHandle:
    """Layout of one dispatch (opaque to users)."""
    owner: "NativeBackend"
    num_tokens: int                  # T of this rank
    num_recv_rows: int               # rows of recv_x (received tokens, or num_worst_tokens)
    num_recv_tokens: Optional[int]   # received tokens when known on the host (None in graph mode)
    num_worst_tokens: int
    is_token_in_rank: torch.Tensor   # [T, R] bool
    notify: NotifyOutputs            # send_pos, recv_rank_offsets, src_num_tokens, the received count
    recv_src_idx: torch.Tensor       # [rows] int32: source token of each received row (-1 padding)
    num_recv_per_rank: Optional[List[int]] = None  # rows from each source rank, when known on the host
    largest_block_rows: int = 0  # with num_recv_per_rank: the most rows any rank received from any one rank
    own_runs: Optional[object] = None  # _C.OwnRuns: runs of tokens this rank sends itself (copy engine, few SMs)

    @property
    def send_pos(self) -> torch.Tensor:  # [T, R] int32
        return self.notify.part(0, self.notify.num_tokens, self.notify.num_ranks)

    @property
    def recv_rank_offsets(self) -> torch.Tensor:  # [R + 1] int32
        return self.notify.part(1, self.notify.num_ranks + 1)

    @property
    def src_num_tokens(self) -> torch.Tensor:  # [R] int32
        return self.notify.part(2, self.notify.num_ranks)

    @property
    def num_recv_device(self) -> torch.Tensor:  # [1] int32
        return self.notify.part(3, 1)


class IntranodeMode(NativeBase):
    """NativeBackend's normal mode in one NVLink domain."""

    def _start_intranode(self, num_nvl_bytes: int, low_latency_mode: bool) -> None:
        """The runtime over every rank of the group, its peers' buffers mapped; in normal mode also the
        copy-engine combine's staging area and the direct dispatch's output region."""
        info, settings = self.info, self.settings
        # The copy-engine combine's staging area: only for buffers made for normal mode.
        staging = 0 if low_latency_mode else staging_bytes(settings.buffer, info.num_ranks)
        output_bytes = 0 if low_latency_mode else output_region_bytes(settings.buffer, info.num_ranks)
        self._runtime = _C.IntranodeRuntime(info.rank, info.num_ranks, num_nvl_bytes, settings.timeout_s, staging,
                                            output_bytes, settings.dispatch.direct_max_blocks,
                                            settings.dispatch.direct_chunk_tokens)
        peers: List[Optional[Tuple[bytes, int]]] = [None] * info.num_ranks
        dist.all_gather_object(peers, (self._runtime.ipc_handle(), staging), group=info.group)
        self._runtime.connect([handle for handle, _ in peers])
        # Every rank carves its peers' staging areas alike: by the smallest of them.
        self._staging_bytes = min(size for _, size in peers)
        if output_bytes > 0:
            self._outputs = OutputRegion(self._runtime.output_region_address, output_bytes, info.device)

    def _intranode(self):
        if self._runtime is None:
            raise RuntimeError("normal-mode kernels need num_nvl_bytes (Config.get_nvl_buffer_size_hint) on a "
                               "native buffer; this one was created for low-latency mode only")
        return self._runtime

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int):
        if self._runtime is not None:
            self._runtime.check_device_error()  # a failed Buffer raises before any kernel runs
        T, K = topk_idx.shape
        info = self.info
        outputs = self._layout_outputs(num_experts)
        # NOTE: the outputs in one binding call and one allocation, and the kernel by position: the fewest
        # Python operations (host time of an eager call). The kernel writes every entry.
        if info.is_intranode:
            per_rank, per_expert, in_rank = outputs.empty(T)
            per_node = None
        else:
            per_rank, per_node, per_expert, in_rank = outputs.empty(T)
        _C.get_dispatch_layout(topk_idx.data_ptr(), T, K, num_experts, info.num_ranks, info.ranks_per_node,
                               per_rank.data_ptr(), 0 if per_node is None else per_node.data_ptr(),
                               per_expert.data_ptr(), in_rank.data_ptr(), self._stream())
        if num_experts not in self._layout_calls:
            self._layout_calls[num_experts] = self._make_layout_calls(outputs, num_experts)
        return per_rank, per_node, per_expert, in_rank

    def _layout_outputs(self, num_experts: int) -> OutputGroup:
        """get_dispatch_layout's outputs, one allocation: per rank, (per node across nodes,) per expert, in rank."""
        info = self.info
        R = info.num_ranks
        per_node = (((info.num_nodes,), None, torch.int32),) if not info.is_intranode else ()
        return self._output_group((((R,), None, torch.int32), *per_node, ((num_experts,), None, torch.int32),
                                   ((-1, R), None, torch.bool)))

    def _make_layout_calls(self, outputs: OutputGroup, num_experts: int):
        info = self.info
        calls = _C_torch.layout_calls(outputs.group, _C.layout_launcher, self._runtime, info.device, num_experts,
                                      info.num_ranks, info.ranks_per_node, MAX_TOPK, not info.is_intranode)
        if calls.__class__ is tuple:
            raise_failure(calls)
        return calls

    # ---- the eager fast path --------------------------------------------------------------------------
    # Buffer's get_dispatch_layout without an event, async_finish or allocate_on_comm_stream first tries
    # this: the LayoutCalls that a checked call of the same expert count made, its checks in C++ as
    # booleans, outputs and launch in one binding call (csrc/torch_outputs.cpp). None (nothing launched)
    # sends the call to the checked path, which raises where the arguments are wrong.
    def unchecked_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int):
        """get_dispatch_layout's four outputs, or None where the checked path must run."""
        if num_experts.__class__ is not int:
            return None  # NOTE: 256.0 would find the calls of 256 (equal keys); the checked path rejects it
        calls = self._layout_calls.get(num_experts)
        if calls is None or self.failure is not None:
            return None
        return calls.layout(topk_idx, self._stream())

    def _node_dispatch(self, x, x_scales, topk_idx, topk_weights, is_token_in_rank, num_tokens_per_expert,
                       expert_alignment, num_worst_tokens, config: Config):
        """The intranode kernels among the ranks of this node: notify, the host's wait for the received
        count (unless `num_worst_tokens`), outputs, dispatch. `is_token_in_rank` is `[T, ranks of the
        node]` and expert ids count from the node's first expert. Returns DeepEP's dispatch outputs."""
        R = is_token_in_rank.size(1)
        read = self._inputs.dispatch(_payload(x, x_scales), topk_idx, topk_weights, None, is_token_in_rank,
                                     num_tokens_per_expert, R, False)
        if read is None:
            raise ValueError("dispatch: the intranode kernels need contiguous x, topk_idx, topk_weights, "
                             "is_token_in_rank and num_tokens_per_expert on the buffer's GPU")
        return self._dispatch_read(read, R, is_token_in_rank, expert_alignment, num_worst_tokens, config)

    # ---- the eager fast path of dispatch ----------------------------------------------------------------
    # Buffer's dispatch without an event, async_finish, allocate_on_comm_stream or num_worst_tokens first
    # tries these: the tensors' facts read in one binding call (_C_torch.NormalInputs), which returns None
    # where any is not what the kernels read without a copy, and Buffer's checked path then runs the call.
    # A None comes before any launch; an error after one is raised (errors.py wraps both as their operation).
    def unchecked_dispatch(self, x, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
                           num_tokens_per_expert, expert_alignment, config: Config):
        """Buffer.dispatch's outputs but the handle's wrapper, or None where the checked path must run."""
        if self._net is not None or config.num_sms > self._num_device_sms:
            return None
        R = self.info.num_ranks
        read = self._inputs.dispatch(x, topk_idx, topk_weights, num_tokens_per_rank, is_token_in_rank,
                                     num_tokens_per_expert, R, True)
        if read is None:
            return None
        return self._dispatch_read(read, R, is_token_in_rank, expert_alignment, 0, config)

    def unchecked_cached_dispatch(self, x, handle: "NativeHandle", config: Config):
        """Buffer.dispatch's (recv_x, recv_scales) with `handle`, or None where the checked path must run."""
        if (self._net is not None or config.num_sms > self._num_device_sms or handle.__class__ is not NativeHandle
                or handle.owner is not self):
            return None
        payload = self._inputs.payload(x, True)
        if payload is None or payload[0] != handle.num_tokens:
            return None
        return self._cached_dispatch_read(payload, handle, config)

    def _dispatch_read(self, read: tuple, R: int, is_token_in_rank, expert_alignment, num_worst_tokens,
                       config: Config):
        """_node_dispatch on the facts `_inputs.dispatch` read."""
        payload, (K, topk_idx, has_weights, topk_weights, num_experts, in_rank, per_expert) = read[:8], read[8:]
        T, row_bytes, num_scales = payload[0], payload[1], payload[4]
        num_local_experts = local_experts(num_experts, R)
        notify = NotifyOutputs(self._notify_words, T, R)
        host_tag = 0
        if num_worst_tokens == 0:
            self._notify_tag += 1
            host_tag = self._notify_tag
        runtime, stream = self._intranode(), self._stream()
        # NOTE: without top-k (K = 0) notify reads no id; it still wants an address for T > 0 tokens.
        ids = topk_idx if K > 0 else in_rank
        row_layout = _C.pack_row_layout(row_bytes, num_scales, K, has_weights)
        # Positional, in the binding's order (python_api.cpp says why).
        args = _C.NotifyArgs(in_rank, per_expert, ids, T, K, num_experts, expert_alignment, num_worst_tokens,
                             row_layout, host_tag, notify.send_pos_address, notify.recv_rank_offsets_address,
                             notify.src_num_tokens_address, notify.num_recv_address)
        runtime.notify(args, stream)
        # While notify runs: everything the dispatch needs but the received count.
        dispatch = self._prepare_dispatch(payload, (K, topk_idx, has_weights, topk_weights), notify,
                                          num_local_experts, num_worst_tokens, config, stream, with_metadata=True)
        num_recv = runtime.wait_notify(host_tag, stream) if num_worst_tokens == 0 else None
        rows = num_worst_tokens if num_recv is None else num_recv
        recv_x, recv_scales, recv_topk_idx, recv_topk_weights, recv_src_idx = dispatch.launch(
            rows, own_runs_tag=host_tag)
        # The counts' lists are built after the launch: the GPU waits for nothing else.
        per_rank, per_expert, largest_block = (None, [], 0) if num_recv is None else runtime.notify_counts(
            num_local_experts)
        self.last_dispatch_path = dispatch.path
        handle = NativeHandle(owner=self, num_tokens=T, num_recv_rows=rows, num_recv_tokens=num_recv,
                              num_worst_tokens=num_worst_tokens, is_token_in_rank=is_token_in_rank,
                              notify=notify, recv_src_idx=recv_src_idx, num_recv_per_rank=per_rank,
                              largest_block_rows=largest_block,
                              own_runs=dispatch.own_runs)
        return recv_x, recv_scales, recv_topk_idx, recv_topk_weights, per_expert, handle  # notify_counts' new lists

    def _notify_words(self, words: int) -> torch.Tensor:
        """NotifyOutputs' int32 words, allocated in C++ (a torch.empty from Python would pass through a
        default-device mode, and cost about 4.5 us even without one)."""
        return self._output_group(_NOTIFY_WORDS).empty(words)[0]

    def _direct_dispatch_possible(self) -> bool:
        """Whether this intranode dispatch writes straight into the ranks' output regions. Every rank decides
        alike: all have the region (same config) and capture graphs together."""
        return self._outputs is not None and self._net is None and not torch.cuda.is_current_stream_capturing()

    def _prepare_dispatch(self, payload: tuple, topk: tuple, notify: NotifyOutputs, num_local_experts,
                          num_worst_tokens, config: Config, stream: int, with_metadata: bool) -> "PreparedDispatch":
        """The dispatch of a payload (`_inputs.payload`'s numbers) and its top-k ids and weights (`topk`:
        (K, ids, has_weights, weights), K = 0 for none) by notify's send_pos, ready but for its row count;
        its outputs: recv_x and recv_scales, and `with_metadata` also recv_topk_idx, recv_topk_weights and
        recv_src_idx (a dispatch with notify)."""
        args = self._dispatch_args(payload, topk, notify, num_local_experts, num_worst_tokens, config)
        key = (payload[1], payload[4], payload[7], topk[0], topk[2], with_metadata)
        shape = self._dispatch_outputs.get(key)
        if shape is None:
            shape = self._dispatch_outputs[key] = DispatchOutputs(*key)
        region = self._outputs if self._direct_dispatch_possible() else None
        return PreparedDispatch(self._intranode(), args, shape, region, stream, self.info.device)

    def direct_fell_back(self) -> bool:
        """Whether this rank's last direct dispatch found a rank without room in its output region and
        moved the rows through the rings instead (synchronises with the device; for tests and logs)."""
        return self._intranode().direct_fell_back()

    def _read_payload(self, x, x_scales) -> tuple:
        """`_inputs.payload` of checked tensors (x and x_scales contiguous where the kernels need it)."""
        payload = self._inputs.payload(_payload(x, x_scales), False)
        if payload is None:
            raise ValueError("dispatch: the intranode kernels need a contiguous x (and scales of positive strides) "
                             "on the buffer's GPU")
        return payload

    def _dispatch_args(self, payload: tuple, topk: tuple, notify: NotifyOutputs, num_local_experts,
                       num_worst_tokens, config: Config):
        """A dispatch's Args, every field but the outputs' addresses (recv_*: 0)."""
        T, row_bytes, x, scales, num_scales, scale_token_stride, scale_stride, _ = payload
        # Positional, in the binding's order (python_api.cpp says why).
        return _C.DispatchArgs(config.num_channels, config.num_max_nvl_chunked_recv_tokens,
                               config.num_max_nvl_chunked_send_tokens, T, row_bytes, num_scales, scale_token_stride,
                               scale_stride, topk[0], topk[1], topk[3], num_local_experts, num_worst_tokens, x, scales,
                               notify.send_pos_address, notify.num_recv_address)

    def _launch_dispatch(self, x, x_scales, topk_idx, topk_weights, notify: NotifyOutputs, recv_x, recv_scales,
                         recv_topk_idx, recv_topk_weights, recv_src_idx, num_local_experts, num_worst_tokens,
                         config: Config) -> None:
        """The ring dispatch into outputs the caller allocated (the intranode stage of internode mode)."""
        topk = (0 if topk_idx is None else topk_idx.size(1), address_of(topk_idx), topk_weights is not None,
                address_of(topk_weights))
        args = self._dispatch_args(self._read_payload(x, x_scales), topk, notify, num_local_experts,
                                   num_worst_tokens, config)
        args.recv_x, args.recv_x_scales = address_of(recv_x), address_of(recv_scales)
        args.recv_topk_idx, args.recv_topk_weights = address_of(recv_topk_idx), address_of(recv_topk_weights)
        args.recv_src_idx = address_of(recv_src_idx)
        self.last_dispatch_path = "rings"
        self._intranode().dispatch(args, self._stream())

    def _intranode_cached_dispatch(self, x, x_scales, handle: NativeHandle, config: Config):
        self._check_sms(config)
        return self._cached_dispatch_read(self._read_payload(x, x_scales), handle, config)

    def _cached_dispatch_read(self, payload: tuple, handle: NativeHandle, config: Config):
        """The cached dispatch of a payload (`_inputs.payload`'s numbers): (recv_x, recv_scales)."""
        dispatch = self._prepare_dispatch(payload, _NO_TOPK, handle.notify, 1, handle.num_worst_tokens, config,
                                          self._stream(), with_metadata=False)
        recv_x, recv_scales = dispatch.launch(handle.num_recv_rows, own_runs=handle.own_runs)
        self.last_dispatch_path = dispatch.path
        return recv_x, recv_scales

    def _intranode_combine(self, x, handle: NativeHandle, topk_weights, bias_0, bias_1, config: Config):
        self._check_sms(config)
        read = self._inputs.combine(x, topk_weights, handle.num_recv_rows, False)
        if read is None:
            raise ValueError("combine: the intranode kernels need contiguous x and topk_weights on the buffer's GPU")
        return self._combine_read(read, handle, bias_0, bias_1, config)

    def unchecked_combine(self, x, handle: "NativeHandle", topk_weights, config: Config):
        """Buffer.combine's (combined_x, combined_topk_weights) without bias, or None where the checked path must
        run (having launched nothing); as unchecked_dispatch."""
        if (self._net is not None or config.num_sms > self._num_device_sms or handle.__class__ is not NativeHandle
                or handle.owner is not self):
            return None
        read = self._inputs.combine(x, topk_weights, handle.num_recv_rows, True)
        return None if read is None else self._combine_read(read, handle, None, None, config)

    def _combine_read(self, read: tuple, handle: NativeHandle, bias_0, bias_1, config: Config):
        """_intranode_combine on the facts `_inputs.combine` read: (x, hidden, K, topk_weights)."""
        hidden, K = read[1], read[2]
        group = self._combine_outputs.get((hidden, K))
        if group is None:
            group = self._combine_outputs[(hidden, K)] = self._combine_output_group(hidden, K)
        if K == 0:
            (combined_x,), combined_weights = group.empty(handle.num_tokens), None
        else:
            combined_x, combined_weights = group.empty(handle.num_tokens)
        outputs = (address_of(bias_0), address_of(bias_1), address_of(combined_x), address_of(combined_weights))
        if self._copy_engine_combine_possible(handle, hidden):
            self._staged_combine(read, handle, outputs, config)
            self.last_combine_path = "pull" if pulls_rows(self.info.num_ranks) else "copy_engine"
        else:
            self.last_combine_path = "sm"
            self._sm_combine_read(read, handle, outputs, config)
        return combined_x, combined_weights

    def _combine_output_group(self, hidden: int, K: int):
        """The output group of a combine's `[T, hidden]` bf16 rows and, with top-k (K > 0), `[T, K]` float32 weights:
        two allocations, so that a caller that keeps only the weights does not keep the rows."""
        rows = (((-1, hidden), None, torch.bfloat16),)
        return self._output_group(rows, (((-1, K), None, torch.float32),)) if K > 0 else self._output_group(rows)

    def _sm_combine(self, x, topk_weights, handle: NativeHandle, bias_0, bias_1, combined_x, combined_weights,
                    config: Config) -> None:
        """The combine kernel over the rings: `combined_x[t]` ([T, hidden] bf16, T = handle.num_tokens) is
        the sum of the rows of `x` ([rows, hidden] bf16, as dispatched) that came from token t, plus the
        biases; `combined_weights` ([T, K] fp32 or None) the same for `topk_weights`."""
        read = (address_of(x), x.size(1), 0 if topk_weights is None else topk_weights.size(1), address_of(topk_weights))
        outputs = (address_of(bias_0), address_of(bias_1), address_of(combined_x), address_of(combined_weights))
        self._sm_combine_read(read, handle, outputs, config)

    def _sm_combine_read(self, read: tuple, handle: NativeHandle, outputs: tuple, config: Config) -> None:
        """_sm_combine on addresses: `read` (x, hidden, K, topk_weights), `outputs` (bias_0, bias_1, combined_x,
        combined_topk_weights)."""
        notify = handle.notify
        # Positional, in the binding's order (python_api.cpp says why): the config's rings, `read`, the handle's
        # layout, `outputs`.
        args = _C.CombineArgs(config.num_channels, config.num_max_nvl_chunked_recv_tokens,
                              config.num_max_nvl_chunked_send_tokens, *read, handle.num_tokens,
                              address_of(handle.recv_src_idx), notify.recv_rank_offsets_address,
                              notify.src_num_tokens_address, notify.send_pos_address, *outputs)
        self._intranode().combine(args, self._stream())

    def _copy_engine_combine_possible(self, handle: NativeHandle, hidden: int) -> bool:
        """Whether this combine goes through the copy engines (the same answer on every rank).

        It needs the received rows per source on the host (a dispatch that waited for its counts,
        not `num_worst_tokens`), a largest block (the most rows any rank sends any owner, a count every
        rank knows alike) big enough to pay for the copies' host side, a staging area that holds two
        pieces of rows (where the owners pull them: that whole block), and no graph capture: the host
        numbers each combine, and a replayed graph would repeat the numbers.
        """
        R = self.info.num_ranks
        if (self._staging_bytes == 0 or handle.num_recv_per_rank is None or R < 2
                or not block_takes_copy_engines(R, handle.largest_block_rows, hidden)
                or torch.cuda.is_current_stream_capturing()):
            return False
        rows = self._intranode().staging_rows(self._staging_bytes, hidden)
        return rows > 0 and (not pulls_rows(R) or handle.largest_block_rows <= rows)

    def _staged_combine(self, read: tuple, handle: NativeHandle, outputs: tuple, config: Config) -> None:
        """The copy-engine combine on addresses, as _sm_combine_read takes them."""
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device=self.info.device)
        # The reduction uses the config's SMs but leaves one per peer free: each copy stream waits for
        # its owner in a one-thread kernel beside the reduction. The copies use no SM.
        num_sms = min(config.num_sms, self._num_device_sms - (self.info.num_ranks - 1))
        # Positional, in the binding's order (python_api.cpp says why).
        args = _C.StagedReduceArgs(*read, handle.num_tokens, handle.notify.send_pos_address, *outputs,
                                   pulls_rows(self.info.num_ranks))
        self._intranode().staged_combine(args, handle.num_recv_per_rank, self._staging_bytes, num_sms, self._stream(),
                                         self._side_stream.cuda_stream)


class DispatchOutputs:
    """The outputs of one kind of dispatch, made once per kind: each output's column ((width, dtype), width
    0 for a 1-D output, or None where absent) and, for the output region, the two blocks of (index, bytes
    per row, 2-D): the rows and their scales go back with recv_x, the metadata with the handle. A kind:
    the payload's row bytes, its scales (count, int32 or float32), the top-k (K, weights or not), and
    whether the dispatch returns the metadata (a dispatch with notify)."""

    FIELDS = ("recv_x", "recv_x_scales", "recv_topk_idx", "recv_topk_weights", "recv_src_idx")
    _ROWS = 2  # the first two outputs (recv_x, recv_x_scales) form the rows block

    def __init__(self, row_bytes: int, num_scales: int, scales_are_int32: bool, num_topk: int, has_weights: bool,
                 with_metadata: bool) -> None:
        # NOTE: a payload with scales is FP8 (one byte per element), one without is bf16.
        rows = (row_bytes, FP8_DTYPE) if num_scales > 0 else (row_bytes // 2, torch.bfloat16)
        self.columns: List[Optional[Tuple[int, torch.dtype]]] = [
            rows, (num_scales, torch.int32 if scales_are_int32 else torch.float32) if num_scales > 0 else None]
        if with_metadata:
            self.columns += [(num_topk, torch.int64) if num_topk > 0 else None,
                             (num_topk, torch.float32) if has_weights else None, (0, torch.int32)]
        self.fields = self.FIELDS[:len(self.columns)]
        self.blocks: List[List[Tuple[int, int, bool]]] = [[], []]
        for index, column in enumerate(self.columns):
            if column is not None:
                width, dtype = column
                self.blocks[index >= self._ROWS].append((index, max(width, 1) * dtype.itemsize, width > 0))
        if not self.blocks[1]:
            del self.blocks[1]
        placed = [index for block in self.blocks for index, _, _ in block]  # in the order of the capsules
        self.placed_dtypes = [self.columns[index][1] for index in placed]
        # NOTE: the blocks hold their columns in order, so the capsules come in column order: a call's outputs
        # are its tensors with a None inserted at each absent column, in ascending order.
        self.absent = [index for index, column in enumerate(self.columns) if column is None]


class PreparedDispatch:
    """An intranode dispatch ready to launch but for its row count: its Args with every field but the
    outputs, its outputs (DispatchOutputs), its path. `launch(rows)` is all the host does between the
    received count's arrival and the kernel (the GPU idles meanwhile): allocate the outputs, set their
    addresses, launch; the outputs get their dtypes after the launch.

    Direct (`region` given): the outputs go into the output region, in two blocks. Where the region has
    no room they are ordinary tensors, and the direct dispatch falls back to the rings on every rank (the
    kernels agree on it; no rank raises). Rings (`region` None): ordinary tensors. The copy engine writes
    this rank's own rows where they form few runs of tokens (`own_runs`: the runtime's answer, kept by the
    handle).
    """

    def __init__(self, runtime, args, outputs: DispatchOutputs, region: Optional[OutputRegion], stream: int,
                 device: torch.device) -> None:
        self.runtime, self.args, self.outputs, self.region, self.stream = runtime, args, outputs, region, stream
        self.device = device
        self.path = "rings" if region is None else "direct"  # "direct": the direct kernel ran (direct_fell_back)
        self.own_runs = None

    def launch(self, rows: int, own_runs_tag: int = 0, own_runs=None) -> List[Optional[torch.Tensor]]:
        """Place the outputs of `rows` rows, launch the dispatch into them; the outputs (None where absent).
        The own rows' runs: those of the notify tagged `own_runs_tag`, or `own_runs` (a cached dispatch)."""
        if self.region is not None:
            # One extension call places every output and sets its address; torch's tensors come after the launch.
            capsules = self.region.place_direct_outputs(self.args, rows, self.outputs.blocks, self.stream)
            if capsules is not None:
                self.own_runs = self.runtime.direct_dispatch(self.args, rows, True, self.stream, own_runs_tag, own_runs)
                return self._from_capsules(capsules)
        outputs = self._ordinary(rows)
        for field, tensor in zip(self.outputs.fields, outputs):
            setattr(self.args, field, address_of(tensor))
        if self.region is None:
            self.runtime.dispatch(self.args, self.stream)
        else:  # no room here: every rank's direct kernel sees it and the rows go through the rings
            self.runtime.direct_dispatch(self.args, rows, False, self.stream)
        return outputs

    def _from_capsules(self, capsules: list) -> List[Optional[torch.Tensor]]:
        outputs = _C_torch.region_tensors(capsules, self.outputs.placed_dtypes)
        if outputs.__class__ is tuple:
            raise_failure(outputs)
        for index in self.outputs.absent:
            outputs.insert(index, None)
        return outputs

    def _ordinary(self, rows: int) -> List[Optional[torch.Tensor]]:
        return [None if column is None else
                torch.empty(rows, column[0], dtype=column[1], device=self.device) if column[0] else
                torch.empty(rows, dtype=column[1], device=self.device)
                for column in self.outputs.columns]
