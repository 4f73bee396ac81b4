"""The errors every backend raises when a peer fails: `EpCommError` and its `EpTimeoutError`.

Each names the rank that saw the failure, the peer(s) it waited for, the operation (a Buffer
method's name: "dispatch", "combine", "get_dispatch_layout", "low_latency_dispatch",
"low_latency_combine"), the step inside it and the seconds waited. `device_usable` says whether
this process's CUDA context still works: True after the intranode kernels (normal mode) end early
on an error (the Buffer is then failed: every later call raises the same error; destroy it and create
a new one), False after a low-latency or internode kernel trapped (the process must restart).
`raises_structured_errors` keeps that failed state on a native backend (`failure`).

The native extensions report device failures as text (`describe_device_error` in csrc/): the
backends turn it into these errors with `native_errors` (or `structured_error`); `parse_native_error`
reads the text's fixed format, pinned by tests/test_errors.py against the C++ format strings.
"""
from __future__ import annotations

import contextlib
import re
from typing import Iterable, Iterator, Optional, Sequence, Tuple


class EpCommError(RuntimeError):
    """A dispatch or combine that could not complete because of a peer (or the device).

    Attributes:
        rank: the rank that raised (in the runtime's numbering: a node-local rank for the intranode
            stage of internode mode).
        peers: the ranks it waited for, () where unknown.
        operation: the Buffer method ("dispatch", "combine", ...; "Buffer" for its creation).
        step: the step inside it ("notify", "counts", "rows", "ring space", ...), or "".
        device_usable: False if this process's CUDA context is stopped (a trapped kernel).
        detail: the backend's own description (e.g. the native report with expected/observed counters).
    """

    def __init__(self, rank: int, operation: str, detail: str, peers: Sequence[int] = (), step: str = "",
                 device_usable: bool = True) -> None:
        self.rank = rank
        self.peers = tuple(peers)
        self.operation = operation
        self.step = step
        self.device_usable = device_usable
        self.detail = detail
        super().__init__(self._message())

    @property
    def peer(self) -> Optional[int]:
        """The first peer waited for, or None where unknown."""
        return self.peers[0] if self.peers else None

    def _where(self) -> str:
        step = f" ({self.step} step)" if self.step else ""
        return f"{self.operation}{step}"

    def _peers_text(self) -> str:
        if not self.peers:
            return "an unknown peer"
        return ("peer " if len(self.peers) == 1 else "peers ") + ", ".join(str(p) for p in self.peers)

    def _stopped_note(self) -> str:
        return "" if self.device_usable else " [this process's CUDA context is stopped: restart the process]"

    def _message(self) -> str:
        return (f"ep_plugin: rank {self.rank}: {self._where()} failed ({self._peers_text()}): {self.detail}"
                f"{self._stopped_note()}")

    def _fields(self) -> dict:
        return dict(rank=self.rank, operation=self.operation, detail=self.detail, peers=self.peers, step=self.step,
                    device_usable=self.device_usable)

    def __reduce__(self):
        return _rebuild, (type(self), self._fields())


class EpTimeoutError(EpCommError, TimeoutError):
    """A wait for a peer that passed `timeout_s` (config key `timeout_s`).

    Adds `seconds` (the limit that passed) and, for native kernels, `channel` with `channel_kind`
    ("channel" of a ring, "expert" for low-latency mode, "token" for its expert-side partial sums).
    """

    def __init__(self, rank: int, operation: str, detail: str, peers: Sequence[int] = (), step: str = "",
                 device_usable: bool = True, seconds: float = 0.0, channel: Optional[int] = None,
                 channel_kind: str = "channel") -> None:
        self.seconds = seconds
        self.channel = channel
        self.channel_kind = channel_kind
        super().__init__(rank, operation, detail, peers, step, device_usable)

    def _message(self) -> str:
        where = f", {self.channel_kind} {self.channel}" if self.channel is not None else ""
        return (f"ep_plugin: rank {self.rank}: timeout after {self.seconds:g} s in {self._where()} waiting for "
                f"{self._peers_text()}{where}: {self.detail}{self._stopped_note()}")

    def _fields(self) -> dict:
        return dict(super()._fields(), seconds=self.seconds, channel=self.channel, channel_kind=self.channel_kind)


