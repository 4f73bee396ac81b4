"""`parallel_launch`: run a function on N spawned ranks (gloo on CPU, NCCL on GPUs).

Used by the tests and by `ep-plugin bench`. Each rank's return value comes back to the caller; an
exception on any rank is re-raised in the caller with that rank's traceback.

With more ranks than GPUs, ranks share GPUs (rank r uses GPU r mod #GPUs) over a gloo group. The
native kernels of ranks that share a GPU only make progress together where their kernels run at the
same time, that is under CUDA MPS (see `gpus_shared_by_ranks`).
"""
from __future__ import annotations

import faulthandler
import os
import queue
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .environment import NO_MULTICAST_ENV  # ep_plugin never uses NVLink multicast; off in every rank

# Seconds a rank may take to exit once every result is in. A rank whose CUDA context was stopped by a
# device-side timeout (trap) can hang in NCCL's teardown; its result is already here, so it is ended.
EXIT_GRACE_S = 15.0
# Set to N > 0: each rank prints every thread's Python stack every N seconds (finding a hang).
STACK_DUMP_ENV = "EP_PLUGIN_STACK_DUMP_S"


def rendezvous_store(world_size: int, timeout_s: float) -> dist.TCPStore:
    """The ranks' rendezvous, served by the parent on a port the OS picks when it binds (a port
    picked first and bound later by rank 0 can be taken in between: EADDRINUSE)."""
    return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s))


# Set by whoever started CUDA MPS (benchmarks/gpu_session.sh): how many ranks may share one GPU.
RANKS_PER_GPU_ENV = "EP_PLUGIN_RANKS_PER_GPU"


def default_backend(world_size: int) -> str:
    """NCCL when every rank can have its own GPU, else gloo."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def rank_device(rank: int) -> torch.device:
    """The device of a spawned rank: GPU `rank mod #GPUs`, or the CPU where there is no GPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", rank % torch.cuda.device_count())


def gpus_shared_by_ranks() -> int:
    """Ranks that may share one GPU: 1, unless CUDA MPS runs and EP_PLUGIN_RANKS_PER_GPU says more.

    NOTE: without MPS, kernels of different processes never run at the same time on one GPU, so two
    ranks whose kernels wait for each other on a shared GPU would only advance by time slices."""
    value = os.environ.get(RANKS_PER_GPU_ENV, "1")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{RANKS_PER_GPU_ENV} must be a positive int, got {value!r}")
    return int(value)


def rank_slots() -> int:
    """How many ranks the GPUs here can hold at once (0 without a GPU)."""
    if not torch.cuda.is_available():
        return 0
    return torch.cuda.device_count() * gpus_shared_by_ranks()


_this_rank = {}  # in a spawned rank: its rank and the results queue, for finish_rank


def finish_rank(value: Any) -> None:
    """Deliver this rank's result now and end the process without running any destructor.

    For a rank whose CUDA context a device-side timeout (trap) has stopped: freeing its tensors
    would raise inside torch's allocator, where no exception may pass, and abort the process
    before the result reached the parent. Only valid inside a function run by `parallel_launch`.
    """
    _deliver(_this_rank["results"], (_this_rank["rank"], True, value))
    os._exit(0)


def _rank_main(rank: int, world_size: int, port: int, backend: str, timeout_s: float,
               fn: Callable, args: tuple, results) -> None:
    _this_rank.update(rank=rank, results=results)
    for name, value in NO_MULTICAST_ENV.items():
        os.environ.setdefault(name, value)
    # NOTE: after a trapped kernel, torch's NCCL watchdog thread meets the stopped context when it polls a
    # collective still in its list and, by default, rethrows the CUDA error there: std::terminate, SIGABRT,
    # and the rank never reports. Off, the watchdog logs it and the rank's own error is what it reports.
    os.environ.setdefault("TORCH_NCCL_RETHROW_CUDA_ERRORS", "0")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    faulthandler.enable()  # a crash in native code still prints this rank's Python stack
    dump_after_s = float(os.environ.get(STACK_DUMP_ENV, "0"))
    if dump_after_s > 0:  # diagnosing a hang: every thread's Python stack to stderr, then on
        faulthandler.dump_traceback_later(dump_after_s, repeat=True, file=sys.stderr)
    try:
        if torch.cuda.is_available():
            torch.cuda.set_device(rank_device(rank))
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))
        if backend == "nccl":
            dist.init_process_group("nccl", store=store, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=timeout_s), device_id=rank_device(rank))
        else:
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=timeout_s))
        outcome = (rank, True, fn(rank, world_size, dist.group.WORLD, *args))
    except BaseException as error:  # noqa: BLE001 - reported to the parent
        outcome = (rank, False, f"rank {rank}: {type(error).__name__}: {error}\n{traceback.format_exc()}")
    _deliver(results, outcome)
    _tear_down(backend)


