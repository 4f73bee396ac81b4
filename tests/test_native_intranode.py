"""Native intranode kernels against the reference backend (GPU machine; skipped without GPUs).

Every case draws fresh random data. Routing metadata and copied payloads must be bit-identical to the
reference; combine sums may differ only by fp32 summation order. The caching allocator is poisoned
before native calls so that rows a kernel forgets to write show up as mismatches.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ep_plugin import Buffer, Config, EpTimeoutError
from ep_plugin.config import as_config
from ep_plugin.handles import unwrap
from ep_plugin import tuning
from ep_plugin.tuning import output_region_bytes
from ep_plugin.launch import parallel_launch
from native_helpers import (NORMAL_MODE_CASES, assert_same, capture_graph, copy_engines_at_any_size,
                            dispatch_and_combine, dispatch_error, make_inputs, max_test_sms, multi_gpu_ranks,
                            needs_ranks, poison, poison_allocator, run_case)

RANKS = multi_gpu_ranks()  # 2 unless EP_TEST_RANKS says otherwise


# ---- helpers (run inside the spawned ranks) ---------------------------------------------------
MAX_HIDDEN = 16896  # the buffers' max_hidden unless a test says otherwise


def make_buffers(group, num_sms: int = 24, max_hidden: int = MAX_HIDDEN, timeout_s: float = 20.0,
                 check_inputs: bool = True, combine_staging_tokens=4096, dispatch_output_bytes=0,
                 direct_chunk_tokens: int = 1):
    R = group.size()
    copy_engines_at_any_size()
    num_sms = min(num_sms, max_test_sms() or num_sms)
    num_nvl_bytes = max(Config(num_sms, 8, recv).get_nvl_buffer_size_hint(max_hidden * 2, R) for recv in (64, 256))
    native = Buffer(group, num_nvl_bytes, explicitly_destroy=True,
                    config={"backend": "native", "num_sms": num_sms, "timeout_s": timeout_s,
                            "check_inputs": check_inputs,
                            "buffer": {"max_hidden": max_hidden, "combine_staging_tokens": combine_staging_tokens,
                                       "dispatch_output_bytes": dispatch_output_bytes},
                            "dispatch": {"direct_chunk_tokens": direct_chunk_tokens}})
    reference = Buffer(group, explicitly_destroy=True, config={"backend": "reference"})
    assert native.backend_name == "native" and reference.backend_name == "reference"
    return native, reference


CASES = NORMAL_MODE_CASES + (
    [dict(name="num_worst", T=256, H=4096, K=8, E=64, num_worst_slack=512),
       dict(name="num_worst_fp8", T=256, H=7168, K=8, E=64, num_worst_slack=88, fp8=True),
       dict(name="small_ring", T=700, H=4096, K=8, E=64, config=Config(24, 2, 16), combine_config=Config(24, 2, 16)),
       dict(name="sms2", T=300, H=2048, K=8, E=64, config=Config(2, 8, 64), combine_config=Config(2, 8, 64)),
       dict(name="sms16", T=3000, H=7168, K=8, E=256, config=Config(16, 8, 64), combine_config=Config(16, 8, 64)),
       dict(name="sms48", T=1000, H=7168, K=8, E=256, config=Config(48, 8, 64), combine_config=Config(48, 8, 64)),
       # 132 FP8 scales per token: more than the dispatch loads before the row copy (128), the rest after.
       dict(name="fp8_many_scales", T=256, H=16896, K=8, E=64, fp8=True),
       # More rows x top-k than a two-piece staging area's weights hold: each piece then carries its own.
       dict(name="topk32_many_rows", T=1500, H=2048, K=32, E=64),
       # Expert outputs and weights holding the copy-engine combine's not-landed mark (NaN words).
       dict(name="unlanded_words", T=1200, H=4096, K=8, E=64, unlanded_words=True),
       dict(name="unlanded_words_bias", T=600, H=2048, K=8, E=64, bias=1, unlanded_words=True),
       # Each rank's tokens for itself in 250 runs: more than the copy engine takes (the SMs copy them).
       dict(name="routing_alternate", T=500, H=4096, K=8, E=64, routing="alternate"),
       # The benchmark's size in FP8: at 8 SMs and 2 ranks the engine copies the longest runs of own rows.
       dict(name="fp8_large", T=4096, H=7168, K=8, E=256, fp8=True)]
)


def expected_combine_path(case: dict, R: int, combine_staging_tokens) -> str:
    """The copy engines carry a combine when the dispatch told the host its counts (no num_worst_tokens):
    at 2 ranks into the owner's staging area, at 3-4 ranks within each sender's GPU for the owners to pull,
    if every rank's rows for every owner fit the area. A case of more tokens than the area's rows has more
    rows than that for some owner (random routing over 64 or more experts sends an owner's token to a
    given rank with p >= 0.9 at 4 ranks), one of fewer tokens never does. The SMs carry every other combine."""
    if combine_staging_tokens == 0 or "num_worst_slack" in case or not 2 <= R <= tuning.STAGING_MAX_RANKS:
        return "sm"
    if not tuning.pulls_rows(R):
        return "copy_engine"
    section = as_config({"buffer": {"max_hidden": MAX_HIDDEN, "combine_staging_tokens": combine_staging_tokens}}).buffer
    rows = tuning.staging_rows(tuning.staging_bytes(section, R), R, case["H"])  # more rows at a smaller hidden
    return "pull" if case["T"] <= rows else "sm"


def cases_rank(rank: int, R: int, group, names, combine_staging_tokens=4096, dispatch_output_bytes=0,
               direct_chunk_tokens=1, num_sms=24) -> list:
    torch.manual_seed(rank)
    native, reference = make_buffers(group, num_sms=num_sms, combine_staging_tokens=combine_staging_tokens,
                                     dispatch_output_bytes=dispatch_output_bytes,
                                     direct_chunk_tokens=direct_chunk_tokens)
    settings = as_config({"buffer": {"dispatch_output_bytes": dispatch_output_bytes}}).buffer
    expect_dispatch_path = "direct" if output_region_bytes(settings, R) > 0 else "rings"
    # Bulk copies wherever the GPU has them (sm_90 on); before sm_90 the senders copy through registers.
    assert native._backend._runtime.dispatch_bulk_rows == (torch.cuda.get_device_capability()[0] >= 9)
    assert native._backend._runtime.direct_chunk_tokens == direct_chunk_tokens
    assert native._backend._runtime.direct_max_blocks == 16
    done = []
    for i, case in enumerate(c for c in CASES if c["name"] in names):
        try:
            run_case(native, reference, rank, R, case, seed=1000 + i)
            path = native._backend.last_combine_path
            assert path == expected_combine_path(case, R, combine_staging_tokens), f"combine ran on the {path} path"
            path = native._backend.last_dispatch_path
            assert path == expect_dispatch_path, f"dispatch ran on the {path} path"
            if path == "direct":
                assert not native._backend.direct_fell_back(), "the direct dispatch fell back to the rings"
        except Exception as error:
            raise AssertionError(f"case {case['name']} on rank {rank}: {error}") from error
        done.append(case["name"])
    torch.cuda.synchronize()
    native.destroy()
    reference.destroy()
    return done


@needs_ranks(RANKS)
def test_cases_multi_rank():
    names = [c["name"] for c in CASES]
    assert parallel_launch(RANKS, cases_rank, names) == [names] * RANKS


# The same cases with the combine on the SMs (no staging area), with a staging area of two pieces
# (512 rows each), so that senders of more rows wait for the owner to free pieces (at 3-4 ranks, where
# the owners pull the rows and nothing wraps, the larger cases take the SMs), and with the default `auto`.
# Above 4 ranks every combine runs on the SMs, whatever the staging setting.
SM_COMBINE_CASES = ("hidden7168", "hidden1536", "fp8_hidden7168", "topk1", "topk9", "experts256", "routing_minus_one",
                    "routing_one_rank", "empty_rank", "no_weights", "bias2", "small_ring", "sms2", "large")
WRAPPING_STAGING_CASES = ("large", "sms16", "routing_one_expert", "topk9", "no_weights", "bias2", "empty_rank",
                          "topk32_many_rows", "unlanded_words", "unlanded_words_bias")


@needs_ranks(RANKS)
@pytest.mark.parametrize("combine_staging_tokens,names", [(0, SM_COMBINE_CASES), (1024, WRAPPING_STAGING_CASES),
                                                         ("auto", ("hidden7168", "num_worst", "large"))],
                         ids=["sm_combine", "two_staging_pieces", "auto_staging"])
def test_cases_multi_rank_other_combine_paths(combine_staging_tokens, names):
    in_order = [c["name"] for c in CASES if c["name"] in names]  # cases_rank runs them in CASES order
    assert sorted(in_order) == sorted(names)
    assert parallel_launch(RANKS, cases_rank, in_order, combine_staging_tokens) == [in_order] * RANKS


# Megatron and SGLang launch with CUDA_DEVICE_MAX_CONNECTIONS=1: every stream of a rank shares one
# hardware queue, in order. The copy-engine combine's pieces that wait for an owner's freed slot must
# not hold back the reduction that frees the owner's slots (a deadlock, then EpTimeoutError).
@needs_ranks(RANKS)
def test_copy_engine_combine_with_one_hardware_queue(monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # the spawned ranks inherit it
    in_order = [c["name"] for c in CASES if c["name"] in WRAPPING_STAGING_CASES]
    assert parallel_launch(RANKS, cases_rank, in_order, 1024) == [in_order] * RANKS


# The direct dispatch: every rank's outputs in its output region, written by the senders themselves.
# The region holds the outputs a case keeps alive at once (a dispatch, its handle and a cached
# dispatch: at most 2 x 4096 x R rows of 14336 bytes, and their metadata): 256 MB per rank.
# (A region of 512 MB at 8 ranks makes `large` fall back to the rings, correctly.)
def direct_output_bytes(R: int) -> int:
    return R * (256 << 20)



def direct_cases_rank(rank: int, R: int, group, names) -> list:
    return cases_rank(rank, R, group, names, dispatch_output_bytes=direct_output_bytes(R))


@needs_ranks(RANKS)
def test_cases_multi_rank_direct_outputs():
    names = [c["name"] for c in CASES]
    assert parallel_launch(RANKS, direct_cases_rank, names) == [names] * RANKS


# The direct dispatch's warps claim chunks of tokens (dispatch.direct_chunk_tokens, default 1): chunks
# of 3 leave a partial last chunk and warps without tokens in the small cases.
CHUNK_CASES = ("hidden7168", "fp8_hidden1536", "topk9", "routing_one_rank", "empty_rank", "large", "num_worst", "sms2",
               "sms48")


def direct_chunk_cases_rank(rank: int, R: int, group, names, chunk_tokens) -> list:
    return cases_rank(rank, R, group, names, dispatch_output_bytes=direct_output_bytes(R),
                      direct_chunk_tokens=chunk_tokens)


@needs_ranks(RANKS)
def test_cases_multi_rank_direct_outputs_chunks_of_3():
    in_order = [c["name"] for c in CASES if c["name"] in CHUNK_CASES]
    assert sorted(in_order) == sorted(CHUNK_CASES)
    assert parallel_launch(RANKS, direct_chunk_cases_rank, in_order, 3) == [in_order] * RANKS


# At 8 SMs (8 blocks) the copy engine writes the longest runs of each rank's rows for itself where they form
# few runs, and the SMs the others (`large`, `fp8_large`); at T / R runs (`routing_alternate`) the SMs write them
# all, as at 24 SMs.
OWN_ROWS_BY_ENGINE_CASES = ("hidden7168", "fp8_hidden7168", "fp8_hidden1536", "topk9", "routing_minus_one",
                            "routing_one_rank", "routing_unrouted", "empty_rank", "large", "num_worst",
                            "routing_alternate", "fp8_large")


def direct_cases_rank_8_sms(rank: int, R: int, group, names) -> list:
    return cases_rank(rank, R, group, names, dispatch_output_bytes=direct_output_bytes(R), num_sms=8)


@needs_ranks(RANKS)
def test_cases_multi_rank_direct_outputs_own_rows_by_copy_engine():
    in_order = [c["name"] for c in CASES if c["name"] in OWN_ROWS_BY_ENGINE_CASES]
    assert sorted(in_order) == sorted(OWN_ROWS_BY_ENGINE_CASES)
    assert parallel_launch(RANKS, direct_cases_rank_8_sms, in_order) == [in_order] * RANKS


def longest_runs(runs, engine_runs) -> bool:
    """Whether the engine's runs are some of `runs`, in token order, none shorter than a run it left."""
    if not set(engine_runs) <= set(runs) or engine_runs != sorted(engine_runs):
        return False
    left = [end - first for first, end, _ in set(runs) - set(engine_runs)]
    return not left or not engine_runs or min(end - first for first, end, _ in engine_runs) >= max(left)


