"""CUDA events wrapped the way DeepEP exposes them (`EventHandle`, `EventOverlap`).

On a CPU-only process (gloo, reference backend) events are `None` and every method is a no-op,
so user code written for DeepEP runs unchanged.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

import torch


class EventHandle:
    """A CUDA event recorded on the current stream at construction (or a no-op on CPU)."""

    def __init__(self, stream: Optional[torch.cuda.Stream] = None) -> None:
        self.event: Optional[torch.cuda.Event] = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.event = torch.cuda.Event()
            self.event.record(stream if stream is not None else torch.cuda.current_stream())

    def current_stream_wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def stream_wait(self, stream: torch.cuda.Stream) -> None:
        if self.event is not None:
            stream.wait_event(self.event)


class EventOverlap:
    """An event plus the tensors that must stay alive until it completes.

    Use `current_stream_wait()` to make the current stream wait for the communication, or the
    `with` form to overlap a block of compute with it (the wait happens when the block exits).
    """

    def __init__(self, event: Optional[EventHandle] = None,
                 extra_tensors: Optional[Iterable[Any]] = None) -> None:
        self.event = event
        self.extra_tensors = tuple(extra_tensors) if extra_tensors is not None else None

    def current_stream_wait(self) -> None:
        if self.event is not None:
            self.event.current_stream_wait()

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        self.current_stream_wait()
