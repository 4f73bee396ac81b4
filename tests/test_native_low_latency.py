"""Native low-latency kernels (ep_plugin._C_nvshmem) against the reference backend.

CPU part (wherever the module imports): the layout struct and `get_low_latency_rdma_size_hint`
agree; `backend: auto` keeps the reference until the kernels are verified; CI builds the module.

GPU part (2 GPUs, one launch for every case, so NVSHMEM starts once per process): random data
every run (EP_TEST_SEED replays one), outputs poisoned before each call. Routing metadata
(recv_count, statistics) and copied payloads (bf16 rows, FP8 bytes, float and UE8M0 scales) must be
bit-identical to the reference in every valid slot; combine results are compared with
assert_close (the same fp32 products and sums in the same k order, so in practice they are equal).
The `route_*` cases give the dispatch topk_weights (expert-side sums: one partial per (token, rank),
added in rank order on the token side). With `low_latency.expert_sums_partials: bf16` (the default,
the main launch) each partial that crosses to a peer is rounded once to bf16, so the combine is held
to the bound of that extra rounding (assert_combined); a second launch runs route cases with fp32
partials against assert_close's bf16 tolerance. Separate launches check the device timeouts and the
device errors of ranks that disagree on topk_weights or on the partials' dtype, and of ranks whose calls
have different layouts (each traps the CUDA context).
"""
from __future__ import annotations

import importlib.util
import itertools
import os
import random
import shutil
import time
from typing import Callable, Dict, List, Optional

import pytest
import torch

from case_runner import assert_case_passed, run_each
from ep_plugin import Buffer
from ep_plugin.launch import finish_rank, parallel_launch
from ep_plugin.testing import assert_within_bf16_partials_bound, raw_bytes
from ep_plugin.tuning import get_low_latency_rdma_size_hint
from native_helpers import capture_graph, multi_gpu_ranks, needs_ranks, poison_allocator

try:
    from ep_plugin import _C_nvshmem
except ImportError:
    _C_nvshmem = None

RANKS = multi_gpu_ranks()  # 2 unless EP_TEST_RANKS says otherwise
BASE_SEED = int(os.environ.get("EP_TEST_SEED", random.SystemRandom().randrange(1 << 30)))
needs_module = pytest.mark.skipif(_C_nvshmem is None, reason="ep_plugin._C_nvshmem is not built (no NVSHMEM)")
needs_gpus = needs_ranks(RANKS, module=_C_nvshmem)

# The largest configuration of the cases below: the buffer is sized for it once.
T_MAX, MAX_HIDDEN, NUM_EXPERTS = 128, 7168, 256


# ---- CPU: layout and selection ---------------------------------------------------------------------
@needs_module
def test_size_hint_matches_the_layout_struct():
    for t_max, hidden, num_ranks, num_experts in itertools.product(
            (1, 7, 128, 256, 1000), (8, 200, 1536, 2048, 2880, 4096, 7168, 8192), (1, 2, 3, 8, 16), (48, 96, 256)):
        if num_experts % num_ranks:
            continue
        assert get_low_latency_rdma_size_hint(t_max, hidden, num_ranks, num_experts) == \
            _C_nvshmem.size_hint(t_max, hidden, num_ranks, num_experts), (t_max, hidden, num_ranks, num_experts)


@needs_module
def test_benchmark_configuration_uses_less_memory_than_deepep():
    # DeepEP needs about 1.9 GB per GPU for 128 tokens x 7168 x 256 experts at 2 ranks.
    assert get_low_latency_rdma_size_hint(128, 7168, 2, 256) < 1.9e9


def test_auto_keeps_the_reference_backend_until_verified():
    from ep_plugin.backends import native
    from ep_plugin.backends.base import GroupInfo
    info = GroupInfo(group=None, rank=0, num_ranks=2, ranks_per_node=2, device=torch.device("cuda", 0))
    auto = native.unsupported_reason(info, True, 0, requested="auto")
    if _C_nvshmem is None:
        assert "_C_nvshmem is not built" in auto
    elif not native.LOW_LATENCY_VERIFIED:
        assert "not yet verified" in auto
        assert native.unsupported_reason(info, True, 0, requested="native") == ""
    else:
        assert auto == ""


def _nvshmem_installed() -> bool:
    try:
        spec = importlib.util.find_spec("nvidia.nvshmem")
    except ModuleNotFoundError:  # no `nvidia` package at all
        spec = None
    roots = list(spec.submodule_search_locations or []) if spec else []
    roots += [os.environ["NVSHMEM_DIR"]] if os.environ.get("NVSHMEM_DIR") else []
    return any(os.path.exists(os.path.join(root, "include", "nvshmem.h")) for root in roots)


def test_nvshmem_module_is_built_where_nvshmem_is_installed():
    if not _nvshmem_installed() or shutil.which("nvcc") is None or os.environ.get("EP_PLUGIN_SKIP_NVSHMEM") == "1":
        pytest.skip("no NVSHMEM or no nvcc here")
    assert _C_nvshmem is not None, "NVSHMEM and nvcc are installed but ep_plugin._C_nvshmem was not built"