def own_runs_rank(rank: int, R: int, group, cases) -> list:
    """Per (routing, fp8) case: the runs of tokens this rank sends to itself that notify found for the copy
    engine, against those of is_token_in_rank (None: more than kMaxOwnRuns, the SMs copy them); where
    found, whether the engine took the longest of them (and how many, of how many), and whether the cached
    dispatch kept them. The outputs themselves are run_case's (the case matrix at 8 SMs)."""
    native, _ = make_buffers(group, num_sms=8, dispatch_output_bytes=direct_output_bytes(R))
    results = []
    for i, (routing, fp8) in enumerate(cases):
        case = dict(T=4096, H=7168, K=8, E=256, routing=routing, fp8=fp8)
        x, topk_idx, weights = make_inputs(rank, R, case, seed=3000 + i)
        num_per_rank, _, num_per_expert, in_rank, _ = native.get_dispatch_layout(topk_idx, case["E"])
        _, _, _, _, handle, _ = native.dispatch(x, num_tokens_per_rank=num_per_rank, is_token_in_rank=in_rank,
                                                num_tokens_per_expert=num_per_expert, topk_idx=topk_idx,
                                                topk_weights=weights)
        own_runs = unwrap(handle).own_runs
        got = None if own_runs is None else own_runs.runs
        mine = in_rank[:, rank].cpu().tolist()
        starts = [t for t in range(len(mine)) if mine[t] and (t == 0 or not mine[t - 1])]
        ends = [t + 1 for t in range(len(mine)) if mine[t] and (t + 1 == len(mine) or not mine[t + 1])]
        counts = torch.empty(R * R, dtype=torch.int64, device=num_per_rank.device)  # [source, destination]
        dist.all_gather_into_tensor(counts, num_per_rank.to(torch.int64), group=group)
        row = int(counts.view(R, R)[:rank, rank].sum())  # this rank's rows from itself follow those before it
        want = []
        for first, end in zip(starts, ends):
            want.append((first, end, row))
            row += end - first
        results.append(got == (want if len(want) <= 32 else None))
        if own_runs is not None:
            results.append(longest_runs(own_runs.runs, own_runs.engine_runs))
            results.append((len(own_runs.engine_runs), len(own_runs.runs)))
            cached = native.dispatch(x, handle=handle)[0]
            rows = (cached[0] if fp8 else cached).size(0)
            results.append(unwrap(handle).own_runs is own_runs and rows == unwrap(handle).num_recv_rows)
    torch.cuda.synchronize()
    native.destroy()
    return results


