"""Where an eager call spends its host time on a GPU machine, piece by piece.

The whole call and each piece of it, on rank 0 of 2, with DeepEP V1's calls beside it where `deep_ep` is
importable (in a launch of its own: both libraries start NVSHMEM). 128 tokens, top-8 of 256 experts, as
profile_host.py --eager.

--op layout: `get_dispatch_layout`: the whole call, the backend's, its allocations (alone, and as the backend
makes them: one OutputGroup), a view, the binding call, a launch.
--op combine: the normal-mode combine (BF16, hidden 7168) and the dispatch with notify before it: the combine
with one dispatch's outputs on every call, after a fresh dispatch (as programs call it), both with the explicit
Configs of a DeepEP program, through the backend alone, through the checked path, and through the copy engines
whatever its size.
--op ll_pair: an FP8 `low_latency_dispatch` (hidden 7168) + `low_latency_combine` pair: the pair, each call
(its partner run untimed), the backend's calls (without Buffer's checks and `_run`), Buffer's checks, `_run`,
each allocation, the Args (a fresh struct with
every field, or the plan's with the per-call fields), and the two binding calls alone (dispatch + combine
with prepared Args: the floor of the pair's host time).

Both ranks make every call (the low-latency kernels are collectives); rank 0 reports p50, p10 and the mean.
--global-defaults sets torch's default device (the rank's GPU) and dtype (bf16) after the inputs are made,
as DeepEP programs do: every piece is then timed under them.

    python3 benchmarks/probes/host_parts.py --op ll_pair [--global-defaults]
    python3 benchmarks/probes/host_parts.py --op layout
    python3 benchmarks/probes/host_parts.py --op combine [--global-defaults]
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import time
from types import SimpleNamespace
from typing import Callable, Dict, NamedTuple, Optional, Tuple

import torch

from ep_plugin import validation as V
from ep_plugin.bench import explicit_configs, random_routing
from ep_plugin.launch import parallel_launch, rank_device

TOKENS, HIDDEN, EXPERTS, TOPK = 128, 7168, 256, 8
NUM_SMS = 24  # the explicit Configs' (ep_plugin's default)
SYNC_EVERY = 64  # calls between untimed synchronisations: the launch queue never fills


class Piece(NamedTuple):
    """`step` is timed; `before` and `after` run untimed around each call of it (a combine needs its dispatch)."""
    step: Callable[[], object]
    before: Optional[Callable[[], object]] = None
    after: Optional[Callable[[], object]] = None


def host_us(piece: Piece, iters: int) -> str:
    """p50, p10 and mean host time of `piece.step` in us, after a warm-up; the GPU drained before and after, and
    every SYNC_EVERY calls (untimed)."""
    def call() -> float:
        if piece.before is not None:
            piece.before()
        begin = time.perf_counter_ns()
        piece.step()
        elapsed = time.perf_counter_ns() - begin
        if piece.after is not None:
            piece.after()
        return elapsed / 1e3

    for _ in range(50):
        call()
    torch.cuda.synchronize()
    times = []
    for i in range(iters):
        times.append(call())
        if i % SYNC_EVERY == SYNC_EVERY - 1:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    mean = sum(times) / iters  # beside the median: stalls in a few calls show here only
    times.sort()
    return f"p50 {times[iters // 2]:6.1f} p10 {times[iters // 10]:6.1f} mean {mean:6.1f}"


# ---- get_dispatch_layout ------------------------------------------------------------------------------------
def layout_pieces(lib, group, device, topk_idx) -> Tuple[object, Dict[str, Piece]]:
    buffer = lib.Buffer(group, 1 << 30, 0, explicitly_destroy=True)
    pieces = {f"{lib.__name__} get_dispatch_layout": Piece(lambda: buffer.get_dispatch_layout(topk_idx, EXPERTS))}
    if lib.__name__ != "ep_plugin":
        return buffer, pieces
    from ep_plugin import _C
    backend = buffer._backend
    R = buffer.group_size
    per_rank = torch.empty(R, dtype=torch.int32, device=device)
    per_expert = torch.empty(EXPERTS, dtype=torch.int32, device=device)
    in_rank = torch.empty(TOKENS, R, dtype=torch.bool, device=device)
    stream = backend._stream()
    pieces.update({
        "backend.get_dispatch_layout": Piece(lambda: backend.get_dispatch_layout(topk_idx, EXPERTS)),
        f"torch.empty int32[{EXPERTS}]": Piece(lambda: torch.empty(EXPERTS, dtype=torch.int32, device=device)),
        f"torch.empty bool[{TOKENS},{R}]": Piece(lambda: torch.empty(TOKENS, R, dtype=torch.bool, device=device)),
        "the 3 outputs, one OutputGroup.empty (one allocation)": Piece(lambda: backend._output_group(
            (((R,), None, torch.int32), ((EXPERTS,), None, torch.int32), ((-1, R), None, torch.bool))).empty(TOKENS)),
        "the 3 outputs, one OutputGroup.empty (three allocations)": Piece(lambda: backend._output_group(
            (((R,), None, torch.int32),), (((EXPERTS,), None, torch.int32),), (((-1, R), None, torch.bool),)
        ).empty(TOKENS)),
        "a slice": Piece(lambda: per_expert[:EXPERTS // 2]),
        "_C.get_dispatch_layout": Piece(lambda: _C.get_dispatch_layout(
            topk_idx.data_ptr(), TOKENS, TOPK, EXPERTS, R, R, per_rank.data_ptr(), 0, per_expert.data_ptr(),
            in_rank.data_ptr(), stream)),
        "a torch launch (per_expert.zero_())": Piece(lambda: per_expert.zero_()),
    })
    return buffer, pieces


# ---- low_latency_dispatch + low_latency_combine ---------------------------------------------------------------
def ll_pair_pieces(lib, group, device, topk_idx) -> Tuple[object, Dict[str, Piece]]:
    R = group.size()
    rdma = lib.Buffer.get_low_latency_rdma_size_hint(TOKENS, HIDDEN, R, EXPERTS)
    buffer = lib.Buffer(group, 0, rdma, low_latency_mode=True, num_qps_per_rank=EXPERTS // R,
                        explicitly_destroy=True)
    generator = torch.Generator().manual_seed(group.rank())
    # Explicit dtypes and devices: --global-defaults may have set others.
    host = {"generator": generator, "dtype": torch.float32, "device": "cpu"}
    x = torch.randn(TOKENS, HIDDEN, **host).to(torch.bfloat16).to(device)
    weights = torch.rand(TOKENS, TOPK, **host).to(device)
    recv_x, _, handle, _, _ = buffer.low_latency_dispatch(x, topk_idx, TOKENS, EXPERTS, use_fp8=True)
    expert_out = torch.randn(recv_x[0].shape, **host).to(torch.bfloat16).to(device)
    buffer.low_latency_combine(expert_out, topk_idx, weights, handle)
    last = {"handle": handle}  # the last dispatch's handle, for its combine

    def dispatch() -> None:
        last["handle"] = buffer.low_latency_dispatch(x, topk_idx, TOKENS, EXPERTS, use_fp8=True)[2]

    def combine() -> None:
        buffer.low_latency_combine(expert_out, topk_idx, weights, last["handle"])

    name = lib.__name__
    pieces = {f"{name} pair": Piece(lambda: (dispatch(), combine())),
              f"{name} low_latency_dispatch": Piece(dispatch, after=combine),
              f"{name} low_latency_combine": Piece(combine, before=dispatch)}
    if name != "ep_plugin":
        return buffer, pieces
    pieces.update(_ep_plugin_ll_pieces(buffer, device, x, topk_idx, weights, expert_out, last))
    return buffer, pieces


def _ep_plugin_ll_pieces(buffer, device, x, topk_idx, weights, expert_out, last) -> Dict[str, Piece]:
    """ep_plugin's pair taken apart: the backend's calls, Buffer's checks, `_run`, allocations, Args, bindings."""
    from ep_plugin.backends.native_common import _C_nvshmem
    from ep_plugin.handles import LowLatencyHandle
    backend = buffer._backend
    runtime = backend._low_latency()
    plan = last["handle"].plan
    R = buffer.group_size
    num_local, num_slots, _ = plan.recv_shape

    def backend_dispatch() -> None:
        last["inner"] = backend.low_latency_dispatch(x, topk_idx, TOKENS, EXPERTS, None, True, False, False, False,
                                                     None)[2]

    def backend_combine() -> None:
        backend.low_latency_combine(expert_out, topk_idx, weights, last["inner"], False, False, None)

    def dispatch_checks() -> None:  # as Buffer.low_latency_dispatch makes them
        V.check_tensor("x", x, (torch.bfloat16,), 2, device)
        V.check_row_bytes("x", x)
        V.check_topk("topk_idx", topk_idx, TOKENS, device)
        V.check_num_experts(EXPERTS, R)
        V.check_hook_without_async(False, False)
        buffer._check_low_latency_size(TOKENS, HIDDEN, EXPERTS)

    def combine_checks() -> None:  # as Buffer.low_latency_combine makes them
        V.check_hook_without_async(False, False)
        handle = buffer._check_handle(last["handle"], LowLatencyHandle)
        V.check_tensor("x", expert_out, (torch.bfloat16,), 3, device, handle.recv_shape)
        V.check_topk("topk_idx", topk_idx, handle.num_tokens, device)
        V.check_tensor("topk_weights", weights, (torch.float32,), 2, device, topk_idx.shape)

    # Outputs and Args of the binding calls, made once.
    data = torch.empty(*plan.recv_shape, dtype=plan.recv_dtype, device=device)
    scales = torch.empty_strided(plan.scales_shape, plan.scales_strides, dtype=plan.scales_dtype, device=device)
    recv_count = torch.empty(num_local, dtype=torch.int32, device=device)
    recv_src_info = torch.empty(num_local, num_slots, dtype=torch.int32, device=device)
    recv_layout = torch.empty(num_local, R, dtype=torch.int64, device=device)
    out = torch.empty(TOKENS, HIDDEN, dtype=torch.bfloat16, device=device)
    send_recv = _C_nvshmem.PHASE_SEND | _C_nvshmem.PHASE_RECV

    def fill_dispatch_args(args) -> None:
        args.x, args.topk_idx, args.num_tokens = x.data_ptr(), topk_idx.data_ptr(), TOKENS
        args.recv_x, args.recv_scales, args.recv_count = data.data_ptr(), scales.data_ptr(), recv_count.data_ptr()
        args.recv_src_info, args.recv_layout = recv_src_info.data_ptr(), recv_layout.data_ptr()
        args.cumulative_local_expert_recv_stats, args.phases = 0, send_recv

    def fill_combine_args(args) -> None:
        args.x, args.recv_src_info, args.recv_layout = (expert_out.data_ptr(), recv_src_info.data_ptr(),
                                                        recv_layout.data_ptr())
        args.topk_idx, args.topk_weights, args.out, args.num_tokens = (topk_idx.data_ptr(), weights.data_ptr(),
                                                                      out.data_ptr(), TOKENS)
        args.phases = send_recv

    dispatch_args, combine_args = plan.new_dispatch_args(), plan.new_combine_args()
    fill_dispatch_args(dispatch_args)
    fill_combine_args(combine_args)

    def bindings() -> None:  # the rounds alternate as the backend's do
        parity = backend._ll_parity
        runtime.dispatch(dispatch_args, parity, backend._stream())
        runtime.combine(combine_args, parity, backend._stream())
        backend._ll_parity = parity ^ 1

    return {
        "backend.low_latency_dispatch": Piece(backend_dispatch, after=backend_combine),
        "backend.low_latency_combine": Piece(backend_combine, before=backend_dispatch),
        "Buffer's dispatch checks": Piece(dispatch_checks),
        "Buffer's combine checks": Piece(combine_checks),
        "Buffer._run of a no-op": Piece(lambda: buffer._run(tuple, [], None, False, False)),
        "backend._stream()": Piece(backend._stream),
        f"torch.empty fp8 recv_x [{num_local},{num_slots},{HIDDEN}]": Piece(
            lambda: torch.empty(*plan.recv_shape, dtype=plan.recv_dtype, device=device)),
        "torch.empty_strided fp32 scales": Piece(lambda: torch.empty_strided(
            plan.scales_shape, plan.scales_strides, dtype=plan.scales_dtype, device=device)),
        "small outputs, 3 torch.empty": Piece(lambda: (
            torch.empty(num_local, dtype=torch.int32, device=device),
            torch.empty(num_local, num_slots, dtype=torch.int32, device=device),
            torch.empty(num_local, R, dtype=torch.int64, device=device))),
        f"torch.empty bf16 combine out [{TOKENS},{HIDDEN}]": Piece(
            lambda: torch.empty(TOKENS, HIDDEN, dtype=torch.bfloat16, device=device)),
        "the dispatch's 5 outputs, one OutputGroup.empty (two allocations)": Piece(plan.dispatch_outputs.empty),
        "the dispatch's 5 outputs, one OutputGroup.empty (five allocations)": Piece(backend._output_group(
            *(((spec,) for spec in ((plan.recv_shape, None, plan.recv_dtype),
                                    (plan.scales_shape, plan.scales_strides, plan.scales_dtype),
                                    ((num_local,), None, torch.int32), ((num_local, num_slots), None, torch.int32),
                                    ((num_local, R), None, torch.int64))))).empty),
        "the combine's output, OutputGroup.empty": Piece(lambda: plan.combine_output.empty(TOKENS)),
        "DispatchArgs: a fresh one, every field": Piece(lambda: fill_dispatch_args(plan.new_dispatch_args())),
        "DispatchArgs: the plan's, per-call fields": Piece(lambda: fill_dispatch_args(plan.dispatch_args)),
        "CombineArgs: a fresh one, every field": Piece(lambda: fill_combine_args(plan.new_combine_args())),
        "CombineArgs: the plan's, per-call fields": Piece(lambda: fill_combine_args(plan.combine_args)),
        "runtime.dispatch + runtime.combine (prepared Args)": Piece(bindings),
    }