def _deliver(results, outcome: tuple) -> None:
    """Put this rank's result and wait until it has left the process.

    NOTE: before any teardown: a teardown that blocks in C code while holding the GIL would otherwise
    starve the queue's feeder thread, and the parent would never hear from this rank."""
    results.put(outcome)
    results.close()
    results.join_thread()


def _collect(results, processes, timeout_s: float, collected: dict, failures: list) -> None:
    """Read one result per rank into `collected`; the first failure, a rank that exited without a
    result, or `timeout_s` without any news ends the wait with a message in `failures`."""
    deadline = time.monotonic() + timeout_s
    exited_without_result = {}
    while len(collected) < len(processes):
        try:
            rank, ok, value = results.get(timeout=1.0)
        except queue.Empty:
            for rank, process in enumerate(processes):
                if rank not in collected and process.exitcode is not None:
                    # A result written just before exiting may still be in the pipe: one more second.
                    exited_without_result.setdefault(rank, time.monotonic())
                    if time.monotonic() - exited_without_result[rank] > 1.0:
                        failures.append(f"rank {rank} exited with code {process.exitcode}"
                                        f"{_exit_cause(process.exitcode)} without a result "
                                        f"(results so far from ranks {sorted(collected)})")
                        return
            if time.monotonic() > deadline:
                failures.append(f"no result from ranks {[r for r in range(len(processes)) if r not in collected]} "
                                f"within {timeout_s:.0f} s; exit codes: {[p.exitcode for p in processes]}")
                return
            continue
        if not ok:
            failures.append(value)
            return
        collected[rank] = value


def _exit_cause(exitcode: int) -> str:
    """What an exit code says: -9 is SIGKILL, which the system sends when memory runs out."""
    if exitcode == -9:
        return " (killed by SIGKILL: most often the system's out-of-memory killer)"
    return ""


def _cuda_is_healthy() -> bool:
    """False once a kernel has trapped (a device-side timeout): the context is unusable."""
    try:
        torch.cuda.synchronize()
        return True
    except Exception:  # noqa: BLE001
        return False


def _tear_down(backend: str) -> None:
    """Destroy the process group, or exit at once where NCCL's teardown could hang on a dead context."""
    if not dist.is_initialized():
        return
    if backend == "nccl" and not _cuda_is_healthy():
        os._exit(0)
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def parallel_launch(world_size: int, fn: Callable, *args: Any, backend: Optional[str] = None,
                    timeout_s: float = 300.0) -> List[Any]:
    """Run `fn(rank, world_size, group, *args)` on `world_size` spawned processes.

    `fn` must be importable (module level) and its arguments and result picklable. Returns the
    results ordered by rank; raises RuntimeError with the first failing rank's traceback.
    """
    backend = backend or default_backend(world_size)
    context = mp.get_context("spawn")
    results = context.Queue()
    store = rendezvous_store(world_size, timeout_s)  # NOTE: alive until every rank has exited
    port = store.port
    processes = [context.Process(target=_rank_main,
                                 args=(rank, world_size, port, backend, timeout_s, fn, args, results))
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    collected = {}
    failures = []
    try:
        _collect(results, processes, timeout_s + 60, collected, failures)
    except Exception as error:  # noqa: BLE001 - a result that arrived but could not be read
        failures.append(f"a rank's result could not be received: {type(error).__name__}: {error} "
                        "(results must be picklable and readable in the parent process; plain Python values "
                        f"are safest)\n{traceback.format_exc()}")
    finally:
        for process in processes:
            process.join(timeout=5 if failures else EXIT_GRACE_S)
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)
            if process.is_alive():  # stuck in a driver call that ignores SIGTERM
                process.kill()
                process.join(timeout=5)
    if failures:
        raise RuntimeError(failures[0])
    return [collected[rank] for rank in range(world_size)]