@needs_ranks(RANKS)
def test_direct_dispatch_own_rows_by_copy_engine_where_few_runs():
    """Random routing at 2 ranks: a few runs; the engine copies the longest (again in the cached dispatch):
    every BF16 run, but not every FP8 run (the SMs spend half the time on FP8 rows, so the host may ask
    for fewer copies meanwhile); at more ranks a token misses a rank often enough (p = 0.1 at 4) for more
    than kMaxOwnRuns runs (the SMs copy them). Alternate routing: T / R runs (the SMs copy them)."""
    cases = (("random", False), ("random", True), ("alternate", False))
    for results in parallel_launch(RANKS, own_runs_rank, cases):
        if RANKS == 2:
            found_bf16, longest_bf16, engine_bf16, kept_bf16, found_fp8, longest_fp8, engine_fp8, kept_fp8, \
                found_alternate = results
            checks = [found_bf16, longest_bf16, kept_bf16, found_fp8, longest_fp8, kept_fp8, found_alternate]
            assert checks == [True] * 7
            assert engine_bf16[0] == engine_bf16[1] and 0 < engine_fp8[0] < engine_fp8[1], (engine_bf16, engine_fp8)
        else:
            assert results == [True, True, True]


@needs_ranks(RANKS)
def test_cases_multi_rank_auto_output_region():
    """The default `buffer.dispatch_output_bytes: auto` sizes a region at 1 to 4 ranks: the direct path there."""
    names = [c["name"] for c in CASES if c["name"] in ("hidden7168", "fp8_hidden7168", "num_worst", "large")]
    assert parallel_launch(RANKS, cases_rank, names, 4096, "auto") == [names] * RANKS