# ---- normal-mode combine ---------------------------------------------------------------------------------------
def combine_pieces(lib, group, device, topk_idx) -> Tuple[object, Dict[str, Piece]]:
    buffer = lib.Buffer(group, 1 << 30, 0, explicitly_destroy=True)
    host = {"generator": torch.Generator().manual_seed(group.rank()), "dtype": torch.float32, "device": "cpu"}
    x = torch.randn(TOKENS, HIDDEN, **host).to(torch.bfloat16).to(device)
    weights = torch.rand(TOKENS, TOPK, **host).to(device)
    num_tokens_per_rank, _, num_tokens_per_expert, is_token_in_rank, _ = buffer.get_dispatch_layout(topk_idx, EXPERTS)
    last = {}  # the last dispatch's rows, weights and handle, for its combine
    # As a DeepEP program passes them (bench --style explicit_config).
    dispatch_config, combine_config = explicit_configs(lib.Config, SimpleNamespace(num_sms=NUM_SMS), group.size())

    def dispatch(config=None) -> None:
        recv_x, _, recv_weights, _, handle, _ = buffer.dispatch(
            x, num_tokens_per_rank=num_tokens_per_rank, is_token_in_rank=is_token_in_rank,
            num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk_idx, topk_weights=weights, config=config)
        last.update(x=recv_x, weights=recv_weights, handle=handle)

    dispatch()
    first = dict(last)
    name = lib.__name__
    pieces = {f"{name} dispatch (with notify and its wait)": Piece(dispatch),
              f"{name} dispatch, an explicit Config": Piece(lambda: dispatch(dispatch_config)),
              f"{name} combine, one dispatch's outputs each call": Piece(
                  lambda: buffer.combine(first["x"], first["handle"], first["weights"])),
              f"{name} combine after a fresh dispatch": Piece(
                  lambda: buffer.combine(last["x"], last["handle"], last["weights"]), before=dispatch),
              f"{name} the same, both with explicit Configs": Piece(
                  lambda: buffer.combine(last["x"], last["handle"], last["weights"], config=combine_config),
                  before=lambda: dispatch(dispatch_config))}
    if name != "ep_plugin":
        return buffer, pieces
    backend, default = buffer._backend, lib.Buffer.get_combine_config(group.size())
    pieces.update({
        "backend.unchecked_combine after a fresh dispatch": Piece(
            lambda: backend.unchecked_combine(last["x"], last["handle"].inner, last["weights"], default),
            before=dispatch),
        "the checked path after a fresh dispatch": Piece(lambda: buffer._checked_combine(
            last["x"], last["handle"], last["weights"], None, default, None, False, False), before=dispatch),
        "the copy engines' combine after a fresh dispatch": Piece(
            lambda: _at_any_size(lambda: buffer.combine(last["x"], last["handle"], last["weights"])),
            before=dispatch)})
    return buffer, pieces


