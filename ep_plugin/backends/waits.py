"""Deadlines on the reference backend's collectives: no rank waits longer than `timeout_s`.

Each collective is issued with `async_op=True` and polled until it completes or `timeout_s` passes;
then the rank raises `EpTimeoutError` naming the peers that had not reached the same call. To name
them, each rank marks its call count in the process group's store as it starts an operation
(`arrived/<rank>`): a peer whose mark is behind never arrived.

A timed-out collective stays pending in the process group, so the group's collectives are out of
step from then on: the rank that timed out writes `abandoned` to the store, and every later call
on any rank of this Buffer raises `EpCommError` at once instead of pairing with the abandoned one.
Recovery needs a new process group (and Buffer). The abandoned collective also blocks the process
group's teardown until the group's own timeout: end such a process with `os._exit`
(`launch.finish_rank` in spawned ranks) or give `init_process_group` a short timeout as a backstop.
"""
from __future__ import annotations

import functools
import time
from typing import List, Optional, Tuple

import torch.distributed as dist

from ..errors import EpCommError, EpTimeoutError

# Backend methods that start an operation, and the Buffer method each belongs to.
_OPERATIONS = {"dispatch": "dispatch", "cached_dispatch": "dispatch", "combine": "combine",
               "low_latency_dispatch": "low_latency_dispatch", "low_latency_combine": "low_latency_combine"}
_MAX_POLL_S = 1e-3  # the longest sleep between two polls of a pending collective

def _group_store(group) -> Optional[dist.Store]:
    """The process group's store, or None where torch does not expose it."""
    try:
        return dist.distributed_c10d._get_process_group_store(group)
    except Exception:  # noqa: BLE001 - marks are a diagnosis; without a store peers are "unknown"
        return None


class CollectiveWaits:
    """The deadline and arrival marks of one backend's collectives; see the module docstring."""

    def __init__(self, group, rank: int, num_ranks: int, timeout_s: float) -> None:
        self.group, self.rank, self.num_ranks, self.timeout_s = group, rank, num_ranks, timeout_s
        self.store = _group_store(group)
        # The Buffer's number in its group (join_group counted it): each Buffer's marks stay apart.
        serial = self.store.add(_created_key(rank), 0) if self.store is not None else 0
        self.prefix = f"ep_plugin/waits/{serial}"
        self.call = 0
        self.operation = ""
        self.failure: Optional[EpCommError] = None

    # ---- store marks ----------------------------------------------------------------------------
    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def _peer_call(self, peer: int) -> int:
        """The last call count `peer` marked (0: none yet)."""
        key = self._key(f"arrived/{peer}")
        return int(self.store.get(key)) if self.store.check([key]) else 0

    def _absent_peers(self) -> Tuple[int, ...]:
        """Peers that have not started this call (by their marks); () where the store cannot tell."""
        if self.store is None:
            return ()
        try:
            return tuple(p for p in range(self.num_ranks) if p != self.rank and self._peer_call(p) < self.call)
        except Exception:  # noqa: BLE001 - a store that went away: peers unknown
            return ()

    def _abandoned(self) -> Optional[str]:
        """'<rank>:<call>' of the first rank that abandoned a call of this Buffer, or None."""
        key = self._key("abandoned")
        if self.store is None or not self.store.check([key]):
            return None
        return self.store.get(key).decode()

    # ---- operations -------------------------------------------------------------------------------
    def begin(self, operation: str) -> None:
        """Start an operation: raise if this Buffer's collectives are out of step, else mark the arrival."""
        if self.failure is not None:
            raise EpCommError(self.rank, operation, "an earlier call failed and left the group's collectives out of "
                              f"step ({self.failure}); create a new process group and Buffer",
                              self.failure.peers, device_usable=True)
        abandoned = self._abandoned()
        if abandoned is not None:
            peer, call = (int(v) for v in abandoned.split(":"))
            self.failure = EpCommError(self.rank, operation, f"rank {peer} gave up call {call} of this Buffer after a "
                                       "timeout; the group's collectives are out of step: create a new process "
                                       "group and Buffer", (peer,), device_usable=True)
            raise self.failure
        self.call += 1
        self.operation = operation
        if self.store is not None:
            self.store.set(self._key(f"arrived/{self.rank}"), str(self.call))

    def wait(self, work, step: str) -> None:
        """Wait for `work` (an async collective) until `timeout_s`; raise EpTimeoutError / EpCommError."""
        deadline = time.monotonic() + self.timeout_s
        delay = 0.0
        while not work.is_completed():
            if time.monotonic() > deadline:
                self._fail_timeout(step)
            time.sleep(delay)
            delay = min(max(2 * delay, 1e-5), _MAX_POLL_S)
        try:
            work.wait()
        except Exception as error:  # noqa: BLE001 - a peer's connection lost, an aborted group
            self.failure = EpCommError(self.rank, self.operation, f"{type(error).__name__}: {error}",
                                       self._absent_peers(), step, device_usable=True)
            raise self.failure from error

    def _fail_timeout(self, step: str) -> None:
        self.failure = EpTimeoutError(self.rank, self.operation, "the peers named did not reach the same call (every "
                                      "rank must make the same sequence of ep_plugin calls)", self._absent_peers(),
                                      step, device_usable=True, seconds=self.timeout_s)
        if self.store is not None:
            try:
                self.store.compare_set(self._key("abandoned"), "", f"{self.rank}:{self.call}")
            except Exception:  # noqa: BLE001 - the error below says what matters
                pass
        raise self.failure

    def all_to_all_single(self, output, input, output_split_sizes: List[int], input_split_sizes: List[int],
                          step: str) -> None:
        """`dist.all_to_all_single` on the group, waited for with the deadline."""
        work = dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=self.group,
                                      async_op=True)
        self.wait(work, step)