@needs_ranks(1)
def test_cases_one_rank_direct_outputs():
    names = [c["name"] for c in CASES if c["name"] in ("hidden7168", "fp8_hidden1536", "topk9", "num_worst", "sms2")]
    assert parallel_launch(1, direct_cases_rank, names)[0] == names


def region_full_cases_rank(rank: int, R: int, group, names, full_on) -> list:
    """Cases on the direct path where, in the cases of `full_on`, the last rank's region is held full
    (a block of all but 1 MB): that rank passes ordinary outputs, and every rank must fall back to the
    rings in the same call, with exact results, no error and no wait. Returns whether each case's last
    dispatch fell back."""
    torch.manual_seed(rank)
    native, reference = make_buffers(group, dispatch_output_bytes=direct_output_bytes(R))
    region = native._backend._outputs
    fell_back = []
    for i, case in enumerate(c for c in CASES if c["name"] in names):
        held = None
        if rank == R - 1 and case["name"] in full_on:
            held = region.empty_group([((region.largest_free_bytes() - (1 << 20),), torch.uint8)],
                                      torch.cuda.current_stream().cuda_stream)
        run_case(native, reference, rank, R, case, seed=2000 + i)
        assert native._backend.last_dispatch_path == "direct"
        torch.cuda.synchronize()
        fell_back.append(native._backend.direct_fell_back())
        del held
    torch.cuda.synchronize()
    native.destroy()
    reference.destroy()
    return fell_back


