"""Helpers shared by the native GPU tests (they run inside the spawned ranks).

Inputs for normal mode, exact comparison by bits, allocator poisoning, and CUDA-graph capture.
"""
from __future__ import annotations

import os
import time
from typing import Callable, Tuple

import pytest
import torch

from ep_plugin import tuning
from ep_plugin.fp8 import quantize
from ep_plugin.tuning import Config
from ep_plugin.launch import RANKS_PER_GPU_ENV, finish_rank, rank_slots
from ep_plugin.testing import raw_bytes

NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


# The normal-mode matrix of the intranode issue (hidden sizes, top-k, expert counts, routing skews,
# -1 entries, an empty rank, weights, alignment, biases, the benchmark's size), shared by the
# intranode and the internode tests; each adds its own ring and SM cases.
NORMAL_MODE_CASES = (
    [dict(name=f"hidden{h}", T=384, H=h, K=8, E=64) for h in (2048, 2560, 4096, 5120, 7168, 8192, 1536)]
    + [dict(name=f"fp8_hidden{h}", T=384, H=h, K=8, E=64, fp8=True) for h in (7168, 1536, 2560)]
    + [dict(name=f"topk{k}", T=300, H=2048, K=k, E=64) for k in (1, 2, 6, 8, 9)]
    + [dict(name=f"experts{e}", T=300, H=2048, K=min(8, e), E=e) for e in (8, 64, 256)]
    + [dict(name=f"routing_{r}", T=500, H=4096, K=8, E=64, routing=r)
       for r in ("minus_one", "one_rank", "one_expert", "unrouted")]
    + [dict(name="empty_rank", T=256, H=4096, K=8, E=64, empty_rank=True),
       dict(name="no_weights", T=256, H=4096, K=8, E=64, weights=False),
       dict(name="alignment128", T=256, H=4096, K=8, E=64, alignment=128),
       dict(name="bias1", T=256, H=4096, K=8, E=64, bias=1),
       dict(name="bias2", T=256, H=4096, K=8, E=64, bias=2),
       dict(name="large", T=4096, H=7168, K=8, E=256)]
)


def max_test_sms() -> int:
    """EP_TEST_MAX_SMS: the most SMs a native test case may ask for (0, the default: no cap). Ranks that
    share one GPU under CUDA MPS each see a share of its SMs, and a ring kernel's blocks of every rank
    must be resident at once; a capped case runs with fewer channels, its other settings unchanged."""
    return int(os.environ.get("EP_TEST_MAX_SMS", "0"))


def capped(config):
    """`config` (a Config or None) with at most max_test_sms() SMs."""
    cap = max_test_sms()
    if config is None or cap == 0 or config.num_sms <= cap:
        return config
    return Config(cap, config.num_max_nvl_chunked_send_tokens, config.num_max_nvl_chunked_recv_tokens,
                  config.num_max_rdma_chunked_send_tokens, config.num_max_rdma_chunked_recv_tokens)


def copy_engines_at_any_size() -> None:
    """In this process (a spawned rank): combines of any size take the copy engines where those can serve them.
    The cases are smaller than the blocks that pay for the copies' host side by default
    (tuning.COPY_ENGINE_MIN_BLOCK_BYTES), and would all take the rings."""
    tuning.COPY_ENGINE_MIN_BLOCK_BYTES = tuning.PULL_MIN_BLOCK_BYTES = 0


def multi_gpu_ranks() -> int:
    """Ranks of the multi-GPU native tests: EP_TEST_RANKS, default 2 (the 8-GPU issue sets 4 or 8)."""
    return int(os.environ.get("EP_TEST_RANKS", "2"))


def needs_ranks(n: int, own_gpus: bool = False, module: object = True):
    """Skip unless `n` ranks fit on the GPUs here and `module` (an optional extension) is built.

    Ranks may share a GPU under CUDA MPS (EP_PLUGIN_RANKS_PER_GPU), except with `own_gpus`: a test
    that ends in a device trap needs its own GPUs, since under MPS a trap also stops the contexts
    of every other process on that GPU."""
    slots = NUM_GPUS if own_gpus else rank_slots()
    where = "its own GPU" if own_gpus else f"a GPU (or a share of one under MPS, {RANKS_PER_GPU_ENV})"
    return pytest.mark.skipif(slots < n or module is None,
                              reason=f"needs {n} ranks with {where}{'' if module is not None else ' and NVSHMEM'} "
                                     "(runs on the GPU machine)")


