"""Rank masking for low-latency mode (DeepEP V1's shrink mode): decode keeps serving with a rank gone.

A `Buffer(..., low_latency_mode=True, enable_shrink=True)` holds a mask (`attach`): one flag per rank
of the group, local to this rank (as DeepEP's mask buffer: ranks do not agree on it by themselves).
While rank m is masked here, this rank's low-latency calls skip it:
- `low_latency_dispatch` sends no token to m's experts and receives none from m (m's tokens are
  dropped): the slots of this rank's experts hold the unmasked ranks' tokens only, in the usual
  order (source rank, then token, then top-k position), and `recv_count` counts only them.
- `low_latency_combine` counts the outputs of m's experts as zero: entry (t, k) with
  `topk_idx[t, k]` on m adds nothing to token t (as if it were -1).
- A peer that does not answer a low-latency call within `timeout_s` is masked (instead of an
  error), and the call completes without it; so is a peer whose connection is lost.
`low_latency_update_mask_buffer(r, mask)` sets or clears a flag, `low_latency_clean_mask_buffer()`
clears all, `low_latency_query_mask_buffer(status)` writes them into an int32 `[num_ranks]` tensor
(1 = masked). Normal mode ignores the mask.

The reference backend (`RankMask`) moves a masked Buffer's low-latency rows point to point
(`MaskedExchange`) among the unmasked ranks, each receive with a deadline. Every unmasked pair must
make the same sequence of masked exchanges since the last clean (messages are matched by that count).

The native backend (`DeviceRankMask`) keeps the flags in an int32 `[num_ranks]` tensor on this rank's
GPU that its low-latency kernels read at every call (a CUDA graph replays with the current mask) and
write when a wait for a peer passes `timeout_s` (the peer is masked on the device, printed, and the
kernel goes on: no trap, the CUDA context stays usable). Update, query and clean run on the current
stream, in order with the calls on it. What a masked peer can still do (csrc/kernels/low_latency_layout.cuh):
- A dead peer writes nothing more: the survivors are safe for as long as it stays masked.
- A live peer (masked by hand on one side only, or stalled past `timeout_s` and then resumed) may still
  write into this rank's buffer for the calls it is in. Its signal words are neither read nor reset
  while it is masked, and its own regions are not read; but a token payload it sends late lands in the
  area that this round's combine stages from (with zero_copy: the expert outputs) and can corrupt that
  combine. Mask a live rank on both sides, before the same call, to keep it out.
- Its signal words may hold stale counts: before a masked rank takes part again (update(r, False) or
  clean), call `clean_low_latency_buffer` on every rank (a collective of the whole group, all alive).
  Ranks that masked each other before the same call exchanged nothing and need no clean.
Do not change the mask between a dispatch and its combine (the combine would wait for rows that a
rank masked at the dispatch never got).
"""
from __future__ import annotations

import threading
import time
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist


def _check_update(rank: int, num_ranks: int, rank_to_mask: int, mask: bool) -> None:
    if isinstance(rank_to_mask, bool) or not isinstance(rank_to_mask, int) or not 0 <= rank_to_mask < num_ranks:
        raise ValueError(f"rank_to_mask must be a rank in [0, {num_ranks}), got {rank_to_mask!r}")
    if rank_to_mask == rank and mask:
        raise ValueError(f"rank_to_mask = {rank_to_mask} is this rank; a rank cannot mask itself")


def _check_status(num_ranks: int, mask_status: torch.Tensor) -> None:
    if not isinstance(mask_status, torch.Tensor) or mask_status.dtype != torch.int32 or \
            tuple(mask_status.shape) != (num_ranks,):
        got = (f"{mask_status.dtype} {tuple(mask_status.shape)}" if isinstance(mask_status, torch.Tensor)
               else type(mask_status).__name__)
        raise ValueError(f"mask_status must be an int32 tensor of shape ({num_ranks},), got {got}")