@needs_ranks(RANKS)
def test_direct_outputs_fall_back_together_when_a_region_is_full():
    names = ("hidden7168", "fp8_hidden7168", "topk9")  # in CASES order
    results = parallel_launch(RANKS, region_full_cases_rank, names, ("hidden7168", "topk9"))
    assert results == [[True, False, True]] * RANKS


@needs_ranks(1)
def test_direct_outputs_fall_back_at_one_rank():
    results = parallel_launch(1, region_full_cases_rank, ("hidden7168", "fp8_hidden7168"), ("hidden7168",))
    assert results == [[True, False]]


@needs_ranks(1)
def test_cases_one_rank():
    names = [c["name"] for c in CASES if c["name"] in ("hidden7168", "fp8_hidden1536", "topk9", "routing_minus_one",
                                                      "num_worst", "bias2", "small_ring")]
    assert parallel_launch(1, cases_rank, names)[0] == names


# ---- CUDA graphs, events, long runs -----------------------------------------------------------
def graph_rank(rank: int, R: int, group, replays: int) -> int:
    native, reference = make_buffers(group)
    T, H, K, E = 512, 4096, 8, 64
    num_worst = T * R
    case = dict(T=T, H=H, K=K, E=E)
    x0, topk0, w0 = make_inputs(rank, R, case, seed=5)
    x_s, topk_s, w_s = x0.clone(), topk0.clone(), w0.clone()

    def step():
        layout = native.get_dispatch_layout(topk_s, E)
        out = native.dispatch(x_s, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                              num_tokens_per_expert=layout[2], topk_idx=topk_s, topk_weights=w_s,
                              num_worst_tokens=num_worst)
        combined = native.combine(out[0], out[4], topk_weights=out[2])
        return out, combined

    graph, (out_s, combined_s) = capture_graph(step)
    for i in range(replays):
        x, topk_idx, weights = make_inputs(rank, R, case, seed=100 + i)
        x_s.copy_(x), topk_s.copy_(topk_idx), w_s.copy_(weights)
        out_s[0].fill_(float("nan"))  # poison before each replay
        graph.replay()
        layout = reference.get_dispatch_layout(topk_idx, E)
        want = reference.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                                  num_tokens_per_expert=layout[2], topk_idx=topk_idx, topk_weights=weights)
        n = want[0].size(0)
        assert_same(f"replay {i} recv_x", out_s[0][:n], want[0])
        assert_same(f"replay {i} recv_topk_idx", out_s[1][:n], want[1])
        assert bool((out_s[1][n:] == -1).all())
        want_c = reference.combine(want[0], want[4], topk_weights=want[2])
        torch.testing.assert_close(combined_s[0].float(), want_c[0].float(), rtol=1e-2, atol=1e-2)
    torch.cuda.synchronize()
    native.destroy()
    reference.destroy()
    return replays


@needs_ranks(RANKS)
def test_cuda_graph_capture_and_replay():
    assert parallel_launch(RANKS, graph_rank, 50) == [50] * RANKS


def async_rank(rank: int, R: int, group) -> bool:
    native, reference = make_buffers(group)
    case = dict(T=1024, H=7168, K=8, E=256)
    x, topk_idx, weights = make_inputs(rank, R, case, seed=3)
    previous = Buffer.capture()
    layout = native.get_dispatch_layout(topk_idx, 256, previous_event=previous, async_finish=True,
                                        allocate_on_comm_stream=True)
    layout[4].current_stream_wait()
    out = native.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                          num_tokens_per_expert=layout[2], topk_idx=topk_idx, topk_weights=weights,
                          previous_event=layout[4], async_finish=True)
    out[5].current_stream_wait()
    combined = native.combine(out[0], out[4], topk_weights=out[2], async_finish=True)
    combined[2].current_stream_wait()
    r_layout = reference.get_dispatch_layout(topk_idx, 256)
    want = reference.dispatch(x, num_tokens_per_rank=r_layout[0], is_token_in_rank=r_layout[3],
                              num_tokens_per_expert=r_layout[2], topk_idx=topk_idx, topk_weights=weights)
    assert_same("async recv_x", out[0], want[0])
    want_c = reference.combine(want[0], want[4], topk_weights=want[2])
    torch.testing.assert_close(combined[0].float(), want_c[0].float(), rtol=1e-2, atol=1e-2)
    torch.cuda.synchronize()
    native.destroy()
    reference.destroy()
    return True


