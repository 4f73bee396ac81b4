"""Dispatch handles that index like DeepEP V1's tuples, over a backend's own handle.

`Buffer.dispatch` and `Buffer.low_latency_dispatch` return one of these. Positions hold what
DeepEP's do (docs/deepep-compat.md lists each and the ones ep_plugin has no equivalent for, which
read as None); ep_plugin's own fields (`num_recv_tokens`, `recv_shape`, ...) stay readable as
attributes of the handle. Positions are computed on first access and kept: a dispatch whose
handle is only passed back to `combine` costs nothing for them.

Normal mode, intranode (DeepEP's `intranode_dispatch`):
    0 rank_prefix_matrix          [R, R] int32: [i][j] = rows rank j receives from ranks 0..i
    1 channel_prefix_matrix       None (ep_plugin's kernels do not split tokens into DeepEP's channels)
    2 recv_channel_prefix_matrix  None (same)
    3 recv_src_idx                [N] int32: source token index of each received row (-1: padding)
    4 is_token_in_rank            [T, R] bool
    5 send_head                   [T, R] int32: the row of token t in rank r's recv_x, -1 if not sent
                                  (DeepEP's holds a ring position; ep_plugin's combine needs the row)
Normal mode, across nodes (DeepEP's `internode_dispatch`): position 0 is is_token_in_rank [T, R]
bool, 6 is recv_gbl_rank_prefix_sum [R] int32 (inclusive prefix of the rows received from each
rank); the other eight hold DeepEP's kernel state, with no ep_plugin equivalent, and read as None.
Low-latency mode: (src_info [E_local, R * T_max] int32 source token index of each slot,
layout_range [E_local, R] int64 = first slot << 32 | count per source rank,
num_max_dispatch_tokens_per_rank, hidden, num_experts).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

_INTRANODE_POSITIONS = 6
_INTERNODE_POSITIONS = 10
_LOW_LATENCY_POSITIONS = 5
# ep_plugin's native low-latency slot info: src_rank << 21 | token * 32 + k.
_SRC_INFO_ENTRY_BITS = 21
_SRC_INFO_TOPK_BITS = 5


class _TupleFace:
    """A fixed-length, read-only sequence whose items are computed once, on first access; every
    other attribute reads (and writes) through to the backend's handle `inner`."""

    __slots__ = ("inner", "_items")

    def __init__(self, inner: object, length: int) -> None:
        _set_field(self, "inner", inner)
        _set_field(self, "_items", [_UNSET] * length)

    def _compute(self, position: int) -> Any:
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index):
        length = len(self._items)
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(length)))
        if not -length <= index < length:
            raise IndexError(f"{type(self).__name__} index {index} out of range (DeepEP's handle has {length} items)")
        position = index % length
        value = self._items[position]
        if value is _UNSET:
            value = self._items[position] = self._compute(position)
        return value

    def __iter__(self):
        return (self[i] for i in range(len(self._items)))

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "inner"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.inner, name, value)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(len={len(self._items)}, inner={type(self.inner).__name__})"


_UNSET = object()
# Sets a face's own field (its __setattr__ writes through to the backend's handle).
_set_field = object.__setattr__