def poison_allocator(megabytes: int = 512) -> None:
    """Fill soon-to-be-reused cached memory with 0x7F bytes (NaN in fp8, huge in bf16/fp32/int)."""
    block = torch.empty(megabytes << 20, dtype=torch.uint8, device="cuda")
    block.fill_(0x7F)
    del block


def poison_output_region(buffer) -> None:
    """The same for the free part of a native buffer's output region (direct dispatch), if it has one:
    its next outputs come from there, not from the caching allocator."""
    region = getattr(getattr(buffer, "_backend", None), "_outputs", None)
    if region is None:
        return
    largest = region.largest_free_bytes()
    if largest == 0:
        return
    (block,) = region.empty_group([((largest,), torch.uint8)], torch.cuda.current_stream().cuda_stream)
    block.fill_(0x7F)
    del block


def poison(native) -> None:
    poison_allocator()
    poison_output_region(native)


def make_routing(kind: str, T: int, E: int, K: int, R: int, gen: torch.Generator) -> torch.Tensor:
    E_local = E // R
    if kind == "random":
        idx = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
    elif kind == "minus_one":
        idx = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
        idx[torch.rand(T, K, generator=gen) < 0.3] = -1
    elif kind == "one_rank":  # every token only to rank 0's experts
        k = min(K, E_local)
        idx = torch.full((T, K), -1, dtype=torch.int64)
        idx[:, :k] = torch.rand(T, E_local, generator=gen).topk(k, dim=1).indices
    elif kind == "one_expert":  # every token to expert 3 only
        idx = torch.full((T, K), -1, dtype=torch.int64)
        idx[:, 0] = 3 % E
    elif kind == "unrouted":
        idx = torch.full((T, K), -1, dtype=torch.int64)
    elif kind == "alternate":  # token t only to rank t % R's experts: each rank's tokens for itself in T / R runs
        k = min(K, E_local)
        idx = torch.full((T, K), -1, dtype=torch.int64)
        idx[:, :k] = torch.rand(T, E_local, generator=gen).topk(k, dim=1).indices
        idx[:, :k] += (torch.arange(T) % R * E_local).unsqueeze(1)
    else:
        raise ValueError(kind)
    return idx.to(torch.int64)


