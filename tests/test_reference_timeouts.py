"""The reference backend honours `timeout_s` (ep_plugin/backends/waits.py): 2 gloo ranks on the CPU.

A rank that never makes a call, or never creates its Buffer: the other raises EpTimeoutError within
timeout_s + a few seconds, naming it. A rank that exits: the other raises EpCommError naming it. A rank that stalls past the
timeout and then makes its call: it raises EpCommError at once (its peer gave the call up), with
no collective left half-paired. Ranks that raised end with `finish_rank` (their process group holds
an abandoned collective, which would block its teardown).
"""
from __future__ import annotations

import time

import pytest
import torch

import ep_plugin
from ep_plugin.launch import finish_rank, parallel_launch

TIMEOUT_S = 2.0
SLACK_S = 4.0  # polling, the store's answers, a loaded CI machine
H, K, E, T = 64, 2, 8, 16


def make_buffer(group, low_latency: bool) -> ep_plugin.Buffer:
    return ep_plugin.Buffer(group, low_latency_mode=low_latency,
                            config={"backend": "reference", "timeout_s": TIMEOUT_S})


def make_inputs(rank: int):
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(T, H, generator=generator).to(torch.bfloat16)
    topk_idx = torch.stack([torch.randperm(E, generator=generator)[:K] for _ in range(T)])
    return x, topk_idx, torch.rand(T, K, generator=generator)


def dispatch(buffer: ep_plugin.Buffer, rank: int, low_latency: bool):
    """One dispatch of random data; returns what its combine needs."""
    x, topk_idx, weights = make_inputs(rank)
    if low_latency:
        recv_x, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=False)
        return recv_x, handle, topk_idx, weights
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, E)
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                 num_tokens_per_expert=per_expert, topk_idx=topk_idx,
                                                 topk_weights=weights)
    return recv_x, handle, topk_idx, weights


def combine(buffer: ep_plugin.Buffer, low_latency: bool, dispatched) -> None:
    recv_x, handle, topk_idx, weights = dispatched
    if low_latency:
        buffer.low_latency_combine(recv_x, topk_idx, weights, handle)
    else:
        buffer.combine(recv_x, handle)


def error_facts(error: BaseException, started: float) -> dict:
    return dict(type=type(error).__name__, timeout=isinstance(error, ep_plugin.EpTimeoutError),
                comm=isinstance(error, ep_plugin.EpCommError), peers=getattr(error, "peers", None),
                operation=getattr(error, "operation", None), step=getattr(error, "step", None),
                seconds=time.monotonic() - started, message=str(error))


def fault_rank(rank: int, world: int, group, fault: str, low_latency: bool, stage: str):
    """Rank 1 misbehaves (`fault`) at `stage` ("dispatch" or "combine"); rank 0 reports what it saw."""
    buffer = make_buffer(group, low_latency)
    dispatched = dispatch(buffer, rank, low_latency) if stage == "combine" else None  # every rank finishes it
    if rank == 1:
        if fault == "exits":
            finish_rank("exited")  # ends the process: its connections close
        time.sleep(TIMEOUT_S + 2.0)
        if fault == "absent":
            finish_rank("absent")
    started = time.monotonic()
    try:
        if stage == "combine":
            combine(buffer, low_latency, dispatched)
        else:
            dispatch(buffer, rank, low_latency)
    except Exception as error:  # noqa: BLE001 - the error is the result
        finish_rank(error_facts(error, started))
    finish_rank({"type": None, "seconds": time.monotonic() - started})


@pytest.mark.parametrize("low_latency", [False, True], ids=["normal", "low_latency"])
@pytest.mark.parametrize("stage", ["dispatch", "combine"])
def test_a_rank_that_never_calls_is_named_within_the_timeout(low_latency, stage):
    survivor, absent = parallel_launch(2, fault_rank, "absent", low_latency, stage, backend="gloo", timeout_s=60)
    assert absent == "absent"
    assert survivor["timeout"] and survivor["peers"] == (1,), survivor
    assert survivor["operation"] == (f"low_latency_{stage}" if low_latency else stage), survivor
    assert survivor["step"] in ("counts", "rows"), survivor
    assert TIMEOUT_S <= survivor["seconds"] < TIMEOUT_S + SLACK_S, survivor
    assert "peer 1" in survivor["message"] and "timeout after 2 s" in survivor["message"], survivor


@pytest.mark.parametrize("low_latency", [False, True], ids=["normal", "low_latency"])
def test_a_rank_that_exits_is_named(low_latency):
    survivor, exited = parallel_launch(2, fault_rank, "exits", low_latency, "dispatch", backend="gloo", timeout_s=60)
    assert exited == "exited"
    assert survivor["comm"] and survivor["peers"] == (1,), survivor
    assert survivor["seconds"] < TIMEOUT_S + SLACK_S, survivor


def test_a_rank_that_stalls_past_the_timeout_fails_at_once_when_it_returns():
    survivor, staller = parallel_launch(2, fault_rank, "stalls", False, "dispatch", backend="gloo", timeout_s=60)
    assert survivor["timeout"] and survivor["peers"] == (1,), survivor
    # The staller's dispatch finds its peer gave the call up: a clear error, no half-paired collective.
    assert staller["comm"] and not staller["timeout"] and staller["peers"] == (0,), staller
    assert staller["seconds"] < 1.0 and "gave up call" in staller["message"], staller


def healthy_rank(rank: int, world: int, group):
    buffer = make_buffer(group, False)
    for _ in range(3):
        combine(buffer, False, dispatch(buffer, rank, False))
    return buffer._backend.waits.call


def test_healthy_calls_are_counted_and_pass():
    assert parallel_launch(2, healthy_rank, backend="gloo", timeout_s=60) == [6, 6]


def creation_rank(rank: int, world: int, group, low_latency: bool):
    """Rank 1 never creates its Buffer; rank 0 reports what creating its own did."""
    if rank == 1:
        time.sleep(TIMEOUT_S + 2.0)
        finish_rank("absent")
    started = time.monotonic()
    try:
        make_buffer(group, low_latency)
    except Exception as error:  # noqa: BLE001 - the error is the result
        finish_rank(error_facts(error, started))
    finish_rank({"type": None, "seconds": time.monotonic() - started})


@pytest.mark.parametrize("low_latency", [False, True], ids=["normal", "low_latency"])
def test_a_rank_that_never_creates_its_buffer_is_named_within_the_timeout(low_latency):
    survivor, absent = parallel_launch(2, creation_rank, low_latency, backend="gloo", timeout_s=60)
    assert absent == "absent"
    assert survivor["timeout"] and survivor["peers"] == (1,) and survivor["operation"] == "Buffer", survivor
    assert TIMEOUT_S <= survivor["seconds"] < TIMEOUT_S + SLACK_S, survivor
    assert "did not create their Buffer" in survivor["message"], survivor
