"""Reference backend, normal mode, through the public `ep_plugin.Buffer`.

get_dispatch_layout, dispatch (bf16 and FP8 tuples, weights, alignment, num_worst_tokens padding),
cached dispatch and combine (0/1/2 biases) on 2, 4 and 8 ranks, compared with tests/dense_oracle.py.
One process launch per world size runs every case (a launch costs seconds); each test reports one
case. Shapes and data are random every run: set EP_TEST_SEED to replay a run (failures print it).
Runs on CPU with gloo; on a machine with enough GPUs the same tests run on CUDA with NCCL.
"""
from __future__ import annotations

import os
import random
from typing import Callable, Dict, List, Optional

import pytest
import torch

import dense_oracle as oracle
from case_runner import assert_case_passed, run_each
import ep_plugin
from ep_plugin.launch import parallel_launch

BASE_SEED = int(os.environ.get("EP_TEST_SEED", random.SystemRandom().randrange(1 << 30)))
WORLD_SIZES = (2, 4, 8)


# ---- inputs ----------------------------------------------------------------------------------------
def route_uniform(drop: float = 0.25) -> Callable:
    """Distinct random experts per token, each entry -1 with probability `drop`."""
    def route(gen, num_tokens, top_k, num_experts, num_ranks):
        ids = torch.rand(num_tokens, num_experts, generator=gen).argsort(dim=1)[:, :top_k]
        return ids.masked_fill(torch.rand(num_tokens, top_k, generator=gen) < drop, -1)
    return route


def route_to_rank(target: int) -> Callable:
    """Every entry goes to an expert of rank `target` (top-k <= experts per rank)."""
    def route(gen, num_tokens, top_k, num_experts, num_ranks):
        num_local = num_experts // num_ranks
        return target * num_local + torch.rand(num_tokens, num_local, generator=gen).argsort(dim=1)[:, :top_k]
    return route


def route_one_expert(expert: int) -> Callable:
    """Each token selects only `expert`, at a random top-k position; the other entries are -1."""
    def route(gen, num_tokens, top_k, num_experts, num_ranks):
        ids = torch.full((num_tokens, top_k), -1, dtype=torch.int64)
        ids[torch.arange(num_tokens), torch.randint(0, top_k, (num_tokens,), generator=gen)] = expert
        return ids
    return route


def route_nowhere(gen, num_tokens, top_k, num_experts, num_ranks):
    return torch.full((num_tokens, top_k), -1, dtype=torch.int64)


def random_bf16(gen, rows: int, hidden: int) -> torch.Tensor:
    scale = torch.rand(rows, 1, generator=gen) * 10 + 0.1
    return (torch.randn(rows, hidden, generator=gen) * scale).to(torch.bfloat16)