def _rebuild(cls, fields: dict) -> EpCommError:
    return cls(**fields)


def _again(error: EpCommError) -> EpCommError:
    """A fresh copy of `error` (raising one exception object again would chain its tracebacks)."""
    return _rebuild(type(error), error._fields())


# ---- the native extensions' reports --------------------------------------------------------------
# Prefixes of `check_device_error` (csrc: IntranodeRuntime, LowLatencyRuntime, InternodeRuntime): a kernel
# that "ended early" left with an error (the CUDA context works); one that "stopped" trapped.
_KERNEL_STOPPED = re.compile(r"ep_plugin: (?:a|a low-latency|an internode) kernel (?P<how>stopped|ended early) on rank "
                             r"(?P<rank>-?\d+): (?P<report>.*)", re.S)
# `describe_device_error`'s timeout reports; what follows "peer N" names the channel, expert or token.
_DEVICE_TIMEOUT = re.compile(
    r"timeout in (?P<op>.+?) after (?P<seconds>[-+0-9.eE]+) s: rank (?P<rank>-?\d+) waited for peer (?P<peer>-?\d+)"
    r"(?:'s partial sum for (?P<token_kind>token) (?P<token>-?\d+)"
    r"| \((?P<channel_kind>channel|expert) (?P<channel>-?\d+), warp -?\d+\) for (?P<wait>[^;]+))", re.S)
# The host's notify wait (`wait_notify`), raised as TimeoutError.
_HOST_NOTIFY_TIMEOUT = re.compile(r"rank (?P<rank>-?\d+): the notify step of (?P<op>dispatch|internode dispatch) did "
                                  r"not finish within (?P<seconds>[-+0-9.eE]+) s", re.S)

# `op_name` of csrc -> (operation, step).
_NATIVE_OPERATIONS = {
    "dispatch (notify step)": ("dispatch", "notify"),
    "dispatch": ("dispatch", ""),
    "combine": ("combine", ""),
    "get_dispatch_layout": ("get_dispatch_layout", ""),
    "low_latency_dispatch": ("low_latency_dispatch", ""),
    "low_latency_combine": ("low_latency_combine", ""),
    "the notify step of internode dispatch": ("dispatch", "internode notify"),
    "internode dispatch (network leg)": ("dispatch", "network leg"),
    "internode combine (network leg)": ("combine", "network leg"),
}


def _native_operation(op_text: str, wait: str) -> Tuple[str, str]:
    """(operation, step) of a report: the op's own step if it names one, else what was awaited."""
    operation, step = _NATIVE_OPERATIONS.get(op_text, (op_text, ""))
    if not step and wait:
        step = wait.split(" (")[0].strip()  # "ring space (the peer is not consuming)" -> "ring space"
    return operation, step


def parse_native_error(message: str, operation: str = "") -> Optional[EpCommError]:
    """The structured error for a native extension's message, or None if it is not one of its reports.

    Timeouts (device or host) become `EpTimeoutError`; other device reports (an expert id out of
    range, ranks that disagree on a layout, too many tokens) an `EpCommError`. A report from a
    stopped (trapped) kernel means the CUDA context is stopped (`device_usable=False`); from a kernel
    that ended early, it works. `operation` names the Buffer method where the report does not.
    """
    stopped = _KERNEL_STOPPED.search(message)
    host = _HOST_NOTIFY_TIMEOUT.search(message)
    if host and not stopped:
        op, step = ("dispatch", "internode notify") if host["op"] == "internode dispatch" else ("dispatch", "notify")
        return EpTimeoutError(int(host["rank"]), op, message.strip(), (), step, device_usable=True,
                              seconds=float(host["seconds"]))
    if not stopped:
        return None
    report = stopped["report"].strip()
    usable = stopped["how"] == "ended early"
    timeout = _DEVICE_TIMEOUT.match(report)
    if timeout is None:
        return EpCommError(int(stopped["rank"]), operation or "an ep_plugin kernel", report, device_usable=usable)
    op, step = _native_operation(timeout["op"], timeout["wait"] or "")
    if timeout["token"] is not None:
        channel, kind, step = int(timeout["token"]), "token", step or "partial sums"
    else:
        channel, kind = int(timeout["channel"]), timeout["channel_kind"]
    return EpTimeoutError(int(timeout["rank"]), op, report, (int(timeout["peer"]),), step, device_usable=usable,
                          seconds=float(timeout["seconds"]), channel=channel, channel_kind=kind)