# ---- GPU helpers (run inside the spawned ranks) ------------------------------------------------------
def route(kind: str, gen: torch.Generator, T: int, K: int, E: int, R: int) -> torch.Tensor:
    """[T, K] int64 expert ids, distinct per token (-1 = not routed)."""
    distinct = torch.rand(T, E, generator=gen).argsort(dim=1)[:, :K]
    if kind == "random":
        return distinct
    if kind == "minus_one":
        return distinct.masked_fill(torch.rand(T, K, generator=gen) < 0.3, -1)
    if kind == "skewed":  # most entries on rank 0's first experts, the rest random
        hot = min(E // R, 2 * K)
        hot_ids = torch.rand(T, hot, generator=gen).argsort(dim=1)[:, :K]
        return torch.where(torch.rand(T, K, generator=gen) < 0.8, hot_ids, distinct) if hot >= K else distinct
    if kind == "one_expert":
        ids = torch.full((T, K), -1, dtype=torch.int64)
        ids[:, 0] = E - 1
        return ids
    if kind == "unrouted":
        return torch.full((T, K), -1, dtype=torch.int64)
    raise ValueError(kind)


def fix_duplicates(ids: torch.Tensor) -> torch.Tensor:
    """A token may select an expert at most once (skewed routing can repeat one): repeats become -1."""
    ids = ids.clone()
    for t in range(ids.size(0)):
        seen = set()
        for k in range(ids.size(1)):
            e = int(ids[t, k])
            if e in seen:
                ids[t, k] = -1
            seen.add(e)
    return ids




def assert_same(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, \
        f"{name}: {tuple(got.shape)} {got.dtype} != {tuple(want.shape)} {want.dtype}"
    if not torch.equal(raw_bytes(got), raw_bytes(want)):
        bad = (raw_bytes(got) != raw_bytes(want)).nonzero()[:5].tolist()
        raise AssertionError(f"{name}: values differ (first positions {bad})")


def compare_dispatch(got, want, use_fp8: bool) -> None:
    """recv_count exactly; every valid slot of recv_x (and scales) bit for bit; layouts of the outputs."""
    recv_x, recv_count = got[0], got[1]
    want_x, want_count = want[0], want[1]
    assert_same("recv_count", recv_count, want_count)
    counts = want_count.tolist()
    if use_fp8:
        data, scales = recv_x
        want_data, want_scales = want_x
        assert data.shape == want_data.shape and scales.shape == want_scales.shape
        assert scales.dtype == want_scales.dtype and scales.stride() == want_scales.stride(), \
            f"scales must be column-major like the reference: {scales.stride()} vs {want_scales.stride()}"
        for e, n in enumerate(counts):
            assert_same(f"recv_x[{e}]", data[e, :n], want_data[e, :n])
            assert_same(f"recv_scales[{e}]", scales[e, :n], want_scales[e, :n])
    else:
        assert recv_x.shape == want_x.shape
        for e, n in enumerate(counts):
            assert_same(f"recv_x[{e}]", recv_x[e, :n], want_x[e, :n])


class Ctx:
    """One rank's buffers (native and reference, low-latency mode) and the run's seed."""

    def __init__(self, rank: int, R: int, group, seed: int, timeout_s: float = 30.0, partials: str = "bf16") -> None:
        self.rank, self.R, self.group, self.seed = rank, R, group, seed
        self.bf16_partials = partials == "bf16"  # low_latency.expert_sums_partials of the native buffer
        size = Buffer.get_low_latency_rdma_size_hint(T_MAX, MAX_HIDDEN, R, NUM_EXPERTS)
        # NOTE: transport nvlink (NVSHMEM_REMOTE_TRANSPORT=none, IBGDA off): both GPUs share NVLink, and
        # NVSHMEM then probes no NIC at start (low-latency mode's auto transport asks for IBGDA).
        self.native = Buffer(group, 0, size, low_latency_mode=True, explicitly_destroy=True,
                             config={"backend": "native", "timeout_s": timeout_s, "transport": "nvlink",
                                     "low_latency": {"expert_sums_partials": partials}})
        self.reference = Buffer(group, 0, 0, low_latency_mode=True, explicitly_destroy=True,
                                config={"backend": "reference"})
        assert self.native.backend_name == "native" and self.reference.backend_name == "reference"
        self.num_rdma_bytes = size

    def gen(self, case_id: int, shared: bool = False) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed * 1000 + case_id * 10 + (0 if shared else 1 + self.rank))

    def destroy(self) -> None:
        torch.cuda.synchronize()
        self.native.destroy()
        self.reference.destroy()


def make_inputs(ctx: Ctx, case_id: int, T: int, H: int, K: int, E: int, routing: str):
    gen = ctx.gen(case_id)
    ids = fix_duplicates(route(routing, gen, T, K, E, ctx.R))
    scale = torch.rand(T, 1, generator=gen) * 10 + 0.01
    x = (torch.randn(T, H, generator=gen) * scale).to(torch.bfloat16)
    weights = torch.rand(T, K, generator=gen)
    return x.cuda(), ids.cuda(), weights.cuda()


def expert_outputs(ctx: Ctx, case_id: int, shape, counts: List[int]) -> torch.Tensor:
    """Random expert outputs; slots past each expert's count hold NaN and must be ignored.

    NOTE: drawn on the GPU: at E_local x R * T_max x H = 128 x 256 x 7168 a CPU draw takes about a
    second, which 1000 graph replays cannot afford.
    """
    gen = torch.Generator(device="cuda").manual_seed(ctx.gen(case_id + 5000).initial_seed())
    out = torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)
    unused = torch.arange(shape[1], device="cuda").unsqueeze(0) >= torch.tensor(counts, device="cuda").unsqueeze(1)
    return out.masked_fill_(unused.unsqueeze(-1), float("nan"))