def make_inputs(rank: int, R: int, case: dict, seed: int):
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    T = 0 if case.get("empty_rank") and rank == R - 1 else case["T"]
    H, K, E = case["H"], case["K"], case["E"]
    topk_idx = make_routing(case.get("routing", "random"), T, E, K, R, gen).cuda()
    x = (torch.randn(T, H, generator=gen) * 3).to(torch.bfloat16)
    if case.get("unlanded_words"):
        # 0xffffffff words: the staging areas' mark for bytes not landed yet (copy-engine combine).
        x.view(torch.int32)[::3, :64] = -1
        x.view(torch.int32)[T // 2:T // 2 + 1] = -1
    x = x.cuda()
    weights = torch.rand(T, K, generator=gen).cuda() if case.get("weights", True) else None
    payload = quantize(x, round_scale=False, use_ue8m0=False) if case.get("fp8") else x
    return payload, topk_idx, weights




def assert_same(name: str, got, want) -> None:
    if isinstance(want, tuple):
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(f"{name}[{i}]", g, w)
        return
    if want is None:
        assert got is None, f"{name}: expected None"
        return
    assert got.shape == want.shape and got.dtype == want.dtype, \
        f"{name}: {tuple(got.shape)} {got.dtype} != {tuple(want.shape)} {want.dtype}"
    if not torch.equal(raw_bytes(got), raw_bytes(want)):
        bad = (raw_bytes(got) != raw_bytes(want)).nonzero()[:5].tolist()
        raise AssertionError(f"{name}: values differ (first positions {bad})")


def rows(x, n: int):
    return tuple(t[:n] for t in x) if isinstance(x, tuple) else x[:n]


def capture_graph(step: Callable[[], object]) -> Tuple[torch.cuda.CUDAGraph, object]:
    """Run `step` once on a side stream (warm-up, outside capture), then capture it; returns (graph, outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs


def run_case(native, reference, rank: int, R: int, case: dict, seed: int) -> None:
    """One normal-mode case: layout, dispatch, combine and cached dispatch of `native` against `reference`.

    `case`: T, H, K, E; optional routing, fp8, weights, empty_rank, alignment, num_worst_slack (padding
    rows past the most a rank can receive, T x R: num_worst_tokens = T x R + slack), bias (0-2),
    unlanded_words (0xffffffff words in x and the combine's inputs), config, combine_config, cached_config
    (each capped at EP_TEST_MAX_SMS). Fresh random data from `seed`; outputs poisoned first.

    Every rank makes every call of the case whatever its checks find; failed checks are raised at
    the end. (A rank that stopped at its first failed check would skip calls its peers still make,
    and they would time out in the next kernel, hiding the real failure: run_each goes on to the
    next case.)
    """
    failures = []

    def check(what: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except AssertionError as error:
            failures.append(f"{what}: {error}")

    x, topk_idx, weights = make_inputs(rank, R, case, seed)
    E = case["E"]
    alignment = case.get("alignment", 1)
    config = capped(case.get("config"))
    poison(native)
    got_layout = native.get_dispatch_layout(topk_idx, E)
    want_layout = reference.get_dispatch_layout(topk_idx, E)
    for i, name in enumerate(("num_tokens_per_rank", "num_tokens_per_rdma_rank", "num_tokens_per_expert",
                              "is_token_in_rank")):
        check(name, lambda: assert_same(name, got_layout[i], want_layout[i]))  # per node: None in one node

    def dispatch(buf, layout, num_worst: int):
        return buf.dispatch(x, num_tokens_per_rank=layout[0], num_tokens_per_rdma_rank=layout[1],
                            is_token_in_rank=layout[3], num_tokens_per_expert=layout[2], topk_idx=topk_idx,
                            topk_weights=weights, expert_alignment=alignment, num_worst_tokens=num_worst,
                            config=config)

    num_worst = case["T"] * R + case["num_worst_slack"] if "num_worst_slack" in case else 0
    poison(native)
    got = dispatch(native, got_layout, num_worst)
    want = dispatch(reference, want_layout, 0)
    want_x = want[0]
    n = (want_x[0] if isinstance(want_x, tuple) else want_x).size(0)
    got_rows = (got[0][0] if isinstance(got[0], tuple) else got[0]).size(0)

    def check_dispatch() -> None:
        assert got_rows == (num_worst if num_worst else n), f"rows {got_rows}, received {n}, num_worst {num_worst}"
        assert_same("recv_x", rows(got[0], n), want_x)
        assert_same("recv_topk_idx", got[1][:n], want[1])
        assert_same("recv_topk_weights", None if got[2] is None else got[2][:n], want[2])
        if num_worst:
            assert got[3] == [], "num_worst_tokens > 0 returns an empty per-expert list"
            assert bool((got[1][n:] == -1).all()), "padding rows must have recv_topk_idx == -1"
        else:
            assert got[3] == want[3], f"per-expert counts {got[3]} != {want[3]}"

    check("dispatch", check_dispatch)

    # Combine: random expert outputs; padding rows hold garbage that must be ignored.
    gen = torch.Generator().manual_seed(seed * 7 + rank)
    expert_out = (torch.randn(got_rows, x[0].size(1) if isinstance(x, tuple) else x.size(1), generator=gen)
                  .to(torch.bfloat16).cuda())
    if got_rows > n:
        expert_out[n:] = float("nan")
    combine_weights, want_combine_weights = got[2], want[2]
    if case.get("unlanded_words"):
        # 0xffffffff words: the copy-engine combine's mark for staged bytes not landed yet. Real
        # outputs and weights may hold them (NaNs); they must still be summed, never waited on forever.
        expert_out.view(torch.int32)[:n:3, :64] = -1
        expert_out.view(torch.int32)[n // 2] = -1
        if combine_weights is not None:
            combine_weights = combine_weights.clone()
            combine_weights.view(torch.int32)[:n:5, 0] = -1
            want_combine_weights = combine_weights[:n]
    T = topk_idx.size(0)
    bias = None
    if case.get("bias", 0) >= 1:
        bias = tuple((torch.randn(T, expert_out.size(1), generator=gen)).to(torch.bfloat16).cuda()
                     for _ in range(case["bias"]))
        bias = bias[0] if len(bias) == 1 else bias
    combine_config = capped(case.get("combine_config"))
    combine_input = expert_out.clone()
    poison(native)
    got_c = native.combine(combine_input, got[4], topk_weights=combine_weights, bias=bias, config=combine_config)
    # A caller may reuse the combine's input once the call returns: only stream order protects its rows.
    combine_input.fill_(float("nan"))
    want_c = reference.combine(expert_out[:n], want[4], topk_weights=want_combine_weights, bias=bias)
    # Across nodes with several ranks per node, each node's partial sum is rounded to bf16 before the
    # network leg (docs/internode.md, as DeepEP): up to 2^-8 of each partial's magnitude, bounded by
    # the sum of the copies' magnitudes (a collective call: every rank of such a group makes it).
    info = native._info
    abs_sum = None
    if not info.is_intranode and info.ranks_per_node > 1:
        abs_sum = reference.combine(expert_out[:n].abs(), want[4])[0].float()

    def check_combine() -> None:
        if abs_sum is None:
            # NaNs (from unlanded_words) must sit in the same places.
            torch.testing.assert_close(got_c[0].float(), want_c[0].float(), rtol=1e-2, atol=1e-2, equal_nan=True)
        else:
            error = (got_c[0].float() - want_c[0].float()).abs()
            bound = 1e-2 + 1e-2 * want_c[0].float().abs() + 2.0 ** -7 * abs_sum
            assert bool((error <= bound).all()), \
                f"combined_x: {int((error > bound).sum())} elements beyond the two-stage bf16 bound"
        if weights is None:
            assert got_c[1] is None and want_c[1] is None
        else:
            torch.testing.assert_close(got_c[1], want_c[1], rtol=1e-6, atol=1e-6, equal_nan=True)

    check("combine", check_combine)

    # Cached dispatch of new data with the same layout (and the same or another ring size).
    x2, _, _ = make_inputs(rank, R, case, seed + 99991)
    poison(native)
    got2 = native.dispatch(x2, handle=got[4], config=capped(case.get("cached_config", config)))
    want2 = reference.dispatch(x2, handle=want[4])

    def check_cached() -> None:
        assert_same("cached recv_x", rows(got2[0], n), want2[0])
        assert got2[1:5] == (None, None, None, None)

    check("cached dispatch", check_cached)
    if failures:
        raise AssertionError("\n".join(failures))


# ---- a dispatch rejected on every rank, and the buffer after it ----------------------------------
def dispatch_error(native, layout, x, topk_idx, topk_weights) -> str:
    """The ValueError message of this dispatch ("no error" when it is accepted)."""
    try:
        native.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                        num_tokens_per_expert=layout[2], topk_idx=topk_idx, topk_weights=topk_weights)
    except ValueError as error:
        return str(error)
    return "no error"


def dispatch_and_combine(native, layout, x, topk_idx, topk_weights) -> None:
    """One dispatch and its combine, synchronised: after a rejected call, the buffer still works."""
    out = native.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                          num_tokens_per_expert=layout[2], topk_idx=topk_idx, topk_weights=topk_weights)
    native.combine(out[0], out[4])
    torch.cuda.synchronize()


# ---- a peer that never answers ------------------------------------------------------------------
def device_error_message(native, error: Exception) -> str:
    """The error's text; where the CUDA error surfaced first, what ep_plugin's device status recorded."""
    message = str(error)
    if "waited for peer" in message:
        return message
    for runtime in (getattr(native._backend, "_net", None), getattr(native._backend, "_runtime", None)):
        if runtime is None:
            continue
        try:
            runtime.check_device_error()
        except Exception as detail:  # noqa: BLE001 - the message is the point
            return str(detail)
    return message


def missing_peer_scenario(native, rank: int, op: str, x, dispatch_kwargs: dict, absent_s: float) -> str:
    """Rank 1 never joins `op` ("dispatch", or "combine" or "cached_dispatch" after a dispatch every
    rank finished), for kernels that trap on a timeout (internode mode's network leg).

    Returns "absent" on rank 1. Rank 0 must time out: it ends its process with the error text
    (finish_rank: its CUDA context may be stopped, so no tensor may be freed), else returns "no error".
    (The intranode kernels end early instead: tests/test_native_intranode.py checks that the rest recover.)
    """
    if op in ("combine", "cached_dispatch"):
        out = native.dispatch(x, **dispatch_kwargs)
        torch.cuda.synchronize()
    if rank == 1:
        time.sleep(absent_s)  # longer than rank 0's timeout
        return "absent"
    try:
        if op == "dispatch":
            native.dispatch(x, **dispatch_kwargs)
        elif op == "cached_dispatch":
            native.dispatch(x, handle=out[4])
        else:
            native.combine(out[0], out[4])
        torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001 - the message is the point of the test
        finish_rank(device_error_message(native, error))
    return "no error"
