"""parallel_launch: results by rank, a failing rank's traceback, a rank that dies without a result."""
import os
import signal
import time

import pytest

import torch

from ep_plugin.launch import RANKS_PER_GPU_ENV, finish_rank, gpus_shared_by_ranks, parallel_launch, rank_device, rank_slots


def rank_value(rank: int, world_size: int, group) -> tuple:
    return rank, world_size, group.size()


def rank_that_raises(rank: int, world_size: int, group) -> int:
    if rank == 1:
        raise ValueError("rank 1 refuses")
    return rank


def rank_that_dies(rank: int, world_size: int, group) -> int:
    if rank == 1:
        os._exit(7)  # no result, no exception: a crash
    time.sleep(30)  # rank 0 would report much later; the launcher must not wait for it
    return rank


def test_results_come_back_in_rank_order():
    assert parallel_launch(2, rank_value) == [(0, 2, 2), (1, 2, 2)]


def test_an_exception_names_the_rank_and_keeps_its_traceback():
    with pytest.raises(RuntimeError, match=r"rank 1: ValueError: rank 1 refuses(.|\n)*Traceback"):
        parallel_launch(2, rank_that_raises)


def test_a_rank_that_dies_is_reported_at_once():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 exited with code 7 without a result"):
        parallel_launch(2, rank_that_dies, timeout_s=120)
    assert time.monotonic() - start < 25  # not the 180 s of the timeout, nor rank 0's 30 s


def rank_that_finishes_early(rank: int, world_size: int, group) -> str:
    if rank == 0:
        finish_rank("finished early")  # ends the process: nothing after this runs
        raise AssertionError("finish_rank returned")
    return "returned"


def test_finish_rank_delivers_its_value_and_ends_the_rank():
    assert parallel_launch(2, rank_that_finishes_early) == ["finished early", "returned"]


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_a_bad_ranks_per_gpu_setting_is_refused_with_its_name(monkeypatch, value):
    monkeypatch.setenv(RANKS_PER_GPU_ENV, value)
    with pytest.raises(ValueError, match=RANKS_PER_GPU_ENV):
        gpus_shared_by_ranks()


def test_ranks_share_gpus_only_where_mps_is_declared(monkeypatch):
    monkeypatch.delenv(RANKS_PER_GPU_ENV, raising=False)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert rank_slots() == gpus
    monkeypatch.setenv(RANKS_PER_GPU_ENV, "3")
    assert gpus_shared_by_ranks() == 3
    assert rank_slots() == 3 * gpus
    for rank in range(5):
        device = rank_device(rank)
        assert device == (torch.device("cuda", rank % gpus) if gpus else torch.device("cpu"))


def rank_that_is_killed(rank: int, world_size: int, group) -> int:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # what the out-of-memory killer does
    time.sleep(30)
    return rank


def test_a_rank_killed_by_sigkill_is_named_as_a_likely_out_of_memory():
    with pytest.raises(RuntimeError, match=r"rank 1 exited with code -9 \(killed by SIGKILL: most often the "
                                           r"system's out-of-memory killer\) without a result"):
        parallel_launch(2, rank_that_is_killed, timeout_s=120)