def assert_combined(ctx: Ctx, got: torch.Tensor, expert_x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                    want_handle, bf16_partials: bool) -> None:
    """The native combine against the reference's. Token-side sums and fp32 partials differ from it only
    in summation order: assert_close. With bf16 partials, each partial that crossed to a peer was rounded
    once more: the bound of assert_within_bf16_partials_bound."""
    want = ctx.reference.low_latency_combine(expert_x, ids, weights, want_handle)[0]
    if not bf16_partials:
        torch.testing.assert_close(got, want)
        return
    # NOTE: the dispatch's own weights tensor (a combine after a dispatch given topk_weights takes no other);
    # they are drawn in [0, 1), so the combine of |x| is the bound's A.
    assert bool((weights >= 0).all())
    magnitude = ctx.reference.low_latency_combine(expert_x.abs(), ids, weights, want_handle)[0]
    assert_within_bf16_partials_bound(got, want, magnitude)


def ll_case(ctx: Ctx, case_id: int, *, T: Optional[int] = None, t_max: int = T_MAX, H: int = 7168, K: int = 8,
            E: int = NUM_EXPERTS, routing: str = "random", use_fp8: bool = False, round_scale: bool = False,
            use_ue8m0: bool = False, hook: bool = False, zero_copy: bool = False, use_out: bool = False,
            stats: bool = True, mask_after: bool = False, empty_ranks: tuple = (), route: bool = False) -> None:
    """One low_latency_dispatch + low_latency_combine on both backends, compared. `route`: the dispatch
    gets topk_weights (expert-side sums)."""
    T = t_max if T is None else T
    if ctx.rank in empty_ranks:
        T = 0
    x, ids, weights = make_inputs(ctx, case_id, T, H, K, E, routing)
    E_local = E // ctx.R
    initial = torch.randint(0, 1000, (E_local,), dtype=torch.int32, generator=ctx.gen(case_id + 7000)).cuda()
    stats_native = initial.clone() if stats else None
    stats_reference = initial.clone() if stats else None
    kwargs = dict(use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0)
    if route:
        kwargs["topk_weights"] = weights

    poison_allocator(256)
    got = ctx.native.low_latency_dispatch(x, ids, t_max, E, cumulative_local_expert_recv_stats=stats_native,
                                          return_recv_hook=hook, **kwargs)
    if hook:
        assert got[4] is not None
        got[4]()
        got[4]()  # idempotent
    want = ctx.reference.low_latency_dispatch(x, ids, t_max, E, cumulative_local_expert_recv_stats=stats_reference,
                                              **kwargs)
    compare_dispatch(got, want, use_fp8)
    assert got[2].expert_sums == route, "2 GPUs on NVLink: expert-side sums exactly when the dispatch has weights"
    assert got[2].bf16_partials == (route and ctx.bf16_partials)
    if stats:
        assert_same("cumulative_local_expert_recv_stats", stats_native, stats_reference)

    counts = want[1].tolist()
    combine_x = expert_outputs(ctx, case_id, want[2].recv_shape, counts)
    native_x = combine_x
    if zero_copy:
        native_x = ctx.native.get_next_low_latency_combine_buffer(got[2])
        assert native_x.shape == combine_x.shape and native_x.dtype == torch.bfloat16
        native_x.copy_(combine_x)
    # After a dispatch given topk_weights the combine must get the dispatch's own ids tensor.
    combine_ids = ids if route else ids.clone()
    if mask_after:
        combine_ids[torch.rand(ids.shape, generator=ctx.gen(case_id + 9000)).cuda() < 0.4] = -1
    out = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device="cuda") if use_out else None
    poison_allocator(256)
    combined, _, combine_hook = ctx.native.low_latency_combine(native_x, combine_ids, weights, got[2],
                                                               zero_copy=zero_copy, return_recv_hook=hook, out=out)
    if hook:
        combine_hook()
    if use_out:
        assert combined is out
    assert combined.shape == (T, H) and combined.dtype == torch.bfloat16
    assert_combined(ctx, combined, combine_x, combine_ids, weights, want[2], got[2].bf16_partials)


def two_rounds_in_flight(ctx: Ctx, case_id: int) -> None:
    """Two micro-batches: both dispatches sent before either receive, combines likewise (double buffering)."""
    H, K, E = 4096, 8, 64
    batches = [make_inputs(ctx, case_id + i, 96 - 32 * i, H, K, E, "minus_one") for i in range(2)]
    sent = [ctx.native.low_latency_dispatch(x, ids, T_MAX, E, use_fp8=True, return_recv_hook=True)
            for x, ids, _ in batches]
    for got in sent:
        got[4]()
    wants = [ctx.reference.low_latency_dispatch(x, ids, T_MAX, E, use_fp8=True) for x, ids, _ in batches]
    for got, want in zip(sent, wants):
        compare_dispatch(got, want, True)
    outs = [expert_outputs(ctx, case_id + 100 + i, want[2].recv_shape, want[1].tolist())
            for i, want in enumerate(wants)]
    combined = [ctx.native.low_latency_combine(out, ids, w, got[2], return_recv_hook=True)
                for out, (_, ids, w), got in zip(outs, batches, sent)]
    for _, _, hook in combined:
        hook()
    for (result, _, _), out, (_, ids, w), want in zip(combined, outs, batches, wants):
        torch.testing.assert_close(result, ctx.reference.low_latency_combine(out, ids, w, want[2])[0])