def region_reuse_rank(rank: int, R: int, group) -> bool:
    """A direct dispatch's outputs freed while stream A still reads them, then a dispatch on stream B that
    takes the same block of the output region: B's kernels wait for A's work first."""
    native, _ = make_buffers(group, dispatch_output_bytes=direct_output_bytes(R))
    case = dict(T=512, H=7168, K=8, E=64)
    first_stream, second_stream = torch.cuda.Stream(), torch.cuda.Stream()
    x, topk_idx, weights = make_inputs(rank, R, case, seed=5)
    layout = native.get_dispatch_layout(topk_idx, 64)
    args = dict(num_tokens_per_rank=layout[0], is_token_in_rank=layout[3], num_tokens_per_expert=layout[2],
                topk_idx=topk_idx, topk_weights=weights)
    first_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(first_stream):
        out = native.dispatch(x, **args)
        want = out[0].clone()
        address = out[0].data_ptr()
        torch.cuda._sleep(200_000_000)  # stream A still works when its outputs die
        seen = out[0].clone()
    del out
    second_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(second_stream):
        again = native.dispatch((x.float() * -1).to(torch.bfloat16), **args)
    reused = again[0].data_ptr() == address
    torch.cuda.synchronize()
    assert reused, "the second dispatch did not take the first one's block (the case tests nothing)"
    assert_same("rows stream A read after its outputs were freed", seen, want)
    del again
    native.destroy()
    return True


@needs_ranks(RANKS)
def test_output_region_block_reused_by_another_stream_waits_for_the_first():
    assert parallel_launch(RANKS, region_reuse_rank) == [True] * RANKS


@needs_ranks(RANKS)
def test_async_events():
    assert parallel_launch(RANKS, async_rank) == [True] * RANKS


def long_run_rank(rank: int, R: int, group, iterations: int) -> int:
    native, reference = make_buffers(group)
    case = dict(T=256, H=2048, K=8, E=64, routing="minus_one")
    for i in range(iterations):
        x, topk_idx, weights = make_inputs(rank, R, case, seed=20000 + i)
        poison_allocator(64)
        layout = native.get_dispatch_layout(topk_idx, 64)
        out = native.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                              num_tokens_per_expert=layout[2], topk_idx=topk_idx, topk_weights=weights)
        want = reference.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                                  num_tokens_per_expert=layout[2], topk_idx=topk_idx, topk_weights=weights)
        assert_same(f"iteration {i} recv_x", out[0], want[0])
        assert_same(f"iteration {i} recv_topk_idx", out[1], want[1])
        expert_out = want[0] * 2
        combined = native.combine(expert_out, out[4], topk_weights=out[2])
        want_c = reference.combine(expert_out, want[4], topk_weights=want[2])
        torch.testing.assert_close(combined[0].float(), want_c[0].float(), rtol=1e-2, atol=1e-2)
    torch.cuda.synchronize()
    native.destroy()
    reference.destroy()
    return iterations


@needs_ranks(RANKS)
def test_1000_back_to_back_iterations():
    assert parallel_launch(RANKS, long_run_rank, 1000) == [1000] * RANKS


def other_device_rank(rank: int, R: int, group) -> bool:
    """Calls made while another GPU is current run on the buffer's GPU and leave the caller's device as it was."""
    native, reference = make_buffers(group)
    own = torch.cuda.current_device()
    other = (own + 1) % torch.cuda.device_count()
    assert other != own, "this test needs a second GPU visible to each rank"
    case = dict(T=256, H=2048, K=8, E=64)
    x, topk_idx, weights = make_inputs(rank, R, case, seed=31000)
    poison_allocator(64)
    torch.cuda.set_device(other)
    try:
        layout = native.get_dispatch_layout(topk_idx, 64)
        out = native.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                              num_tokens_per_expert=layout[2], topk_idx=topk_idx, topk_weights=weights)
        cached = native.dispatch(x, handle=out[4])
        combined = native.combine(out[0] * 2, out[4], topk_weights=out[2])
        assert torch.cuda.current_device() == other, "a Buffer call switched the caller's current device"
    finally:
        torch.cuda.set_device(own)
    torch.cuda.synchronize()
    assert out[0].device.index == own and combined[0].device.index == own
    want_layout = reference.get_dispatch_layout(topk_idx, 64)
    for i in (0, 2, 3):
        assert_same(f"layout[{i}]", layout[i], want_layout[i])
    want = reference.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                              num_tokens_per_expert=layout[2], topk_idx=topk_idx, topk_weights=weights)
    for i, name in enumerate(("recv_x", "recv_topk_idx", "recv_topk_weights")):
        assert_same(name, out[i], want[i])
    assert_same("cached recv_x", cached[0], want[0])
    want_c = reference.combine(want[0] * 2, want[4], topk_weights=want[2])
    torch.testing.assert_close(combined[0].float(), want_c[0].float(), rtol=1e-2, atol=1e-2)
    native.destroy()
    reference.destroy()
    return True