def _at_any_size(call: Callable[[], object]) -> None:
    """`call` with the copy engines taking combines of any size (a probe's override of ep_plugin.tuning)."""
    from ep_plugin import tuning
    least = tuning.COPY_ENGINE_MIN_BLOCK_BYTES, tuning.PULL_MIN_BLOCK_BYTES
    tuning.COPY_ENGINE_MIN_BLOCK_BYTES = tuning.PULL_MIN_BLOCK_BYTES = 0
    try:
        call()
    finally:
        tuning.COPY_ENGINE_MIN_BLOCK_BYTES, tuning.PULL_MIN_BLOCK_BYTES = least


OPS = {"layout": layout_pieces, "ll_pair": ll_pair_pieces, "combine": combine_pieces}


def probe_rank(rank: int, world_size: int, group, op: str, library: str, iters: int,
               global_defaults: bool = False) -> str:
    lib = importlib.import_module(library)
    device = rank_device(rank)
    topk_idx = random_routing(TOKENS, EXPERTS, TOPK, device, torch.Generator().manual_seed(rank))
    topk_idx = topk_idx.to(getattr(lib, "topk_idx_t", torch.int64))
    if global_defaults:
        torch.set_default_device(device)
        torch.set_default_dtype(torch.bfloat16)
    buffer, pieces = OPS[op](lib, group, device, topk_idx)
    lines = [f"{name:52} {host_us(piece, iters)}" for name, piece in pieces.items()]
    torch.cuda.synchronize()
    buffer.destroy()
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", choices=tuple(OPS), default="ll_pair", help="the call taken apart")
    parser.add_argument("--iters", type=int, default=400, help="timed calls per piece")
    parser.add_argument("--global-defaults", action="store_true",
                        help="time every piece under torch.set_default_device / set_default_dtype(bf16)")
    args = parser.parse_args()
    defaults = ", global default device and dtype" if args.global_defaults else ""
    print(f"host us per call on rank 0 of 2 ({torch.cuda.get_device_name()}; {TOKENS} tokens, top-{TOPK} of "
          f"{EXPERTS} experts, --op {args.op}{defaults})", flush=True)
    libraries = ["ep_plugin"] + (["deep_ep"] if importlib.util.find_spec("deep_ep") is not None else [])
    for library in libraries:
        print(parallel_launch(2, probe_rank, args.op, library, args.iters, args.global_defaults,
                              timeout_s=300)[0], flush=True)


if __name__ == "__main__":
    main()