def cuda_graph_replays(ctx: Ctx, case_id: int, replays: int, route: bool = False) -> None:
    """Dispatch (FP8) + combine captured in one CUDA graph, replayed with new data each time. `route`:
    the dispatch gets topk_weights and the combine sums on the expert side (float scales); otherwise
    UE8M0 scales."""
    T, H, K, E = T_MAX, 7168, 8, NUM_EXPERTS
    x0, ids0, w0 = make_inputs(ctx, case_id, T, H, K, E, "random")
    x_s, ids_s, w_s = x0.clone(), ids0.clone(), w0.clone()
    E_local = E // ctx.R
    expert_s = torch.zeros(E_local, ctx.R * T, H, dtype=torch.bfloat16, device="cuda")
    fp8 = dict(use_fp8=True) if route else dict(use_fp8=True, round_scale=True, use_ue8m0=True)
    extra = dict(topk_weights=w_s) if route else {}

    def step():
        recv, count, handle, _, _ = ctx.native.low_latency_dispatch(x_s, ids_s, T, E, **fp8, **extra)
        assert handle.expert_sums == route
        combined, _, _ = ctx.native.low_latency_combine(expert_s, ids_s, w_s, handle)
        return recv, count, combined

    graph, (recv_s, count_s, combined_s) = capture_graph(step)
    for i in range(replays):
        x, ids, w = make_inputs(ctx, case_id + 1 + i, T, H, K, E, "minus_one" if i % 2 else "random")
        x_s.copy_(x), ids_s.copy_(ids), w_s.copy_(w)
        want = ctx.reference.low_latency_dispatch(x, ids, T, E, **fp8)
        expert_s.copy_(expert_outputs(ctx, case_id + 1 + i, want[2].recv_shape, want[1].tolist()))
        recv_s[0].view(torch.uint8).fill_(0x7F)
        recv_s[1].fill_(0x7F7F7F7F if recv_s[1].dtype == torch.int32 else float("nan"))
        count_s.fill_(-1)
        combined_s.fill_(float("nan"))
        graph.replay()
        compare_dispatch((recv_s, count_s), want, True)
        try:
            assert_combined(ctx, combined_s, expert_s, ids, w, want[2], route and ctx.bf16_partials)
        except AssertionError as error:
            raise AssertionError(f"replay {i}: {error}") from None
    torch.cuda.synchronize()


