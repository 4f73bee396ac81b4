"""The push combine (`combine.algorithm: push`, 3-8 ranks) against the reference backend (GPU machine).

Fresh random data per case, outputs poisoned before each call; combine sums may differ from the
reference only by fp32 summation order. The ranks may share GPUs under CUDA MPS
(EP_PLUGIN_RANKS_PER_GPU, see ep_plugin/launch.py): 4 or 8 ranks on 2 GPUs check correctness, never speed.
"""
from __future__ import annotations

import pytest
import torch

from ep_plugin import Buffer, Config
from ep_plugin.launch import parallel_launch
from native_helpers import capture_graph, make_inputs, max_test_sms, needs_ranks, poison, run_case

RANK_COUNTS = (3, 4, 8)


def make_push_buffers(group, combine_staging_tokens=4096, num_sms: int = 24, max_hidden: int = 8192):
    R = group.size()
    num_sms = min(num_sms, max_test_sms() or num_sms)
    num_nvl_bytes = max(Config(num_sms, 8, recv).get_nvl_buffer_size_hint(max_hidden * 2, R) for recv in (64, 256))
    native = Buffer(group, num_nvl_bytes, explicitly_destroy=True,
                    config={"backend": "native", "num_sms": num_sms, "timeout_s": 30.0,
                            "combine": {"algorithm": "push"},
                            "buffer": {"max_hidden": max_hidden, "combine_staging_tokens": combine_staging_tokens}})
    reference = Buffer(group, explicitly_destroy=True, config={"backend": "reference"})
    assert native.backend_name == "native" and reference.backend_name == "reference"
    return native, reference


def push_cases(R: int) -> list:
    """The case matrix at R ranks; expert counts are multiples of R (every rank holds as many)."""
    E = 32 * R
    return [
        dict(name="hidden7168", T=384, H=7168, K=8, E=E),
        dict(name="small", T=100, H=7168, K=8, E=E),
        dict(name="hidden8", T=200, H=8, K=8, E=E),            # 16-byte rows
        dict(name="hidden1032", T=300, H=1032, K=8, E=E),      # rows off 128-byte lines
        dict(name="topk1", T=300, H=2048, K=1, E=E),
        dict(name="topk32", T=300, H=2048, K=32, E=E),
        dict(name="no_weights", T=256, H=4096, K=8, E=E, weights=False),
        dict(name="bias1", T=256, H=4096, K=8, E=E, bias=1),
        dict(name="bias2", T=256, H=4096, K=8, E=E, bias=2),
        dict(name="routing_one_rank", T=500, H=4096, K=8, E=E, routing="one_rank"),  # uneven: all to rank 0
        dict(name="routing_minus_one", T=500, H=4096, K=8, E=E, routing="minus_one"),
        dict(name="routing_one_expert", T=500, H=4096, K=8, E=E, routing="one_expert"),
        dict(name="routing_unrouted", T=500, H=4096, K=8, E=E, routing="unrouted"),  # tokens routed to no rank
        dict(name="empty_rank", T=256, H=4096, K=8, E=E, empty_rank=True),           # 0 tokens on the last rank
        dict(name="num_worst", T=256, H=4096, K=8, E=E, num_worst_slack=512),
        dict(name="sms2", T=300, H=2048, K=8, E=E, config=Config(2, 8, 64), combine_config=Config(2, 8, 64)),
        dict(name="sms16", T=1000, H=7168, K=8, E=E, config=Config(16, 8, 64), combine_config=Config(16, 8, 64)),
        dict(name="large", T=4096, H=7168, K=8, E=8 * E),
    ]


# ---- helpers (run inside the spawned ranks) ---------------------------------------------------
def cases_rank(rank: int, R: int, group, combine_staging_tokens, names=None) -> list:
    """Every case in order on one buffer (back-to-back calls: each its own epoch); returns the names done."""
    torch.manual_seed(rank)
    native, reference = make_push_buffers(group, combine_staging_tokens)
    done = []
    for i, case in enumerate(c for c in push_cases(R) if names is None or c["name"] in names):
        try:
            run_case(native, reference, rank, R, case, seed=2000 + i)
            assert native._backend.last_combine_path == "push", native._backend.last_combine_path
        except Exception as error:
            raise AssertionError(f"case {case['name']} on rank {rank} of {R}: {error}") from error
        done.append(case["name"])
    torch.cuda.synchronize()
    native.destroy()
    reference.destroy()
    return done


