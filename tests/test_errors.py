"""The structured errors (ep_plugin/errors.py) against the native extensions' report formats.

The reports are rendered from the C++ sources themselves (each `out << ... ;` chain of
`describe_device_error`, each `op_name` and `wait_name` entry), so a changed format fails here
instead of silently falling back to a bare RuntimeError.
"""
from __future__ import annotations

import pathlib
import pickle
import re
from typing import Dict, List

import pytest

from ep_plugin import EpCommError, EpTimeoutError
from ep_plugin.errors import native_errors, parse_native_error, raises_structured_errors, structured_error

CSRC = pathlib.Path(__file__).resolve().parents[1] / "csrc"
SOURCES = "\n".join(path.read_text() for path in sorted(CSRC.rglob("*")) if path.suffix in (".cu", ".cpp", ".h", ".cuh"))

# Values of the report's fields in the rendered messages.
FIELDS = {"timeout_s_": "2.5", "s.error_rank": "0", "s.error_peer": "1", "s.error_channel": "3", "s.error_warp": "5",
          "s.error_expected": "7", "s.error_observed": "2", "rank_": "0", "place_.rank": "0"}


def statements(body: str) -> List[str]:
    """The statements of a C++ body, split at semicolons outside string literals."""
    out, current, in_string, escaped = [], [], False, False
    for char in body:
        current.append(char)
        if in_string:
            in_string = not (char == '"' and not escaped)
            escaped = char == "\\" and not escaped
        elif char == '"':
            in_string = True
        elif char == ";":
            out.append("".join(current).strip())
            current = []
    return out


def render(chain: str, values: Dict[str, str], separator: str) -> str:
    """A `<<` or `+` chain of literals and expressions, with each expression looked up in `values`."""
    parts = re.findall(r'"(?:[^"\\]|\\.)*"|[^"]+', chain)
    pieces = []
    for part in parts:
        if part.startswith('"'):
            pieces.append(part[1:-1].encode().decode("unicode_escape"))
            continue
        for expression in part.split(separator):
            expression = expression.strip()
            if expression:
                assert expression in values, f"an expression the test does not know in a report: {expression!r}"
                pieces.append(values[expression])
    return "".join(pieces)


def function_body(qualified: str) -> str:
    match = re.search(re.escape(qualified) + r"\([^)]*\)[^{]*\{(.*?)\n\}", SOURCES, re.S)
    assert match, f"{qualified} not found in csrc/"
    return match.group(1)


def switch_names(function: str) -> List[str]:
    """Every name a `const char* function(int)` switch of csrc returns."""
    names = []
    for body in re.findall(r"const char\* " + function + r"\(int \w+\) \{(.*?)\n\}", SOURCES, re.S):
        names += re.findall(r'return "([^"]+)";', body)
    assert names, function
    return names


def timeout_chains(runtime: str) -> List[str]:
    """The `out << "timeout in " ...` chains of one runtime's describe_device_error."""
    start = 'out << "timeout in "'
    chains = [s[s.index(start) + len("out << "):].rstrip(";")
              for s in statements(function_body(f"{runtime}::describe_device_error")) if start in s]
    assert chains, runtime
    return chains


def stopped_prefix(runtime: str, report: str) -> str:
    """The message of `runtime::check_device_error` around `report`."""
    throw = [s for s in statements(function_body(f"{runtime}::check_device_error")) if "throw Error(" in s]
    assert len(throw) == 1, runtime
    chain = throw[0].split("throw Error(", 1)[1].rsplit(")", 1)[0]
    values = dict(FIELDS, **{"std::to_string(rank_)": "0", "std::to_string(place_.rank)": "0",
                             "describe_device_error()": report})
    return render(chain, values, "+")


def rendered_timeouts(runtime: str, ops: List[str], waits: List[str]) -> List[str]:
    messages = []
    for chain in timeout_chains(runtime):
        for op in ops:
            for wait in waits:
                values = dict(FIELDS, **{"op_name(s.error_op)": op, "wait_name(s.error_wait_kind)": wait, "what": wait})
                messages.append(stopped_prefix(runtime, render(chain, values, "<<")))
    return messages


INTRANODE_OPS = ["dispatch (notify step)", "dispatch", "combine", "get_dispatch_layout"]


def test_every_native_op_name_maps_to_a_buffer_method():
    from ep_plugin.errors import _NATIVE_OPERATIONS
    for name in switch_names("op_name"):
        if name.startswith("a") and "kernel" in name:  # the default of each switch
            continue
        assert name in _NATIVE_OPERATIONS, f"csrc op_name {name!r} is unknown to ep_plugin/errors.py"