def route_dispatches_without_combine(ctx: Ctx, case_id: int) -> None:
    """Dispatches given topk_weights that no combine follows (both rounds, three times) leave nothing
    behind: the pair list the next combine works from is its own dispatch's."""
    for i in range(3):
        x, ids, w = make_inputs(ctx, case_id + i, 40 + 20 * i, 2048, 8, NUM_EXPERTS, "random")
        got = ctx.native.low_latency_dispatch(x, ids, T_MAX, NUM_EXPERTS, topk_weights=w)
        assert got[2].expert_sums
    torch.cuda.synchronize()
    ll_case(ctx, case_id + 10, route=True, H=2048)
    ll_case(ctx, case_id + 11, route=True, H=2048, T=T_MAX // 2)


def route_errors(ctx: Ctx, case_id: int) -> None:
    """After a dispatch given topk_weights, the combine must get the same topk_idx and topk_weights tensors,
    unmodified: anything else is rejected before a kernel runs (both backends), then the round completes."""
    x, ids, w = make_inputs(ctx, case_id, 16, 2048, 4, 64, "random")
    for buf in (ctx.native, ctx.reference):
        with pytest.raises(TypeError, match="topk_weights must have dtype"):
            buf.low_latency_dispatch(x, ids, 16, 64, topk_weights=w.double())
        with pytest.raises(ValueError, match="topk_weights"):
            buf.low_latency_dispatch(x, ids, 16, 64, topk_weights=w[:, :2])
        _, _, handle, _, _ = buf.low_latency_dispatch(x, ids, 16, 64, topk_weights=w)
        out = torch.randn(handle.recv_shape, device="cuda").to(torch.bfloat16)
        with pytest.raises(ValueError, match="dispatch's own topk_weights"):
            buf.low_latency_combine(out, ids, w.clone(), handle)
        with pytest.raises(ValueError, match="dispatch's own topk_idx"):
            buf.low_latency_combine(out, ids.clone(), w, handle)
        w.mul_(1.0)  # in place: the version counter moves
        with pytest.raises(ValueError, match="topk_weights was modified in place"):
            buf.low_latency_combine(out, ids, w, handle)
        handle.dispatch_route = None  # (test only) let the round complete on every rank
        buf.low_latency_combine(out, ids, w, handle)


def clean_then_continue(ctx: Ctx, case_id: int) -> None:
    ctx.native.clean_low_latency_buffer(T_MAX, 7168, NUM_EXPERTS)
    ll_case(ctx, case_id, H=2048, use_fp8=True)


def host_errors(ctx: Ctx, case_id: int) -> None:
    """Misuse is rejected before any kernel runs (every rank makes the same bad call)."""
    x, ids, w = make_inputs(ctx, case_id, 16, 2048, 4, 64, "random")
    buf = ctx.native
    with pytest.raises(ValueError, match="more than num_max_dispatch_tokens_per_rank"):
        buf.low_latency_dispatch(x, ids, 8, 64)
    with pytest.raises(TypeError, match="x must have dtype"):
        buf.low_latency_dispatch(x.float(), ids, 16, 64)
    with pytest.raises(TypeError, match="topk_idx must have dtype"):
        buf.low_latency_dispatch(x, ids.int(), 16, 64)
    with pytest.raises(ValueError, match="too small"):
        buf.low_latency_dispatch(x, ids, 4096, 64)  # a T_max far beyond what the buffer was sized for
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        buf.low_latency_dispatch(x[:, :100], ids, 16, 64)
    recv, _, handle, _, _ = buf.low_latency_dispatch(x, ids, 16, 64)
    out = torch.randn(handle.recv_shape, device="cuda").to(torch.bfloat16)
    with pytest.raises(ValueError, match="x must have size"):  # zero_copy still checks x's shape (DeepEP's contract)
        buf.low_latency_combine(out[:, :1], ids, w, handle, zero_copy=True)
    with pytest.raises(ValueError, match="topk_weights|topk_idx"):
        buf.low_latency_combine(out, ids[:, :2], w[:, :2], handle)
    buf.low_latency_combine(out, ids, w, handle)  # the round completes on every rank


def eager_fast_path(ctx: Ctx, case_id: int) -> None:
    """Eager calls of sizes an earlier checked dispatch planned take the fast path (backends/low_latency.py:
    no checked Python path runs) and match the reference, round after round, with and without stats or
    `out`, and under torch's global default device and dtype; input the fast path does not take (another
    layout, dtype or size) goes to the checked path: the same result or the same error."""
    H = 2048
    ll_case(ctx, case_id, use_fp8=True, H=H)  # plans these sizes (the checked path, or the fast one if planned)
    native = ctx.native

    def refuse(*args, **kwargs):
        raise AssertionError("the checked path ran where the fast path should have")

    native._checked_low_latency_dispatch = native._checked_low_latency_combine = refuse
    try:
        for i in range(3):  # both rounds (parities), stats or none, out or none
            ll_case(ctx, case_id + 1 + i, use_fp8=True, H=H, stats=i != 1, use_out=i == 2)
        x, ids, weights = make_inputs(ctx, case_id + 4, T_MAX, H, 8, NUM_EXPERTS, "random")
        want = ctx.reference.low_latency_dispatch(x, ids, T_MAX, NUM_EXPERTS, use_fp8=True)
        expert_x = expert_outputs(ctx, case_id + 4, want[2].recv_shape, want[1].tolist())
        torch.set_default_device("cuda")
        torch.set_default_dtype(torch.bfloat16)
        try:
            got = native.low_latency_dispatch(x, ids, T_MAX, NUM_EXPERTS, use_fp8=True)
            combined = native.low_latency_combine(expert_x, ids, weights, got[2])[0]
        finally:
            torch.set_default_device(None)
            torch.set_default_dtype(torch.float32)
    finally:
        del native._checked_low_latency_dispatch, native._checked_low_latency_combine
    compare_dispatch(got, want, True)
    assert_combined(ctx, combined, expert_x, ids, weights, want[2], False)
    # Column-major x and ids (DeepGEMM-style layouts): the checked path copies them; the same answer.
    x_columns, ids_columns = x.t().contiguous().t(), ids.t().contiguous().t()
    got = native.low_latency_dispatch(x_columns, ids_columns, T_MAX, NUM_EXPERTS, use_fp8=True)
    compare_dispatch(got, want, True)
    torch.testing.assert_close(native.low_latency_combine(expert_x, ids_columns, weights, got[2])[0], combined)
    # Bad input of the planned sizes: the checked path's errors (every rank makes the same bad calls).
    with pytest.raises(TypeError, match="x must have dtype"):
        native.low_latency_dispatch(x.float(), ids, T_MAX, NUM_EXPERTS, use_fp8=True)
    with pytest.raises(TypeError, match="topk_idx must have dtype"):
        native.low_latency_dispatch(x, ids.int(), T_MAX, NUM_EXPERTS, use_fp8=True)
    with pytest.raises(ValueError, match="num_max_dispatch_tokens_per_rank must be a positive int"):
        native.low_latency_dispatch(x, ids, float(T_MAX), NUM_EXPERTS, use_fp8=True)
    with pytest.raises(ValueError, match="x must be on"):
        native.low_latency_dispatch(x.cpu(), ids, T_MAX, NUM_EXPERTS, use_fp8=True)
    got = native.low_latency_dispatch(x, ids, T_MAX, NUM_EXPERTS, use_fp8=True)
    with pytest.raises(ValueError, match="topk_weights must have size"):
        native.low_latency_combine(expert_x, ids, weights[:, :4], got[2])
    with pytest.raises(TypeError, match="x must have dtype"):
        native.low_latency_combine(expert_x.float(), ids, weights, got[2])
    native.low_latency_combine(expert_x, ids, weights, got[2])  # the round completes on every rank


def _cases(ctx: Ctx) -> Dict[str, Callable[[], None]]:
    cases = {
        "bf16": lambda: ll_case(ctx, 1),
        "fp8_float_scales": lambda: ll_case(ctx, 2, use_fp8=True),
        "fp8_round_scale": lambda: ll_case(ctx, 3, use_fp8=True, round_scale=True, H=4096),
        "fp8_ue8m0": lambda: ll_case(ctx, 4, use_fp8=True, round_scale=True, use_ue8m0=True, H=2048),
        "hook_bf16": lambda: ll_case(ctx, 5, hook=True, H=2880),
        "hook_fp8_ue8m0": lambda: ll_case(ctx, 6, hook=True, use_fp8=True, round_scale=True, use_ue8m0=True),
        "zero_copy": lambda: ll_case(ctx, 7, zero_copy=True, H=1536, use_fp8=True),
        "zero_copy_hook_out": lambda: ll_case(ctx, 8, zero_copy=True, hook=True, use_out=True, H=4096),
        "out": lambda: ll_case(ctx, 9, use_out=True, H=2048),
        "skewed": lambda: ll_case(ctx, 10, routing="skewed", use_fp8=True),
        "one_expert": lambda: ll_case(ctx, 11, routing="one_expert", H=2048),
        "minus_one": lambda: ll_case(ctx, 12, routing="minus_one", use_fp8=True, H=2880),
        "unrouted": lambda: ll_case(ctx, 13, routing="unrouted", H=2048),
        "zero_tokens_one_rank": lambda: ll_case(ctx, 14, empty_ranks=(0,), use_fp8=True, H=2048),
        "zero_tokens_everywhere": lambda: ll_case(ctx, 15, T=0, hook=True, H=2048),
        # Token counts differ by rank and stay within T_max at any rank count (37 .. 117 at 8 ranks): a rank
        # past T_max raises before its dispatch, and the others' dispatches would meet its next call's.
        "fewer_tokens_than_t_max": lambda: ll_case(ctx, 16, T=37 + (20 * ctx.rank) % 91, use_fp8=True),
        "small_t_max": lambda: ll_case(ctx, 17, t_max=1, use_fp8=True, round_scale=True),
        "mask_after_dispatch": lambda: ll_case(ctx, 18, mask_after=True, use_fp8=True, H=2048),
        "no_stats": lambda: ll_case(ctx, 19, stats=False, H=2048),
        "topk1": lambda: ll_case(ctx, 20, K=1, H=2048),
        "topk16": lambda: ll_case(ctx, 21, K=16, use_fp8=True, H=4096),
        "topk32_small_e": lambda: ll_case(ctx, 22, K=32, E=64, H=2048),
        "experts8": lambda: ll_case(ctx, 23, E=8, K=4, H=2048),
        "two_rounds_in_flight": lambda: two_rounds_in_flight(ctx, 24),
        "host_errors": lambda: host_errors(ctx, 25),
        "clean_then_continue": lambda: clean_then_continue(ctx, 26),
        "eager_fast_path": lambda: eager_fast_path(ctx, 50),
        "cuda_graph_1000_replays": lambda: cuda_graph_replays(ctx, 27, 1000),
        "route_bf16": lambda: ll_case(ctx, 30, route=True),
        "route_fp8": lambda: ll_case(ctx, 31, route=True, use_fp8=True),
        "route_ue8m0_hook": lambda: ll_case(ctx, 32, route=True, use_fp8=True, round_scale=True, use_ue8m0=True,
                                            hook=True, H=2880),
        "route_zero_copy_hook_out": lambda: ll_case(ctx, 33, route=True, zero_copy=True, hook=True, use_out=True,
                                                    H=4096),
        "route_skewed": lambda: ll_case(ctx, 34, route=True, routing="skewed", use_fp8=True),
        "route_minus_one": lambda: ll_case(ctx, 35, route=True, routing="minus_one", H=1536),
        "route_unrouted": lambda: ll_case(ctx, 36, route=True, routing="unrouted", H=2048),
        "route_zero_tokens_one_rank": lambda: ll_case(ctx, 37, route=True, empty_ranks=(1,), H=2048),
        "route_fewer_tokens_small_t_max": lambda: ll_case(ctx, 38, route=True, t_max=3, T=1 + ctx.rank % 3, H=2048),
        "route_topk16": lambda: ll_case(ctx, 39, route=True, K=16, use_fp8=True, H=4096),
        "route_topk32_small_e": lambda: ll_case(ctx, 40, route=True, K=32, E=64, H=2048),
        "route_two_rounds": lambda: (ll_case(ctx, 41, route=True, H=2048), ll_case(ctx, 42, H=2048),
                                     ll_case(ctx, 43, route=True, H=7168, use_fp8=True)),
        "route_errors": lambda: route_errors(ctx, 44),
        "route_dispatches_without_combine": lambda: route_dispatches_without_combine(ctx, 46),
        "route_cuda_graph_200_replays": lambda: cuda_graph_replays(ctx, 45, 200, route=True),
    }
    for i, H in enumerate((2048, 4096, 7168, 1536, 2880)):
        for j, fp8_options in enumerate(({}, dict(use_fp8=True), dict(use_fp8=True, round_scale=True, use_ue8m0=True))):
            name = f"hidden{H}_" + ("bf16", "fp8", "ue8m0")[j]
            cases[name] = (lambda H=H, opts=fp8_options, cid=100 + 3 * i + j: ll_case(ctx, cid, H=H, **opts))
    return cases


def case_names() -> List[str]:
    names = ["bf16", "fp8_float_scales", "fp8_round_scale", "fp8_ue8m0", "hook_bf16", "hook_fp8_ue8m0", "zero_copy",
             "zero_copy_hook_out", "out", "skewed", "one_expert", "minus_one", "unrouted", "zero_tokens_one_rank",
             "zero_tokens_everywhere", "fewer_tokens_than_t_max", "small_t_max", "mask_after_dispatch", "no_stats",
             "topk1", "topk16", "topk32_small_e", "experts8", "two_rounds_in_flight", "host_errors",
             "clean_then_continue", "eager_fast_path"]
    names += [f"hidden{H}_{kind}" for H in (2048, 4096, 7168, 1536, 2880) for kind in ("bf16", "fp8", "ue8m0")]
    names += ["cuda_graph_1000_replays", "route_bf16", "route_fp8", "route_ue8m0_hook", "route_zero_copy_hook_out",
              "route_skewed", "route_minus_one", "route_unrouted", "route_zero_tokens_one_rank",
              "route_fewer_tokens_small_t_max", "route_topk16", "route_topk32_small_e", "route_two_rounds",
              "route_errors", "route_dispatches_without_combine"]
    return names + ["route_cuda_graph_200_replays"]


CASE_NAMES = case_names()


def low_latency_worker(rank: int, R: int, group, seed: int, partials: str = "bf16",
                       names: Optional[List[str]] = None) -> Dict[str, Optional[str]]:
    """Runs the cases `names` (default: all) on buffers with low_latency.expert_sums_partials = `partials`."""
    ctx = Ctx(rank, R, group, seed, partials=partials)
    cases = _cases(ctx)
    assert sorted(cases) == sorted(CASE_NAMES), "case_names() and _cases() must list the same cases"
    names = names or CASE_NAMES
    results = run_each(cases, names)
    ctx.destroy()
    return results


@pytest.fixture(scope="module")
def launch():
    # NOTE: well under the 300 s a GPU run gives this file: a
    # rank left waiting in NCCL after its peer trapped must fail this launch, not get pytest killed.
    return parallel_launch(RANKS, low_latency_worker, BASE_SEED, timeout_s=200)


@needs_gpus
@pytest.mark.parametrize("case", CASE_NAMES)
def test_native_low_latency(launch, case):
    assert_case_passed(launch, case, f"EP_TEST_SEED={BASE_SEED}, {RANKS} ranks")


# ---- expert-side sums with fp32 partials (low_latency.expert_sums_partials: fp32), a launch of its own --
FP32_PARTIALS_CASES = ["route_bf16", "route_ue8m0_hook", "route_zero_copy_hook_out", "route_skewed",
                       "route_minus_one", "route_topk32_small_e", "route_two_rounds", "route_cuda_graph_200_replays"]


@pytest.fixture(scope="module")
def launch_fp32_partials():
    return parallel_launch(RANKS, low_latency_worker, BASE_SEED, "fp32", FP32_PARTIALS_CASES, timeout_s=150)


@needs_gpus
@pytest.mark.parametrize("case", FP32_PARTIALS_CASES)
def test_native_low_latency_fp32_partials(launch_fp32_partials, case):
    assert_case_passed(launch_fp32_partials, case, f"EP_TEST_SEED={BASE_SEED}, {RANKS} ranks, fp32 partials")


# ---- launches that end in a device trap ---------------------------------------------------------------
def report_device_error(ctx: Ctx, error: Exception, expected: str) -> None:
    """Ends this rank with the device's report: `error`'s message if it holds `expected`, else (the CUDA
    error surfaced first) the runtime's description of the device error."""
    message = str(error)
    if expected not in message:
        try:
            ctx.native._backend._ll.check_device_error()
        except Exception as detail:  # noqa: BLE001 - the message is the point of the test
            message = str(detail)
    finish_rank(message)  # the context is stopped: end before any tensor is freed


# ---- a missing peer: the device wait times out and names rank, peer and expert ------------------------
def missing_peer_rank(rank: int, R: int, group, op: str) -> str:
    ctx = Ctx(rank, R, group, BASE_SEED, timeout_s=3.0)
    x, ids, w = make_inputs(ctx, 1, 32, 2048, 4, 64, "random")
    if op.startswith("combine"):
        route = dict(topk_weights=w) if op == "combine_expert_sums" else {}
        _, count, handle, _, _ = ctx.native.low_latency_dispatch(x, ids, 32, 64, **route)
        torch.cuda.synchronize()
    if rank == 1:
        time.sleep(8)  # never joins (rank 0 times out after 3 s)
        return "absent"
    try:
        if op == "dispatch":
            ctx.native.low_latency_dispatch(x, ids, 32, 64)
        else:
            out = torch.zeros(handle.recv_shape, dtype=torch.bfloat16, device="cuda")
            ctx.native.low_latency_combine(out, ids, w, handle)
        torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001 - the message is the point of the test
        report_device_error(ctx, error, "waited for peer")
    return "no error"


@needs_ranks(RANKS, own_gpus=True, module=_C_nvshmem)
@pytest.mark.parametrize("op", ["dispatch", "combine", "combine_expert_sums"])
def test_missing_peer_times_out_with_rank_peer_and_expert(op):
    results = parallel_launch(RANKS, missing_peer_rank, op, timeout_s=120)
    assert results[1] == "absent"
    message = results[0]
    what = "partial sum for token" if op == "combine_expert_sums" else "expert"
    assert "timeout" in message and "rank 0" in message and "peer 1" in message and what in message, message


# ---- ranks that disagree on topk_weights or on the partials: a device error naming rank and peer -----
def disagreeing_rank(rank: int, R: int, group, on: str) -> str:
    """Rank 0 passes topk_weights and the others not (`on="topk_weights"`), or every rank passes them and
    rank 0 asks for bf16 partials, the others fp32 (`on="partials"`)."""
    partials = "bf16" if rank == 0 or on != "partials" else "fp32"
    ctx = Ctx(rank, R, group, BASE_SEED, timeout_s=3.0, partials=partials)
    x, ids, w = make_inputs(ctx, 1, 32, 2048, 4, 64, "random")
    route = dict(topk_weights=w) if rank == 0 or on == "partials" else {}
    try:
        ctx.native.low_latency_dispatch(x, ids, 32, 64, **route)
        torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001 - the message is the point of the test
        report_device_error(ctx, error, "got a dispatch from peer")
    return "no error"


@needs_ranks(RANKS, own_gpus=True, module=_C_nvshmem)
def test_ranks_that_disagree_on_topk_weights_get_a_device_error():
    results = parallel_launch(RANKS, disagreeing_rank, "topk_weights", timeout_s=120)
    assert "rank 0 got a dispatch from peer 1 that did not carry topk_weights while its own did" in results[0], \
        results[0]
    assert "rank 1 got a dispatch from peer 0 that carried topk_weights while its own did not" in results[1], \
        results[1]


@needs_ranks(RANKS, own_gpus=True, module=_C_nvshmem)
def test_ranks_that_disagree_on_expert_sums_partials_get_a_device_error():
    results = parallel_launch(RANKS, disagreeing_rank, "partials", timeout_s=120)
    assert "rank 0 got a dispatch from peer 1 whose combine sends fp32 partials while its own sends bf16" \
        in results[0], results[0]
    assert "rank 1 got a dispatch from peer 0 whose combine sends bf16 partials while its own sends fp32" \
        in results[1], results[1]


# ---- ranks whose calls have different layouts: a device error naming the cause --------------------
def mismatched_layout_rank(rank: int, R: int, group, differs: str) -> str:
    """Rank 0 calls with T_max 32 and the others with 48 (`differs="t_max"`), or rank 0 sends FP8 and the
    others bf16 (`differs="use_fp8"`): what ranks whose calls are out of step do. The count words carry a
    tag of the sender's layout, and each receiver must stop with an error naming both ranks, never read
    the rows (an illegal access, or silently wrong rows for the dtype) where another layout put them."""
    ctx = Ctx(rank, R, group, BASE_SEED, timeout_s=3.0)
    x, ids, _ = make_inputs(ctx, 1, 32, 2048, 4, 64, "random")
    t_max = 48 if differs == "t_max" and rank > 0 else 32
    use_fp8 = rank == 0 or differs != "use_fp8"
    try:
        ctx.native.low_latency_dispatch(x, ids, t_max, 64, use_fp8=use_fp8)
        torch.cuda.synchronize()
    except Exception as error:  # noqa: BLE001 - the message is the point of the test
        report_device_error(ctx, error, "laid out for another call")
    return "no error"


@needs_ranks(RANKS, own_gpus=True, module=_C_nvshmem)
@pytest.mark.parametrize("differs", ["t_max", "use_fp8"])
def test_ranks_whose_calls_disagree_on_the_layout_get_a_device_error(differs):
    results = parallel_launch(RANKS, mismatched_layout_rank, differs, timeout_s=120)
    for rank, message in enumerate(results):
        # Rank 0 differs from every peer (it may name any of them); the others differ from rank 0 only.
        peers = range(1, RANKS) if rank == 0 else [0]
        assert any(f"rank {rank} got a dispatch from peer {peer} (expert" in message for peer in peers), message
        assert "laid out for another call" in message and "same sequence of low-latency calls" in message, message


# ---- an expert id out of range: recorded on the device, raised at the rank's next dispatch ---------
def bad_expert_id_rank(rank: int, R: int, group, bad_value: int) -> str:
    """The last rank's topk_idx[3, 1] is `bad_value` (outside [-1, num_experts)); check_inputs is off. The round
    runs on every rank as if the id were -1 (checked against the reference given -1 there); the culprit's
    next low_latency_dispatch raises a ValueError naming the entry and launches nothing; then a normal round
    passes on every rank (the Buffer stays usable, the rounds stay paired)."""
    ctx = Ctx(rank, R, group, BASE_SEED, timeout_s=10.0)
    culprit, H, K, E = R - 1, 2048, 4, 64
    x, ids, weights = make_inputs(ctx, 60, 48, H, K, E, "random")
    if rank == culprit:
        ids[3, 1] = bad_value
    reading = torch.where((ids >= -1) & (ids < E), ids, -1)  # what the kernels read
    poison_allocator(256)
    got = ctx.native.low_latency_dispatch(x, ids, T_MAX, E, use_fp8=False)
    want = ctx.reference.low_latency_dispatch(x, reading, T_MAX, E, use_fp8=False)
    compare_dispatch(got, want, False)
    combine_x = expert_outputs(ctx, 60, want[2].recv_shape, want[1].tolist())
    combined = ctx.native.low_latency_combine(combine_x, ids, weights, got[2])[0]
    torch.testing.assert_close(combined, ctx.reference.low_latency_combine(combine_x, reading, weights, want[2])[0])
    torch.cuda.synchronize()
    error = ""
    if rank == culprit:
        with pytest.raises(ValueError) as raised:
            ctx.native.low_latency_dispatch(x, ids, T_MAX, E, use_fp8=False)
        error = str(raised.value)
    ll_case(ctx, 61, H=H, use_fp8=True)
    ctx.destroy()
    return error


@needs_ranks(RANKS, own_gpus=True, module=_C_nvshmem)
@pytest.mark.parametrize("bad_value", [64, -2])
def test_expert_id_out_of_range_is_raised_at_the_next_dispatch(bad_value):
    results = parallel_launch(RANKS, bad_expert_id_rank, bad_value, timeout_s=150)
    culprit = RANKS - 1
    assert results[:culprit] == [""] * culprit, results
    message = results[culprit]
    assert f"rank {culprit}: topk_idx[3, 1] = {bad_value} in its previous low_latency_dispatch" in message, message
    assert "treated it as -1" in message and "sent nothing" in message, message