def dispatch_for(buf, x, topk_idx, weights, E: int, num_worst: int = 0):
    layout = buf.get_dispatch_layout(topk_idx, E)
    return buf.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3], num_tokens_per_expert=layout[2],
                        topk_idx=topk_idx, topk_weights=weights, num_worst_tokens=num_worst)


def repeated_combines_rank(rank: int, R: int, group, repeats: int) -> int:
    """Combines of one dispatch back to back, no host synchronisation between them, fresh expert outputs each."""
    native, reference = make_push_buffers(group)
    case = dict(T=1024, H=7168, K=8, E=32 * R)
    x, topk_idx, weights = make_inputs(rank, R, case, seed=7)
    got = dispatch_for(native, x, topk_idx, weights, case["E"])
    want = dispatch_for(reference, x, topk_idx, weights, case["E"])
    n = want[0].size(0)
    gen = torch.Generator().manual_seed(rank + 11)
    outputs, wanted = [], []
    for i in range(repeats):
        expert_out = (torch.randn(n, case["H"], generator=gen) * (i + 1)).to(torch.bfloat16).cuda()
        poison(native)
        outputs.append(native.combine(expert_out, got[4], topk_weights=got[2]))
        wanted.append(reference.combine(expert_out, want[4], topk_weights=want[2]))
    torch.cuda.synchronize()
    for i, (got_c, want_c) in enumerate(zip(outputs, wanted)):
        torch.testing.assert_close(got_c[0].float(), want_c[0].float(), rtol=1e-2, atol=1e-2, msg=f"combine {i}")
        torch.testing.assert_close(got_c[1], want_c[1], rtol=1e-6, atol=1e-6, msg=f"combine {i} weights")
    native.destroy()
    reference.destroy()
    return repeats


def graph_rank(rank: int, R: int, group, replays: int) -> int:
    """Dispatch (num_worst_tokens) and push combine captured in a CUDA graph, replayed on fresh data."""
    native, reference = make_push_buffers(group)
    T, H, K, E = 512, 4096, 8, 32 * R
    case = dict(T=T, H=H, K=K, E=E)
    x0, topk0, w0 = make_inputs(rank, R, case, seed=5)
    x_s, topk_s, w_s = x0.clone(), topk0.clone(), w0.clone()

    def step():
        out = dispatch_for(native, x_s, topk_s, w_s, E, num_worst=T * R)
        return out, native.combine(out[0], out[4], topk_weights=out[2])

    graph, (out_s, combined_s) = capture_graph(step)
    for i in range(replays):
        x, topk_idx, weights = make_inputs(rank, R, case, seed=100 + i)
        x_s.copy_(x), topk_s.copy_(topk_idx), w_s.copy_(weights)
        combined_s[0].fill_(float("nan"))  # poison before each replay
        combined_s[1].fill_(float("nan"))
        graph.replay()
        want = dispatch_for(reference, x, topk_idx, weights, E)
        want_c = reference.combine(want[0], want[4], topk_weights=want[2])
        torch.testing.assert_close(combined_s[0].float(), want_c[0].float(), rtol=1e-2, atol=1e-2,
                                   msg=f"replay {i}")
        torch.testing.assert_close(combined_s[1], want_c[1], rtol=1e-6, atol=1e-6, msg=f"replay {i} weights")
    assert native._backend.last_combine_path == "push"
    torch.cuda.synchronize()
    native.destroy()
    reference.destroy()
    return replays


# ---- tests --------------------------------------------------------------------------------------
def _ranks_param():
    return pytest.mark.parametrize("R", [pytest.param(n, marks=needs_ranks(n)) for n in RANK_COUNTS],
                                   ids=[f"ep{n}" for n in RANK_COUNTS])


@_ranks_param()
def test_push_combine_cases(R):
    names = [c["name"] for c in push_cases(R)]
    assert parallel_launch(R, cases_rank, 4096) == [names] * R


@_ranks_param()
def test_push_combine_falls_back_to_rings_when_tokens_exceed_the_area(R):
    # Regions of 128 tokens of 8192: at hidden 7168 they hold 146 tokens, at 4096 253. Cases with more
    # tokens on some rank (384, 256) take the ring combine on every rank (decided on the device), the
    # small one (100) the push; either way the results are the reference's.
    names = ["hidden7168", "small", "empty_rank", "num_worst"]
    assert parallel_launch(R, cases_rank, 128, names) == [names] * R


@_ranks_param()
def test_push_combine_back_to_back(R):
    assert parallel_launch(R, repeated_combines_rank, 12) == [12] * R


@_ranks_param()
def test_push_combine_in_cuda_graph(R):
    assert parallel_launch(R, graph_rank, 20) == [20] * R