def test_intranode_device_timeouts_parse_to_every_field():
    waits = switch_names("wait_name")
    for message in rendered_timeouts("IntranodeRuntime", INTRANODE_OPS, waits):
        error = parse_native_error(message)
        assert isinstance(error, EpTimeoutError), message
        assert (error.rank, error.peers, error.seconds, error.channel, error.channel_kind) == (0, (1,), 2.5, 3,
                                                                                             "channel"), message
        assert error.operation in ("dispatch", "combine", "get_dispatch_layout") and error.step, message
        assert error.device_usable is True  # the intranode kernels end early: no trap
        assert "restart the process" not in str(error)
        assert "peer 1" in str(error) and "2.5 s" in str(error) and "expected 7, observed 2" in str(error)
    notify = parse_native_error(rendered_timeouts("IntranodeRuntime", ["dispatch (notify step)"], waits[:1])[0])
    assert (notify.operation, notify.step) == ("dispatch", "notify")


def test_low_latency_device_timeouts_parse_to_every_field():
    messages = rendered_timeouts("LowLatencyRuntime", ["low_latency_dispatch", "low_latency_combine"], ["-"])
    kinds = set()
    for message in messages:
        error = parse_native_error(message)
        assert isinstance(error, EpTimeoutError), message
        assert (error.rank, error.peer, error.seconds, error.channel) == (0, 1, 2.5, 3), message
        assert error.operation.startswith("low_latency_") and error.step, message
        assert error.device_usable is False and "restart the process" in str(error)  # NVSHMEM kernels trap
        kinds.add(error.channel_kind)
    assert kinds == {"expert", "token"}  # per-expert messages; expert-side partial sums per token


def test_internode_device_timeouts_parse_to_every_field():
    whats = re.findall(r'"([^"]+)"', re.search(r"const char\* what = (.*?);",
                                               function_body("InternodeRuntime::describe_device_error"), re.S)[1])
    ops = ["the notify step of internode dispatch", "internode dispatch (network leg)", "internode combine (network leg)"]
    for message in rendered_timeouts("InternodeRuntime", ops, whats):
        error = parse_native_error(message)
        assert isinstance(error, EpTimeoutError), message
        assert (error.rank, error.peer, error.channel) == (0, 1, 3) and error.operation in ("dispatch", "combine")
        assert error.step in ("internode notify", "network leg"), message


def test_host_notify_timeouts_parse():
    for runtime_file_chain in re.findall(r'out << ("rank " << (?:rank_|place_\.rank) << ": the notify step of .*?);',
                                         SOURCES, re.S):
        message = render(runtime_file_chain, FIELDS, "<<")
        error = parse_native_error(message)
        assert isinstance(error, EpTimeoutError) and error.device_usable, message
        assert (error.rank, error.peers, error.seconds, error.operation) == (0, (), 2.5, "dispatch"), message
        assert "notify" in error.step


def test_other_device_reports_are_comm_errors_and_plain_errors_pass_through():
    report = stopped_prefix("IntranodeRuntime", "rank 1 passed an expert id out of range (token 3, id 99)")
    error = parse_native_error(report, "dispatch")
    assert type(error) is EpCommError and error.operation == "dispatch" and error.device_usable
    assert "expert id out of range" in str(error)
    trapped = parse_native_error(stopped_prefix("InternodeRuntime", "device error code 7"), "combine")
    assert type(trapped) is EpCommError and not trapped.device_usable
    assert parse_native_error("CUDA error: out of memory") is None
    plain = ValueError("x must be bf16")
    assert structured_error(plain) is plain


class _StoppedRuntime:
    """A runtime whose device report explains an unrelated-looking CUDA error."""

    def __init__(self, report: str) -> None:
        self.report = report

    def check_device_error(self) -> None:
        raise RuntimeError(self.report)


def test_a_bare_cuda_error_is_explained_by_the_runtimes_report():
    report = rendered_timeouts("LowLatencyRuntime", ["low_latency_combine"], ["-"])[-1]
    with pytest.raises(EpTimeoutError) as caught:
        with native_errors([None, _StoppedRuntime(report)], "low_latency_combine"):
            raise RuntimeError("CUDA error: unspecified launch failure")
    assert caught.value.peer == 1 and isinstance(caught.value.__cause__, RuntimeError)
    assert isinstance(caught.value, TimeoutError) and isinstance(caught.value, RuntimeError)


def test_decorated_backend_methods_and_hooks_raise_structured_errors():
    report = rendered_timeouts("LowLatencyRuntime", ["low_latency_dispatch"], ["-"])[0]

    @raises_structured_errors
    class Backend:
        def __init__(self):
            self._ll = _StoppedRuntime(report)

        def low_latency_dispatch(self):
            """Docstring kept."""
            def hook():
                raise RuntimeError("CUDA error: an illegal instruction was encountered")
            return "recv_x", "count", "handle", hook

        def combine(self):
            raise RuntimeError("CUDA error: unspecified launch failure")

    backend = Backend()
    *_, hook = backend.low_latency_dispatch()
    assert Backend.low_latency_dispatch.__doc__ == "Docstring kept."
    with pytest.raises(EpTimeoutError, match="low_latency_dispatch"):
        hook()
    with pytest.raises(EpTimeoutError):
        backend.combine()