@needs_ranks(RANKS, own_gpus=True)
def test_calls_while_another_gpu_is_current_keep_the_callers_device():
    assert parallel_launch(RANKS, other_device_rank) == [True] * RANKS


# ---- failures: a missing peer, bad input ------------------------------------------------------
def absent_peer_error(native, op: str, x, kwargs: dict, out) -> EpTimeoutError:
    """The EpTimeoutError of `op` ("dispatch", "combine", "cached_dispatch") whose peer is gone: from the
    call itself (the host waits for the dispatch's notify), or else from the next call (the host does not
    wait for a combine's or a cached dispatch's kernels; they end early and the CUDA context works)."""
    try:
        if op == "dispatch":
            native.dispatch(x, **kwargs)
        elif op == "cached_dispatch":
            native.dispatch(x, handle=out[4])
        else:
            native.combine(out[0], out[4])
        torch.cuda.synchronize()
        native.dispatch(x, **kwargs)
    except EpTimeoutError as error:
        return error
    raise AssertionError(f"{op} with an absent peer raised no EpTimeoutError")


def dispatch_and_combine_outputs(buffer, x, topk_idx, weights, num_experts: int) -> list:
    """Layout, dispatch outputs and combine outputs (of the received rows as expert outputs), on the CPU."""
    layout = buffer.get_dispatch_layout(topk_idx, num_experts)
    recv_x, recv_idx, recv_weights, per_expert, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3], num_tokens_per_expert=layout[2],
        topk_idx=topk_idx, topk_weights=weights)
    combined, combined_weights, _ = buffer.combine(recv_x, handle, topk_weights=recv_weights)
    tensors = [layout[0], layout[2], layout[3], recv_x, recv_idx, recv_weights, combined, combined_weights]
    return [t.cpu() for t in tensors] + [per_expert]


def fresh_buffer_matches_reference(group) -> None:
    """A new native Buffer over `group` (the ranks that remain) dispatches and combines as the reference does."""
    native, reference = make_buffers(group)
    rank, R = group.rank(), group.size()
    E = 16 * R
    x, topk_idx, weights = make_inputs(rank, R, dict(T=64, H=2048, K=4, E=E), seed=4)
    poison(native)
    got = dispatch_and_combine_outputs(native, x, topk_idx, weights, E)
    want = dispatch_and_combine_outputs(reference, x, topk_idx, weights, E)
    names = ["num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank", "recv_x", "recv_topk_idx",
             "recv_topk_weights"]
    for name, g, w in zip(names, got, want):
        assert_same(name, g, w)
    torch.testing.assert_close(got[6], want[6])  # sums of the token's copies: summation order differs
    torch.testing.assert_close(got[7], want[7])
    assert got[8] == want[8], f"per-expert counts {got[8]} != {want[8]}"
    native.destroy()
    reference.destroy()