def _created_key(rank: int) -> str:
    """The store key counting the Buffers `rank` has created over the store's group."""
    return f"ep_plugin/buffers_created/{rank}"


def join_group(group, rank: int, num_ranks: int, timeout_s: float) -> None:
    """Wait until every rank of `group` has started creating its Buffer, at most `timeout_s`.

    Creating a Buffer is a collective (topology discovery, the native backends' handle exchange), and
    a collective has no deadline of its own: ranks whose peer never creates its Buffer would wait for
    the process group's own timeout. Each rank counts its Buffers in the group's store and waits until
    every peer's count has reached its own; the ranks behind at the deadline are named in
    EpTimeoutError. The counts live in the group's store only (a new group, e.g. one that takes in a
    restarted rank, starts them afresh on every rank). Without a store nothing is waited for here.
    """
    store = _group_store(group)
    if store is None:
        return
    keys = [_created_key(r) for r in range(num_ranks)]
    mine = store.add(keys[rank], 1)  # also the Buffer's number for CollectiveWaits
    deadline = time.monotonic() + timeout_s
    delay = 0.0
    while True:
        behind = tuple(r for r in range(num_ranks) if r != rank and store.add(keys[r], 0) < mine)
        if not behind:
            return
        if time.monotonic() > deadline:
            raise EpTimeoutError(rank, "Buffer", "the peers named did not create their Buffer (every rank of "
                                 "the group creates it)", behind, device_usable=True, seconds=timeout_s)
        time.sleep(delay)
        delay = min(max(2 * delay, 1e-4), 10 * _MAX_POLL_S)


def honours_timeouts(cls):
    """Class decorator for a backend over torch.distributed: gives it `self.waits` (a CollectiveWaits over
    its group with the config's `timeout_s`) and starts each operation with `waits.begin`."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, info, settings, *args, **kwargs):
        init(self, info, settings, *args, **kwargs)
        self.waits = CollectiveWaits(info.group, info.rank, info.num_ranks, settings.timeout_s)

    cls.__init__ = __init__
    for method_name, operation in _OPERATIONS.items():
        method = cls.__dict__.get(method_name)
        if method is not None:
            setattr(cls, method_name, _starting(method, operation))
    return cls


def _starting(method, operation: str):
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        self.waits.begin(operation)
        return method(self, *args, **kwargs)

    return call