def random_fp8(gen, rows: int, hidden: int) -> torch.Tensor:
    return (torch.randn(rows, hidden, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)


# ---- checks ----------------------------------------------------------------------------------------
def assert_equal(name: str, actual: Optional[torch.Tensor], expected: Optional[torch.Tensor]) -> None:
    """Exact equality of dtype, shape and bits (FP8 compared through its bytes)."""
    if expected is None or actual is None:
        assert actual is None and expected is None, f"{name}: got {actual!r}, expected {expected!r}"
        return
    actual = actual.cpu()
    assert actual.dtype == expected.dtype, f"{name}: dtype {actual.dtype}, expected {expected.dtype}"
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    if actual.element_size() == 1:
        actual, expected = actual.view(torch.uint8), expected.view(torch.uint8)
    if not torch.equal(actual, expected):
        bad = (actual != expected).nonzero()[:5].tolist()
        raise AssertionError(f"{name}: differs at {bad} (first 5)")


def pad_rows(tensor: torch.Tensor, rows: int, value) -> torch.Tensor:
    padding = torch.full((rows - tensor.size(0), *tensor.shape[1:]), value, dtype=tensor.dtype)
    return torch.cat([tensor, padding])


# ---- the launched worker ---------------------------------------------------------------------------
class Ctx:
    """One rank's view of a launch: rank, group, buffers, device and the run's seed."""

    def __init__(self, rank: int, num_ranks: int, group, seed: int) -> None:
        self.rank, self.num_ranks, self.group, self.seed = rank, num_ranks, group, seed
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
        self.buffer = ep_plugin.Buffer(group, config={"backend": "reference", "check_inputs": True})
        self.other = ep_plugin.Buffer(group, config={"backend": "reference", "check_inputs": True})
        self.ranks_per_node = max(1, num_ranks // 2)
        self.multinode = ep_plugin.Buffer(group, config={"backend": "reference", "check_inputs": True,
                                                         "topology": {"ranks_per_node": self.ranks_per_node}})

    def rngs(self, case_id: int):
        """(python Random, torch Generator), identical on every rank for this case."""
        seed = self.seed * 1000 + case_id
        return random.Random(seed), torch.Generator().manual_seed(seed)


def dispatch_round(ctx: Ctx, case_id: int, *, tokens: Optional[List[int]] = None, route: Optional[Callable] = None,
                   fp8_scales: int = 0, weights: bool = True, alignment: int = 1, worst: bool = False,
                   num_biases: int = 0, combine_weights: bool = True, cached: Optional[str] = None,
                   buffer=None, ranks_per_node: Optional[int] = None, top_k: Optional[int] = None) -> None:
    """Layout, dispatch, combine and (optionally) cached dispatch on every rank, then the checks.

    Every rank generates every rank's inputs from the case's seed, so the oracle sees them all.
    All communication happens before any check, so a failed check never leaves a rank waiting.
    """
    py, gen = ctx.rngs(case_id)
    rank, num_ranks, dev = ctx.rank, ctx.num_ranks, ctx.device
    buffer = buffer or ctx.buffer
    ranks_per_node = ranks_per_node or num_ranks
    hidden = 16 * py.randint(1, 40) if fp8_scales else 8 * py.randint(1, 80)
    num_experts = num_ranks * py.randint(1, 6)
    top_k = top_k or py.randint(1, min(num_experts, 8))
    tokens = tokens if tokens is not None else [py.randint(1, 48) for _ in range(num_ranks)]
    route = route or route_uniform()

    topk_idxs = [route(gen, tokens[r], top_k, num_experts, num_ranks) for r in range(num_ranks)]
    top_k = topk_idxs[0].size(1)
    xs = [(random_fp8 if fp8_scales else random_bf16)(gen, tokens[r], hidden) for r in range(num_ranks)]
    scales = [torch.rand(tokens[r], fp8_scales, generator=gen) + 0.5 for r in range(num_ranks)] if fp8_scales else None
    ws = [torch.rand(tokens[r], top_k, generator=gen) for r in range(num_ranks)] if weights else None
    recv_counts = [len(oracle.dispatch_sources(d, num_experts, topk_idxs)) for d in range(num_ranks)]
    num_worst = max(recv_counts) + py.randint(0, 3) + 1 if worst else 0
    rows = [num_worst or count for count in recv_counts]
    # Combine inputs; padding rows are poisoned and must be ignored.
    cxs = [pad_rows(random_bf16(gen, recv_counts[d], hidden), rows[d], float("nan")) for d in range(num_ranks)]
    cws = None
    if combine_weights:
        cws = [pad_rows(torch.rand(recv_counts[d], top_k, generator=gen), rows[d], float("nan"))
               for d in range(num_ranks)]
    all_biases = [[random_bf16(gen, tokens[r], hidden) for _ in range(num_biases)] for r in range(num_ranks)]
    biases = all_biases[rank]
    hidden2 = 16 * py.randint(1, 20)
    xs2 = [(random_fp8 if cached == "fp8" else random_bf16)(gen, tokens[r], hidden2) for r in range(num_ranks)]
    scales2 = [torch.randn(tokens[r], 3, generator=gen) for r in range(num_ranks)] if cached == "fp8" else None

    # ---- communication ----
    topk_idx = topk_idxs[rank].to(dev)
    per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    x_arg = (xs[rank].to(dev), scales[rank].to(dev)) if fp8_scales else xs[rank].to(dev)
    recv_x, recv_idx, recv_w, per_expert_list, handle, _ = buffer.dispatch(
        x_arg, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=topk_idx,
        topk_weights=ws[rank].to(dev) if weights else None, expert_alignment=alignment, num_worst_tokens=num_worst)
    bias_arg = None if num_biases == 0 else biases[0].to(dev) if num_biases == 1 else \
        tuple(b.to(dev) for b in biases)
    combined, combined_w, _ = buffer.combine(cxs[rank].to(dev), handle,
                                             topk_weights=cws[rank].to(dev) if combine_weights else None,
                                             bias=bias_arg)
    cached_out = None
    if cached:
        x2_arg = (xs2[rank].to(dev), scales2[rank].to(dev)) if cached == "fp8" else xs2[rank].to(dev)
        cached_out, *cached_rest = buffer.dispatch(x2_arg, handle=handle)

    # ---- checks ----
    want = oracle.layout(topk_idxs[rank], num_experts, num_ranks, ranks_per_node)
    for name, got, exp in zip(("num_tokens_per_rank", "num_tokens_per_rdma_rank", "num_tokens_per_expert",
                               "is_token_in_rank"), (per_rank, per_rdma, per_expert, in_rank), want):
        assert_equal(name, got, exp)

    exp = oracle.dispatch(rank, num_experts, xs, topk_idxs, ws, scales, alignment)
    n = len(exp["sources"])
    assert n == recv_counts[rank]
    data, data_scales = recv_x if fp8_scales else (recv_x, None)
    assert isinstance(recv_x, tuple) == bool(fp8_scales), "recv_x must be a tuple exactly when x was"
    assert data.shape == (rows[rank], hidden) and data.dtype == xs[rank].dtype, (data.shape, data.dtype)
    assert_equal("recv_x", data[:n], exp["recv_x"])
    if fp8_scales:
        assert data_scales.shape == (rows[rank], fp8_scales)
        assert_equal("recv_x_scales", data_scales[:n], exp["recv_x_scales"])
    assert_equal("recv_topk_idx", recv_idx, pad_rows(exp["recv_topk_idx"], rows[rank], -1))
    expected_w = None if not weights else pad_rows(exp["recv_topk_weights"], rows[rank], 0.0)
    assert_equal("recv_topk_weights", recv_w, expected_w)
    expected_list = [] if worst else exp["num_recv_tokens_per_expert_list"]
    assert per_expert_list == expected_list, f"per-expert list {per_expert_list}, expected {expected_list}"

    exp_x, exp_w = oracle.combine(rank, num_experts, topk_idxs, cxs, cws, biases)
    assert combined.dtype == torch.bfloat16
    torch.testing.assert_close(combined.cpu(), exp_x, msg=lambda m: f"combined_x: {m}")
    if combine_weights:
        torch.testing.assert_close(combined_w.cpu(), exp_w, msg=lambda m: f"combined_topk_weights: {m}")
    else:
        assert combined_w is None

    if cached:
        assert all(item is None for item in cached_rest[:4]), "cached dispatch returns None for idx/weights/list/handle"
        exp2 = oracle.dispatch(rank, num_experts, xs2, topk_idxs, None, scales2)
        data2, scales2_out = cached_out if cached == "fp8" else (cached_out, None)
        assert data2.shape == (rows[rank], hidden2)
        assert_equal("cached recv_x", data2[:n], exp2["recv_x"])
        if cached == "fp8":
            assert_equal("cached recv_x_scales", scales2_out[:n], exp2["recv_x_scales"])


def check_ids_once_per_unchanged_tensor(buf, x, topk, num_experts: int, layout: dict) -> None:
    """The ids that a layout call checked are not checked again by the dispatch given the same tensor
    (one host sync less per step), but are once the tensor changed in place."""
    from ep_plugin import validation
    checked, original = [], validation.check_expert_ids
    validation.check_expert_ids = lambda *args: (checked.append(args[1]), original(*args))
    try:
        ids = topk.clone()
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(ids, num_experts)
        buf.dispatch(x, topk_idx=ids, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                     num_tokens_per_expert=per_expert)
        assert [t is ids for t in checked] == [True], "the dispatch checked the layout's ids again"
        ids[1, 0] = num_experts + 3  # in place: the version counter moves
        with pytest.raises(ValueError, match=r"topk_idx\[1, 0\] = %d is not an expert id" % (num_experts + 3)):
            buf.dispatch(x, topk_idx=ids, **layout)
        assert len(checked) == 2
    finally:
        validation.check_expert_ids = original


def case_set_num_sms_reaches_later_calls(ctx: Ctx) -> None:
    """`Buffer.set_num_sms` changes the SMs of the next calls made without a config (the buffer keeps
    its default configs between calls), as DeepEP's class-wide setting does."""
    buf, dev = ctx.buffer, ctx.device
    num_experts = 2 * ctx.num_ranks
    topk = torch.tensor([[0, 1], [num_experts - 1, -1]], device=dev)
    x = torch.randn(2, 64, device=dev).to(torch.bfloat16)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, num_experts)
    recv, _, _, _, handle, _ = buf.dispatch(x, topk_idx=topk, num_tokens_per_rank=per_rank,
                                            is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    backend, seen = buf._backend, []
    calls = {name: getattr(backend, name) for name in ("cached_dispatch", "combine")}

    def spy(kind: str, call):  # records the SMs of the config each call was given (its last argument)
        return lambda *args: (seen.append((kind, args[-1].num_sms)), call(*args))[1]

    backend.cached_dispatch = spy("dispatch", calls["cached_dispatch"])
    backend.combine = spy("combine", calls["combine"])
    saved = (ep_plugin.Buffer.num_sms, ep_plugin.Buffer._num_sms_set_explicitly)
    try:
        for num_sms in (saved[0], 12, 8):
            if num_sms != saved[0]:
                ep_plugin.Buffer.set_num_sms(num_sms)
            buf.dispatch(x, handle=handle)
            buf.combine(recv, handle)
        assert seen == [(kind, n) for n in (saved[0], 12, 8) for kind in ("dispatch", "combine")], seen
    finally:
        ep_plugin.Buffer.num_sms, ep_plugin.Buffer._num_sms_set_explicitly = saved
        for name, call in calls.items():
            setattr(backend, name, call)


def case_bad_inputs(ctx: Ctx) -> None:
    """Bad arguments are rejected before anything runs (every rank makes the same bad call)."""
    dev, buf = ctx.device, ctx.buffer
    num_experts = 2 * ctx.num_ranks
    topk = torch.tensor([[0, 1], [num_experts - 1, -1]], device=dev)
    x = torch.randn(2, 64, device=dev).to(torch.bfloat16)
    with pytest.raises(TypeError, match="topk_idx must have dtype"):
        buf.get_dispatch_layout(topk.int(), num_experts)
    with pytest.raises(ValueError, match=r"topk_idx\[1, 0\] = %d is not an expert id" % (num_experts + 1)):
        buf.get_dispatch_layout(topk + 2, num_experts)
    with pytest.raises(ValueError, match="is not an expert id"):
        buf.get_dispatch_layout(torch.full_like(topk, -2), num_experts)
    with pytest.raises(ValueError, match="divisible"):
        buf.get_dispatch_layout(topk, num_experts + 1)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, num_experts)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    check_ids_once_per_unchanged_tensor(buf, x, topk, num_experts, layout)
    with pytest.raises(TypeError, match="x must have dtype"):
        buf.dispatch(x.float(), topk_idx=topk, **layout)
    with pytest.raises(ValueError, match="x must be 2-D"):
        buf.dispatch(x[None], topk_idx=topk, **layout)
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        buf.dispatch(x[:, :60], topk_idx=topk, **layout)
    with pytest.raises(ValueError, match="topk_weights must have size"):
        buf.dispatch(x, topk_idx=topk, topk_weights=torch.ones(2, 3, device=dev), **layout)
    with pytest.raises(ValueError, match="needs num_tokens_per_rank, is_token_in_rank"):
        buf.dispatch(x, topk_idx=topk)
    # Handles: from another Buffer, of the wrong kind, or not a handle.
    recv, _, _, _, handle, _ = buf.dispatch(x, topk_idx=topk, **layout)
    _, _, _, _, foreign, _ = ctx.other.dispatch(x, topk_idx=topk, **layout)
    rows = recv.size(0)
    y = torch.randn(rows, 64, device=dev).to(torch.bfloat16)
    with pytest.raises(ValueError, match="handle does not come from this Buffer"):
        buf.combine(y, foreign)
    with pytest.raises(ValueError, match="handle does not come from this Buffer"):
        buf.combine(y, "not a handle")
    with pytest.raises(ValueError, match="handle does not come from this Buffer"):
        buf.dispatch(x, handle=foreign)
    with pytest.raises(ValueError, match=f"x must have size {rows} in dimension 0"):
        buf.combine(torch.zeros(rows + 1, 64, dtype=torch.bfloat16, device=dev), handle)
    with pytest.raises(ValueError, match="takes no topk_idx"):
        buf.dispatch(x, handle=handle, topk_idx=topk)
    with pytest.raises(ValueError, match="tokens but the handle was made for"):
        buf.dispatch(x[:1], handle=handle)
    with pytest.raises(ValueError, match=r"bias\[0\] must have size"):
        buf.combine(y, handle, bias=torch.zeros(3, 64, dtype=torch.bfloat16, device=dev))
    with pytest.raises(RuntimeError, match="low-latency kernels need"):
        buf.low_latency_dispatch(x, topk, 8, num_experts)
    # Inconsistent layout on one rank: the backend rejects the dispatch on every rank.
    bad_per_rank = per_rank.clone()
    if ctx.rank == 0:
        bad_per_rank[0] += 1
    with pytest.raises(ValueError, match="rank 0: num_tokens_per_rank does not match is_token_in_rank"):
        buf.dispatch(x, topk_idx=topk, num_tokens_per_rank=bad_per_rank, is_token_in_rank=in_rank,
                     num_tokens_per_expert=per_expert)
    # Ranks disagreeing on the row layout (here the hidden size): rejected on every rank.
    with pytest.raises(ValueError, match="ranks disagree on the row layout"):
        buf.dispatch(x if ctx.rank == 0 else x[:, :32], topk_idx=topk, **layout)
    # The buffer still works afterwards.
    recv, *_ = buf.dispatch(x, topk_idx=topk, **layout)
    assert recv.size(0) == rows


def case_worst_tokens_overflow(ctx: Ctx) -> None:
    """num_worst_tokens smaller than what rank 0 receives: a RuntimeError on every rank."""
    dev, buf = ctx.device, ctx.buffer
    num_experts = ctx.num_ranks
    topk = torch.zeros(3, 1, dtype=torch.int64, device=dev)  # 3 tokens from each rank, all to rank 0
    x = torch.randn(3, 32, device=dev).to(torch.bfloat16)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk, num_experts)
    with pytest.raises(RuntimeError, match=rf"rank 0 receives {3 * ctx.num_ranks} tokens but num_worst_tokens = 2"):
        buf.dispatch(x, topk_idx=topk, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                     num_tokens_per_expert=per_expert, num_worst_tokens=2)
    recv, *_ = buf.dispatch(x, topk_idx=topk, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                            num_tokens_per_expert=per_expert, num_worst_tokens=3 * ctx.num_ranks)
    assert recv.size(0) == 3 * ctx.num_ranks