def test_the_native_backend_translates_every_kernel_running_method_its_modes_define():
    from ep_plugin.backends.native import NativeBackend
    from ep_plugin.errors import _BACKEND_OPERATIONS

    for operation in _BACKEND_OPERATIONS:
        method = getattr(NativeBackend, operation)
        assert hasattr(method, "__wrapped__") and not hasattr(method.__wrapped__, "__wrapped__"), operation


def test_methods_a_decorated_backend_inherits_raise_structured_errors():
    report = rendered_timeouts("LowLatencyRuntime", ["low_latency_dispatch"], ["-"])[0]

    class Mode:
        def low_latency_dispatch(self):
            self._ll.check_device_error()

    @raises_structured_errors
    class Backend(Mode):
        def __init__(self):
            self._ll = _StoppedRuntime(report)

    backend = Backend()
    with pytest.raises(EpTimeoutError, match="low_latency_dispatch"):
        backend.low_latency_dispatch()
    assert isinstance(backend.failure, EpTimeoutError)
    assert Mode.low_latency_dispatch is not Backend.low_latency_dispatch  # the mixin itself stays as it is


def test_errors_survive_pickling():
    error = EpTimeoutError(2, "dispatch", "detail", (0, 3), "counts", seconds=4.0)
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.rank, copy.peers, copy.step, copy.seconds, str(copy)) == (2, (0, 3), "counts", 4.0, str(error))
    assert "peers 0, 3" in str(copy)


# ---- a failed backend ---------------------------------------------------------------------------
class _FakeRuntime:
    """Stands in for a native runtime: `check_device_error` raises the rendered report once `report` is set
    (the device's record in host-mapped memory), as IntranodeRuntime does before each launch."""

    def __init__(self) -> None:
        self.report = ""
        self.destroyed = False

    def check_device_error(self) -> None:
        if self.report:
            raise RuntimeError(self.report)

    def destroy(self) -> None:
        self.destroyed = True


def intranode_timeout_report() -> str:
    """IntranodeRuntime's report of rank 0's combine that waited for peer 1."""
    return rendered_timeouts("IntranodeRuntime", ["combine"], switch_names("wait_name")[:1])[0]


@raises_structured_errors
class _FakeBackend:
    """A native backend's kernel-running methods over a _FakeRuntime; `calls` counts the bodies that ran."""

    def __init__(self) -> None:
        self._runtime = _FakeRuntime()
        self.calls = 0

    def _launch(self) -> str:
        self.calls += 1
        self._runtime.check_device_error()
        return "launched"

    def dispatch(self):
        return self._launch()

    def combine(self):
        return self._launch()

    def get_dispatch_layout(self):
        return self._launch()

    def low_latency_dispatch(self):
        self.calls += 1
        return "no runtime check"

    def cached_dispatch(self, bad: bool):
        self.calls += 1
        if bad:
            raise ValueError("x must be bf16")
        return "launched"


def test_a_kernel_that_ended_early_fails_the_backend_and_every_later_call_raises_its_error():
    backend = _FakeBackend()
    assert backend.failure is None and backend.dispatch() == "launched"
    backend._runtime.report = intranode_timeout_report()  # a kernel of the call above ended early
    with pytest.raises(EpTimeoutError) as first:
        backend.combine()
    error = first.value
    assert (error.rank, error.peer, error.operation, error.device_usable) == (0, 1, "combine", True)
    assert backend.failure is not None and str(backend.failure) == str(error)
    calls = backend.calls
    for method in (backend.dispatch, backend.combine, backend.get_dispatch_layout, backend.low_latency_dispatch,
                   lambda: backend.cached_dispatch(False)):
        with pytest.raises(EpTimeoutError) as later:
            method()
        assert str(later.value) == str(error) and later.value is not error
        assert later.value.device_usable and later.value.seconds == error.seconds
    assert backend.calls == calls  # no method body ran (no kernel is launched on a failed Buffer)


def test_bad_input_does_not_fail_the_backend():
    backend = _FakeBackend()
    with pytest.raises(ValueError, match="bf16"):
        backend.cached_dispatch(True)
    assert backend.failure is None and backend.cached_dispatch(False) == "launched"


def test_destroying_a_failed_native_backend_waits_for_no_peer(monkeypatch):
    from types import SimpleNamespace

    from ep_plugin.backends import native

    barriers = []
    monkeypatch.setattr(native.torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(native.dist, "barrier", lambda group=None: barriers.append(group))

    def backend_with(report: str):
        backend = object.__new__(native.NativeBackend)
        backend.info = SimpleNamespace(device="cuda:0", group="the group")
        backend._runtime, backend._net, backend._ll = _FakeRuntime(), None, None
        backend._layout_calls = {}
        backend._runtime.report = report
        return backend

    healthy = backend_with("")
    healthy.destroy(collective=True)
    assert barriers == ["the group"] and healthy._runtime.destroyed and healthy.failure is None
    # The device recorded an error that no call has raised yet: destroy finds it and skips the barrier.
    failed = backend_with(intranode_timeout_report())
    failed.destroy(collective=True)
    assert barriers == ["the group"] and failed._runtime.destroyed
    assert isinstance(failed.failure, EpTimeoutError) and failed.failure.peer == 1