def missing_peer_rank(rank: int, R: int, group, op: str):
    """Rank 1 exits before `op` (for the combines and the cached dispatch, after a dispatch every rank
    finished). Every other rank gets EpTimeoutError with a usable CUDA context, gets the same error from
    every later call, destroys the Buffer, and runs a new Buffer over a group of the ranks that remain.
    Returns the error's facts (rank 1: "absent").

    NOTE: the new group is a gloo one: an NCCL group split from the eagerly started world group
    (parallel_launch binds each rank's device) would need rank 1 in the split.
    """
    native, _ = make_buffers(group, timeout_s=3.0, combine_staging_tokens=0 if op == "combine_sm" else 4096,
                             dispatch_output_bytes=direct_output_bytes(R) if op == "cached_dispatch_direct" else 0)
    case = dict(T=64, H=2048, K=4, E=16)
    x, topk_idx, weights = make_inputs(rank, R, case, seed=1)
    layout = native.get_dispatch_layout(topk_idx, 16)
    kwargs = dict(num_tokens_per_rank=layout[0], is_token_in_rank=layout[3], num_tokens_per_expert=layout[2],
                  topk_idx=topk_idx, topk_weights=weights)
    base_op = op.removesuffix("_sm").removesuffix("_direct")
    out = None
    if base_op != "dispatch":
        out = native.dispatch(x, **kwargs)
        torch.cuda.synchronize()
    if rank == 1:
        return "absent"  # this process exits
    error = absent_peer_error(native, base_op, x, kwargs, out)
    torch.cuda.synchronize()  # raises if a kernel trapped
    try:
        native.dispatch(x, **kwargs)
        again = "no error"
    except EpTimeoutError as later:
        again = str(later)
    native.destroy()
    survivors = [r for r in range(R) if r != 1]
    fresh_buffer_matches_reference(dist.new_group(survivors, backend="gloo", use_local_synchronization=True))
    return dict(message=str(error), rank=error.rank, peer=error.peer, usable=error.device_usable, again=again)


@needs_ranks(RANKS, own_gpus=True)
@pytest.mark.parametrize("op", ["dispatch", "combine", "combine_sm", "cached_dispatch_direct"])
def test_missing_peer_times_out_and_the_rest_recover_in_the_same_process(op):
    results = parallel_launch(RANKS, missing_peer_rank, op)
    assert results[1] == "absent"
    for rank, seen in enumerate(results):
        if rank != 1:
            assert seen["rank"] == rank and seen["usable"] and seen["again"] == seen["message"], seen
    first = results[0]["message"]
    assert results[0]["peer"] == 1 and "rank 0" in first and "peer 1" in first and "timeout" in first, first
    assert "restart the process" not in first, first
    # The copy-engine combine (2-4 ranks) and the direct dispatch say what rank 0 waited for.
    assert ("copy-engine path" in first) == (op == "combine" and RANKS <= tuning.STAGING_MAX_RANKS), first
    assert ("direct dispatch" in first) == (op == "cached_dispatch_direct"), first


def bad_id_rank(rank: int, R: int, group) -> str:
    native, _ = make_buffers(group, check_inputs=False)
    case = dict(T=64, H=2048, K=4, E=16)
    x, topk_idx, weights = make_inputs(rank, R, case, seed=2)
    layout = native.get_dispatch_layout(topk_idx, 16)
    bad = topk_idx.clone()
    if rank == 1:
        bad[5, 2] = 999
    message = dispatch_error(native, layout, x, bad, weights)
    dispatch_and_combine(native, layout, x, topk_idx, weights)  # a valid dispatch right after works on every rank
    native.destroy()
    return message


@needs_ranks(RANKS)
def test_out_of_range_expert_id_raises_on_every_rank():
    results = parallel_launch(RANKS, bad_id_rank)
    for message in results:
        assert "rank 1" in message and "999" in message, message


def other_row_layout_rank(rank: int, R: int, group, differs: str) -> str:
    """Rank 1 dispatches rows of another width (`differs="hidden"`: 4096 against 2048) or without weights
    (`differs="weights"`): notify compares every rank's row layout and every rank raises before any row
    moves (a sender would otherwise write past the receiver's outputs)."""
    native, _ = make_buffers(group)
    case = dict(T=64, H=2048, K=4, E=16)
    x, topk_idx, weights = make_inputs(rank, R, case, seed=3)
    layout = native.get_dispatch_layout(topk_idx, 16)
    sent_x, sent_weights = x, weights
    if rank == 1 and differs == "hidden":
        sent_x = make_inputs(rank, R, dict(case, H=4096), seed=3)[0]
    if rank == 1 and differs == "weights":
        sent_weights = None
    message = dispatch_error(native, layout, sent_x, topk_idx, sent_weights)
    dispatch_and_combine(native, layout, x, topk_idx, weights)  # one that every rank makes alike works right after
    native.destroy()
    return message


@needs_ranks(RANKS)
@pytest.mark.parametrize("differs", ["hidden", "weights"])
def test_ranks_that_disagree_on_the_row_layout_are_rejected_on_every_rank(differs):
    results = parallel_launch(RANKS, other_row_layout_rank, differs)
    theirs = "rows of 8192 bytes" if differs == "hidden" else "without weights"
    for rank, message in enumerate(results):
        assert "dispatch rejected on every rank: ranks disagree on the row layout" in message, message
        if rank != 1:
            assert f"rank {rank} sends rows of 4096 bytes, 0 scales, top-4 with weights, rank 1 " in message, message
            assert theirs in message, message