def _cases(ctx: Ctx) -> Dict[str, Callable[[], None]]:
    last = ctx.num_ranks - 1
    return {
        "bf16_weights_alignment": lambda: dispatch_round(ctx, 1, alignment=random.Random(ctx.seed).choice([2, 4, 128])),
        "bf16_no_weights_one_bias": lambda: dispatch_round(ctx, 2, weights=False, combine_weights=False,
                                                           num_biases=1),
        "fp8_tuple_cached_bf16": lambda: dispatch_round(ctx, 3, fp8_scales=1 + random.Random(ctx.seed).randrange(4),
                                                        cached="bf16", num_biases=2),
        "bf16_cached_fp8_tuple": lambda: dispatch_round(ctx, 4, cached="fp8", combine_weights=False),
        "rank_with_zero_tokens": lambda: dispatch_round(
            ctx, 5, tokens=[0 if r == 1 else 7 + 5 * r for r in range(ctx.num_ranks)], num_biases=2),
        "zero_tokens_everywhere": lambda: dispatch_round(ctx, 6, tokens=[0] * ctx.num_ranks, num_biases=1,
                                                         cached="fp8"),
        "all_to_last_rank": lambda: dispatch_round(ctx, 7, route=route_to_rank(last), top_k=1),
        "all_to_one_expert": lambda: dispatch_round(ctx, 8, route=route_one_expert(0), num_biases=1),
        "unrouted_tokens": lambda: dispatch_round(ctx, 9, route=route_nowhere, num_biases=2),
        "heavy_drop": lambda: dispatch_round(ctx, 10, route=route_uniform(drop=0.8)),
        "worst_tokens_padding": lambda: dispatch_round(ctx, 11, worst=True, cached="bf16", num_biases=1),
        "worst_tokens_fp8_padding": lambda: dispatch_round(ctx, 12, worst=True, fp8_scales=2, cached="fp8"),
        "worst_tokens_overflow": lambda: case_worst_tokens_overflow(ctx),
        "multinode_layout": lambda: dispatch_round(ctx, 14, buffer=ctx.multinode, ranks_per_node=ctx.ranks_per_node,
                                                   num_biases=1, cached="bf16"),
        # Unlike DeepEP V1, the CUDA-graph path (num_worst_tokens) works across nodes too.
        "multinode_worst_tokens": lambda: dispatch_round(ctx, 15, buffer=ctx.multinode,
                                                         ranks_per_node=ctx.ranks_per_node, worst=True, cached="bf16"),
        "bad_inputs": lambda: case_bad_inputs(ctx),
        "set_num_sms": lambda: case_set_num_sms_reaches_later_calls(ctx),
    }


CASES = ("bf16_weights_alignment", "bf16_no_weights_one_bias", "fp8_tuple_cached_bf16", "bf16_cached_fp8_tuple",
         "rank_with_zero_tokens", "zero_tokens_everywhere", "all_to_last_rank", "all_to_one_expert",
         "unrouted_tokens", "heavy_drop", "worst_tokens_padding", "worst_tokens_fp8_padding",
         "worst_tokens_overflow", "multinode_layout", "multinode_worst_tokens", "bad_inputs", "set_num_sms")


def normal_worker(rank: int, num_ranks: int, group, seed: int) -> Dict[str, Optional[str]]:
    """Run every case on this rank; returns case -> None (passed) or the failure's traceback."""
    return run_each(_cases(Ctx(rank, num_ranks, group, seed)), CASES)


# ---- pytest ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"{n}ranks")
def launch(request):
    seed = BASE_SEED + request.param
    return request.param, seed, parallel_launch(request.param, normal_worker, seed, timeout_s=180)


@pytest.mark.parametrize("case", CASES)
def test_normal(launch, case):
    num_ranks, seed, results = launch
    assert_case_passed(results, case, f"EP_TEST_SEED={BASE_SEED} (seed {seed}), {num_ranks} ranks")