class RankMask:
    """Which ranks this rank's low-latency calls skip (`[num_ranks]` flags, all clear at first)."""

    def __init__(self, rank: int, num_ranks: int) -> None:
        self.rank = rank
        self.num_ranks = num_ranks
        self.masked: List[bool] = [False] * num_ranks
        self.epoch = 0  # masked exchanges since the last clean: the tag that pairs their messages

    def update(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask (mask=True) or unmask `rank_to_mask` for this rank's later low-latency calls."""
        _check_update(self.rank, self.num_ranks, rank_to_mask, mask)
        self.masked[rank_to_mask] = bool(mask)

    def query(self, mask_status: torch.Tensor) -> None:
        """Write the flags into `mask_status`: int32 `[num_ranks]`, 1 where a rank is masked."""
        _check_status(self.num_ranks, mask_status)
        mask_status.copy_(torch.tensor(self.masked, dtype=torch.int32))

    def clean(self) -> None:
        """Unmask every rank and restart the exchange count."""
        self.masked = [False] * self.num_ranks
        self.epoch = 0

    def any(self) -> bool:
        return any(self.masked)

    def expert_is_masked(self, topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
        """bool like `topk_idx`: the entry's expert lives on a masked rank (-1 and out-of-range ids: False)."""
        owner_masked = torch.tensor(self.masked, dtype=torch.bool, device=topk_idx.device)
        num_local_experts = num_experts // self.num_ranks
        valid = (topk_idx >= 0) & (topk_idx < num_experts)
        owner = torch.where(valid, topk_idx // num_local_experts, 0)
        return valid & owner_masked[owner]


class DeviceRankMask:
    """The native backend's mask: `flags`, int32 `[num_ranks]` on `device` (1 = masked), read by the
    low-latency kernels at every call and set by them when a peer misses `timeout_s`."""

    def __init__(self, rank: int, num_ranks: int, device: torch.device) -> None:
        self.rank = rank
        self.num_ranks = num_ranks
        self.flags = torch.zeros(num_ranks, dtype=torch.int32, device=device)

    def update(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask (mask=True) or unmask `rank_to_mask` for this rank's later low-latency calls (current stream)."""
        _check_update(self.rank, self.num_ranks, rank_to_mask, mask)
        self.flags[rank_to_mask] = int(bool(mask))

    def query(self, mask_status: torch.Tensor) -> None:
        """Copy the flags into `mask_status` (int32 `[num_ranks]`, 1 where a rank is masked; current stream)."""
        _check_status(self.num_ranks, mask_status)
        mask_status.copy_(self.flags)

    def clean(self) -> None:
        """Unmask every rank (current stream)."""
        self.flags.zero_()


class MaskedExchange:
    """Point-to-point all-to-all among the unmasked ranks, each receive waited for until `timeout_s`;
    a peer that misses the deadline or whose connection fails is masked and its rows read as zeros."""

    def __init__(self, mask: RankMask, group, timeout_s: float) -> None:
        self.mask = mask
        self.group = group
        self.timeout_s = timeout_s
        self.global_ranks = [dist.get_global_rank(group, r) for r in range(mask.num_ranks)]
        self._abandoned_sends: List[torch.Tensor] = []  # rows of sends to peers masked meanwhile

    def all_to_all(self, send: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int]) -> torch.Tensor:
        """send: [sum(send_counts), B] uint8 rows grouped by destination; returns [sum(recv_counts), B]
        grouped by source. Rows to and from masked ranks are not moved (received ones stay zero)."""
        mask, rank = self.mask, self.mask.rank
        mask.epoch += 1
        tag = mask.epoch
        send_first = _starts(send_counts)
        recv_first = _starts(recv_counts)
        recv = torch.zeros((sum(recv_counts), send.size(1)), dtype=send.dtype, device=send.device)
        recv[recv_first[rank]:recv_first[rank] + recv_counts[rank]] = \
            send[send_first[rank]:send_first[rank] + send_counts[rank]]
        sends, receives = [], []
        for peer in range(mask.num_ranks):
            if peer == rank or mask.masked[peer]:
                continue
            if send_counts[peer] > 0:
                rows = send[send_first[peer]:send_first[peer] + send_counts[peer]].contiguous()
                watch = self._post(dist.isend, rows, peer, tag)
                if watch is None:
                    continue
                sends.append((peer, watch, rows))
            if recv_counts[peer] > 0:
                rows = torch.empty((recv_counts[peer], send.size(1)), dtype=send.dtype, device=send.device)
                watch = self._post(dist.irecv, rows, peer, tag)
                if watch is not None:
                    receives.append((peer, watch, rows))
        deadline = time.monotonic() + self.timeout_s
        for peer, watch, rows in receives:
            if watch.succeeded_by(deadline):
                recv[recv_first[peer]:recv_first[peer] + recv_counts[peer]] = rows
            else:
                mask.masked[peer] = True
        # NOTE: sends too, before returning: a process that ends after this call must not cut them off.
        for peer, watch, rows in sends:
            if not watch.succeeded_by(deadline):
                mask.masked[peer] = True
                self._abandoned_sends.append(rows)  # its tensor must outlive the transfer
        return recv

    def _post(self, transfer, rows: torch.Tensor, peer: int, tag: int) -> Optional["_Watch"]:
        """Post `transfer` (dist.isend or dist.irecv) of `rows` with `peer`, watched; None where posting
        fails (a peer that exited has closed its connection: gloo raises at once), and the peer is masked."""
        try:
            return _Watch(transfer(rows, self.global_ranks[peer], group=self.group, tag=tag))
        except RuntimeError:
            self.mask.masked[peer] = True
            return None


class _Watch:
    """Waits for one send or receive in a thread of its own, from the moment it is posted.

    NOTE: neither polling nor `wait(timeout=)` will do on gloo: its point-to-point works report
    completion only from `wait`, and a wait that times out closes every connection of the process
    group, not just the peer's. A thread left waiting for a masked peer ends when that transfer does
    or the process does.
    """

    def __init__(self, work) -> None:
        self.error: Optional[BaseException] = None
        self.done = threading.Event()
        threading.Thread(target=self._wait, args=(work,), name="ep_plugin-masked-wait", daemon=True).start()

    def _wait(self, work) -> None:
        try:
            work.wait()
        except Exception as error:  # noqa: BLE001 - a lost connection masks the peer
            self.error = error
        self.done.set()

    def succeeded_by(self, deadline: float) -> bool:
        """True if the transfer completes by `deadline` (time.monotonic()), False if not or if it failed."""
        return self.done.wait(max(deadline - time.monotonic(), 0.0)) and self.error is None


def _starts(counts: Sequence[int]) -> List[int]:
    starts, total = [], 0
    for count in counts:
        starts.append(total)
        total += count
    return starts


def exchange_for(backend) -> Optional[MaskedExchange]:
    """The masked exchange of a backend whose Buffer has a RankMask, else None."""
    mask = getattr(backend, "rank_mask", None)
    if mask is None:
        return None
    exchange = getattr(backend, "_masked_exchange", None)
    if exchange is None:
        exchange = backend._masked_exchange = MaskedExchange(mask, backend.info.group, backend.settings.timeout_s)
    return exchange


def masked_entries(backend, topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """bool like `topk_idx`: entries whose expert is on a rank the backend's mask holds (all False without one)."""
    mask = getattr(backend, "rank_mask", None)
    if mask is None or not mask.any():
        return torch.zeros_like(topk_idx, dtype=torch.bool)
    return mask.expert_is_masked(topk_idx, num_experts)


def with_masked_rows(backend, meta: List[List[int]], masked_row: Optional[List[int]]) -> List[List[int]]:
    """`meta` (one row per source rank) with each masked source's row replaced by `masked_row`."""
    mask = getattr(backend, "rank_mask", None)
    if mask is None or masked_row is None:
        return meta
    return [list(masked_row) if mask.masked[src] else row for src, row in enumerate(meta)]


def without_lost_sources(backend, received: torch.Tensor, recv_counts: List[int]):
    """(rows, counts) of a masked exchange without the rows of sources masked while it ran (their rows
    never came: zeros that must not be read as messages)."""
    mask = getattr(backend, "rank_mask", None)
    if mask is None or not any(mask.masked[src] and count > 0 for src, count in enumerate(recv_counts)):
        return received, recv_counts
    keep = torch.cat([torch.full((count,), not mask.masked[src], dtype=torch.bool, device=received.device)
                      for src, count in enumerate(recv_counts)])
    return received[keep], [0 if mask.masked[src] else count for src, count in enumerate(recv_counts)]


def attach(backend, enable_shrink: bool) -> Optional[RankMask]:
    """A Buffer's mask (None without `enable_shrink`), handed to its backend: a RankMask for the
    reference backend, a DeviceRankMask for one with `device_rank_mask` (the native backend).

    Raises NotImplementedError for a backend without masking.
    """
    if not enable_shrink:
        return None
    info = backend.info
    if hasattr(type(backend), "device_rank_mask"):
        backend.device_rank_mask = DeviceRankMask(info.rank, info.num_ranks, info.device)
        return backend.device_rank_mask
    if not hasattr(type(backend), "rank_mask"):
        raise NotImplementedError(f"enable_shrink=True: the {backend.name} backend cannot mask ranks; "
                                  "use backend: reference or native for shrink mode")
    backend.rank_mask = RankMask(info.rank, info.num_ranks)
    return backend.rank_mask