class DispatchHandle(_TupleFace):
    """A normal-mode dispatch's handle: DeepEP's intranode or internode tuple (module docstring).

    `gather_counts(row)` turns every rank's `[R]` int32 send counts into `[R, R]` (row s = rank s's).
    It is a collective, run only when a position that needs other ranks' counts (0, and 5 or 6 where
    derived from them) is read and the backend's handle does not carry the count matrix itself
    (native): then every rank must read it, as in DeepEP's programs every rank does.
    """

    __slots__ = ("_is_token_in_rank", "_rank", "_intranode", "_gather_counts")

    def __init__(self, inner: object, is_token_in_rank: torch.Tensor, rank: int, intranode: bool,
                 gather_counts: Callable[[torch.Tensor], torch.Tensor]) -> None:
        # NOTE: every field set here (no call to the base's __init__): this runs in every dispatch.
        _set_field(self, "inner", inner)
        _set_field(self, "_items", [_UNSET] * (_INTRANODE_POSITIONS if intranode else _INTERNODE_POSITIONS))
        _set_field(self, "_is_token_in_rank", is_token_in_rank)
        _set_field(self, "_rank", rank)
        _set_field(self, "_intranode", intranode)
        _set_field(self, "_gather_counts", gather_counts)

    def _compute(self, position: int) -> Any:
        if not self._intranode:
            if position == 0:
                return self._is_token_in_rank
            return self._recv_rank_prefix_sum() if position == 6 else None
        if position == 0:
            return torch.cumsum(self._count_matrix(), dim=0, dtype=torch.int32)
        if position == 3:
            return _recv_src_idx(self.inner)
        if position == 4:
            return self._is_token_in_rank
        return self._send_head() if position == 5 else None

    def _count_matrix(self) -> torch.Tensor:
        """[R, R] int32 on the handle's device: [s][j] = rows rank j receives from rank s."""
        device = self._is_token_in_rank.device
        counts = getattr(self.inner, "rank_count_matrix", None)
        if counts is not None:  # the backend's dispatch exchanged every rank's counts (no collective)
            return torch.tensor(counts, dtype=torch.int32, device=device)
        return self._gather_counts(self._is_token_in_rank.sum(dim=0, dtype=torch.int32))

    def _send_head(self) -> torch.Tensor:
        send_pos = getattr(self.inner, "send_pos", None)
        if send_pos is not None:
            return send_pos
        # This rank's rows on rank r follow the rows of ranks 0..rank-1 there, in token order.
        prefix = self[0]
        rank = self._rank
        first = prefix[rank - 1] if rank > 0 else torch.zeros_like(prefix[0])
        sent = self._is_token_in_rank
        order = torch.cumsum(sent.to(torch.int32), dim=0, dtype=torch.int32) - 1
        return torch.where(sent, first.unsqueeze(0) + order, torch.full_like(order, -1))

    def _recv_rank_prefix_sum(self) -> torch.Tensor:
        return torch.cumsum(self._count_matrix()[:, self._rank], dim=0, dtype=torch.int32)


def _recv_src_idx(inner: object) -> torch.Tensor:
    """[rows] int32: source token index of each received row, -1 on padding rows."""
    src = inner.recv_src_idx
    rows = inner.num_recv_rows
    if src.dtype == torch.int32 and src.size(0) == rows:
        return src
    padded = torch.full((rows,), -1, dtype=torch.int32, device=src.device)
    padded[:src.size(0)] = src
    return padded


class LowLatencyHandle(_TupleFace):
    """A low-latency dispatch's handle: DeepEP's `(src_info, layout_range, num_max_dispatch_tokens_per_rank,
    hidden, num_experts)`."""

    __slots__ = ()

    def __init__(self, inner: object) -> None:
        # NOTE: the base's fields set here (no call to its __init__): this runs in every low_latency_dispatch.
        _set_field(self, "inner", inner)
        _set_field(self, "_items", [_UNSET] * _LOW_LATENCY_POSITIONS)

    def _compute(self, position: int) -> Any:
        inner = self.inner
        if position == 0:
            src_token = getattr(inner, "recv_src_token", None)  # a backend that keeps DeepEP's form
            return src_token if src_token is not None else source_token_index(inner.recv_src_info)
        if position == 1:
            return inner.recv_layout
        if position == 2:
            return inner.num_max_dispatch_tokens_per_rank
        if position == 3:
            return inner.recv_shape[2]
        return inner.num_experts


def source_token_index(recv_src_info: torch.Tensor) -> torch.Tensor:
    """ep_plugin's slot info (src_rank << 21 | token * 32 + k, int32) -> the source token index (int32).
    Unfilled slots give values without meaning, as DeepEP's do."""
    entry = torch.bitwise_and(recv_src_info, (1 << _SRC_INFO_ENTRY_BITS) - 1)
    return torch.bitwise_right_shift(entry, _SRC_INFO_TOPK_BITS)


def unwrap(handle: object) -> object:
    """The backend's handle inside a DeepEP-shaped one (anything else unchanged)."""
    return handle.inner if isinstance(handle, _TupleFace) else handle


def all_gather_rows(group: dist.ProcessGroup, row: torch.Tensor) -> torch.Tensor:
    """[R, n]: every rank's `row` ([n]), gathered over `group` (through the host when the group's
    backend cannot move tensors of `row`'s device, e.g. gloo with CUDA tensors)."""
    backend = str(dist.get_backend(group)).lower()
    on_device = row.device.type == "cpu" or "nccl" in backend or "cuda" in backend
    source = row.contiguous() if on_device else row.cpu()
    parts = [torch.empty_like(source) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, source, group=group)
    return torch.stack(parts).to(row.device)