def structured_error(error: BaseException, runtimes: Iterable[object] = (), operation: str = "") -> BaseException:
    """`error` as an `EpCommError` where a native report explains it, else `error` itself.

    A trapped kernel often surfaces as a bare CUDA error (in torch or the extension) before its report
    is read: each runtime's `check_device_error()` then raises the report that explains it.
    """
    if isinstance(error, EpCommError):
        return error
    parsed = parse_native_error(str(error), operation)
    if parsed is not None:
        return parsed
    return device_failure(runtimes, operation) or error


def device_failure(runtimes: Iterable[object], operation: str = "") -> Optional[EpCommError]:
    """The structured report of the first runtime whose kernels recorded an error, else None."""
    for runtime in runtimes:
        try:
            runtime.check_device_error()
        except Exception as report:  # noqa: BLE001 - the report is the point
            parsed = parse_native_error(str(report), operation)
            if parsed is not None:
                return parsed
    return None


@contextlib.contextmanager
def native_errors(runtimes: Iterable[object], operation: str = "") -> Iterator[None]:
    """Raise failures inside the block as `EpCommError`/`EpTimeoutError` where a native report explains them.

    Usage: `with native_errors([self._runtime, self._ll], "dispatch"): ...` (None entries are skipped).
    """
    try:
        yield
    except Exception as error:
        translated = structured_error(error, [r for r in runtimes if r is not None], operation)
        if translated is error:
            raise
        raise translated from error


# Backend methods that run kernels (the Backend contract of backends/base.py).
_BACKEND_OPERATIONS = ("get_dispatch_layout", "dispatch", "cached_dispatch", "combine", "low_latency_dispatch",
                       "low_latency_combine", "clean_low_latency_buffer")
# Eager fast paths that may fail after their first launch, by the operation their errors name.
_FAST_PATH_OPERATIONS = {"unchecked_dispatch": "dispatch", "unchecked_cached_dispatch": "cached_dispatch",
                         "unchecked_combine": "combine"}


def runtimes_of(backend: object) -> list:
    """The native runtimes a backend holds: its attributes that answer `check_device_error`."""
    return [value for value in vars(backend).values() if hasattr(value, "check_device_error")]


def _translating(method, operation: str):
    # NOTE: a plain try (no context manager, runtimes looked up only on failure): this wraps every
    # native call, whose host overhead is a few microseconds.
    hook_results = operation.startswith("low_latency_")

    def call(self, *args, **kwargs):
        if self.failure is not None:
            raise _again(self.failure)
        try:
            result = method(self, *args, **kwargs)
        except Exception as error:
            translated = structured_error(error, runtimes_of(self), operation)
            if isinstance(translated, EpCommError):
                self.failure = translated
            if translated is error:
                raise
            raise translated from error
        if hook_results and isinstance(result, tuple) and callable(result[-1]):
            result = (*result[:-1], _translating_hook(result[-1], runtimes_of(self), operation))
        return result

    call.__name__, call.__qualname__, call.__doc__ = method.__name__, method.__qualname__, method.__doc__
    call.__wrapped__ = method
    return call


def _translating_hook(hook, runtimes: list, operation: str):
    def receive() -> None:
        with native_errors(runtimes, operation):
            hook()

    return receive


def raises_structured_errors(cls):
    """Class decorator for a native backend: its kernel-running methods (and receive hooks) raise
    `EpCommError`/`EpTimeoutError` where a runtime's device report explains a failure.

    The first such error of a method fails the backend: it is kept in the instance's `failure` (None
    while the backend works), and every later kernel-running method raises a copy of it before it runs
    anything (the rings' counters are not trusted after a kernel ended early). Bad input (ValueError)
    does not fail it.
    """
    cls.failure = None
    for name, operation in [*((operation, operation) for operation in _BACKEND_OPERATIONS),
                            *_FAST_PATH_OPERATIONS.items()]:
        # NOTE: inherited methods too: a backend class gathers its modes' methods from mixins.
        method = getattr(cls, name, None)
        if method is not None:
            setattr(cls, name, _translating(method, operation))
    return cls
