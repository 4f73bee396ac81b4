"""Native internode normal mode (network leg over NVSHMEM + intranode stage) against the reference.

CPU part (wherever ep_plugin._C_nvshmem imports, CI included): the size hint mirrors the layout
struct; backend selection keeps the reference for `auto` until the kernels are verified.

GPU part (skipped without 2 GPUs or without the NVSHMEM module): one host emulates several nodes
with `topology: {ranks_per_node: 1}` (2 GPUs = 2 nodes x 1 GPU), so the network leg runs between
"nodes" through NVSHMEM (NVLink underneath: direct stores into the peer's rings, and, with
`network.force_puts: true`, the staged puts with signal that a real network takes). 4-GPU variants
(2 nodes x 2 GPUs, 4 x 1) run where 4 GPUs exist. Every case draws fresh random data; routing
metadata and copied payloads must be bit-identical to the reference, combine sums equal up to fp32
summation order.

Run on the GPU machine (2x H200):
    python3 -m pytest -q -x tests/test_native_internode.py
"""
from __future__ import annotations

import itertools

import pytest
import torch

from case_runner import assert_case_passed, run_each
from ep_plugin import Buffer, Config, tuning
from ep_plugin.backends.base import GroupInfo
from ep_plugin.launch import parallel_launch
from ep_plugin.tuning import default_combine_config, default_dispatch_config
from native_helpers import (NORMAL_MODE_CASES, assert_same, capture_graph, dispatch_and_combine, dispatch_error,
                            make_inputs, missing_peer_scenario, needs_ranks, run_case)

try:
    from ep_plugin import _C_nvshmem
except ImportError:
    _C_nvshmem = None

needs_module = pytest.mark.skipif(_C_nvshmem is None, reason="ep_plugin._C_nvshmem is not built (no NVSHMEM)")


def needs_gpus(n: int, own_gpus: bool = False):
    return needs_ranks(n, own_gpus=own_gpus, module=_C_nvshmem)


# ---- CPU: size hint, limits, selection --------------------------------------------------------------
@needs_module
def test_limits_match_the_extension():
    assert tuning.INTERNODE_HEADER_BYTES == _C_nvshmem.INTERNODE_HEADER_BYTES
    assert tuning.INTERNODE_MAX_NODES == _C_nvshmem.INTERNODE_MAX_NODES
    assert tuning.INTERNODE_SLOT_EXTRA_BYTES == _C_nvshmem.INTERNODE_SLOT_EXTRA_BYTES
    assert tuning.INTERNODE_MAX_CHANNELS == _C_nvshmem.INTERNODE_MAX_CHANNELS


@needs_module
@pytest.mark.parametrize("hidden_bytes,num_ranks,ranks_per_node",
                         [(h, r, l) for h, (r, l) in itertools.product(
                             [16, 3072, 5760, 14336, 16384],
                             [(2, 1), (4, 1), (4, 2), (16, 8), (32, 8), (64, 4), (256, 1)])])
def test_rdma_size_hint_matches_the_layout_struct(hidden_bytes, num_ranks, ranks_per_node):
    for num_sms, recv_tokens in itertools.product([2, 24, 48, 128], [1, 16, 128, 256]):
        config = Config(num_sms, 1, 256, 1, recv_tokens)
        assert config.get_rdma_buffer_size_hint(hidden_bytes, num_ranks, ranks_per_node) == \
            _C_nvshmem.internode_size_hint(hidden_bytes, num_ranks // ranks_per_node, num_sms // 2, recv_tokens)


@needs_module
def test_hint_slots_hold_every_row_they_are_sized_for():
    for hidden in (8, 16, 128, 1536, 2560, 7168, 8192):
        for num_topk in (1, 8, 32):
            hint_slot = _C_nvshmem.internode_size_hint(hidden * 2, 2, 1, 1) - tuning.INTERNODE_HEADER_BYTES
            hint_slot //= 4  # two kinds x (ring + staging), one slot each
            bf16 = _C_nvshmem.internode_dispatch_slot_bytes(hidden * 2, 0, num_topk, True)
            assert bf16 <= hint_slot, (hidden, num_topk)
            if hidden % 16 == 0:
                fp8 = _C_nvshmem.internode_dispatch_slot_bytes(hidden, (hidden + 127) // 128, num_topk, True)
                assert fp8 <= hint_slot, (hidden, num_topk)
            assert _C_nvshmem.internode_combine_slot_bytes(hidden, num_topk) <= hint_slot


@needs_module
def test_network_geometry_fills_the_warps_within_the_hint():
    from ep_plugin.backends.native import NET_WARPS_PER_BLOCK, network_geometry
    assert NET_WARPS_PER_BLOCK == _C_nvshmem.INTERNODE_WARPS_PER_BLOCK
    assert network_geometry(12, 256, 2) == (96, 32)    # 8: one warp per (sub-channel, node)
    assert network_geometry(4, 256, 2) == (32, 32)
    assert network_geometry(32, 256, 2) == (128, 64)   # 4 sub-channels per block: the 128-channel limit
    assert network_geometry(12, 256, 16) == (12, 256)  # as many nodes as warps: no sub-channels
    assert network_geometry(12, 3, 2) == (36, 1)       # never fewer than one slot per ring
    for blocks, slots, nodes in itertools.product([1, 4, 12, 32, 64], [1, 2, 16, 256], [1, 2, 3, 8, 16, 32]):
        channels, ring_slots = network_geometry(blocks, slots, nodes)
        group = channels // blocks
        assert channels == blocks * group and 1 <= channels <= tuning.INTERNODE_MAX_CHANNELS
        assert group * nodes <= max(NET_WARPS_PER_BLOCK, nodes)
        assert 1 <= ring_slots and channels * ring_slots <= blocks * slots  # the size hint still holds


def test_rdma_size_hint_keeps_deepep_defaults():
    config = Config(24, 6, 128, 6, 128)
    assert config.get_rdma_buffer_size_hint(14336, 8) == 0          # one node of 8 (DeepEP's assumption)
    assert config.get_rdma_buffer_size_hint(14336, 2, 2) == 0       # one node of 2
    assert config.get_rdma_buffer_size_hint(14336, 16) == config.get_rdma_buffer_size_hint(14336, 16, 8) > 0
    with pytest.raises(ValueError, match="divisor"):
        config.get_rdma_buffer_size_hint(14336, 6, 4)


@needs_module
def test_auto_keeps_the_reference_until_verified():
    from ep_plugin.backends import native
    info = GroupInfo(group=None, rank=0, num_ranks=2, ranks_per_node=1, device=torch.device("cuda", 0))
    nvl = 4 << 20
    reason = native.unsupported_reason(info, False, nvl, requested="auto")
    if native.INTERNODE_BY_DEFAULT:
        assert reason == ""
    else:
        assert "not yet faster" in reason and "backend: native" in reason
    assert native.unsupported_reason(info, False, nvl, requested="native") == ""
    assert "num_nvl_bytes" in native.unsupported_reason(info, False, 0, requested="native")
    wide = GroupInfo(group=None, rank=0, num_ranks=32, ranks_per_node=16, device=torch.device("cuda", 0))
    assert "ranks per node" in native.unsupported_reason(wide, False, nvl, requested="native")


def _channel_range(num_tokens: int, num_channels: int, ch: int):
    """csrc/kernels/internode_layout.cuh channel_range."""
    per = (num_tokens + num_channels - 1) // num_channels
    return min(ch * per, num_tokens), min(ch * per + per, num_tokens)


@pytest.mark.parametrize("num_nodes,ranks_per_node,num_channels,padding", [
    (2, 1, 3, 0), (2, 2, 3, 0), (3, 2, 4, 5), (2, 4, 1, 0), (4, 2, 5, 7)])
def test_two_stage_order_model_matches_the_reference_order(num_nodes, ranks_per_node, num_channels, padding):
    """A pure-torch model of the two stages, in the order the kernels produce rows, checks that the
    backend's permutation helpers give the reference order (source rank, then source token)."""
    from ep_plugin.backends.native import forwarder_source_nodes, source_order
    N, L, C = num_nodes, ranks_per_node, num_channels
    R = N * L
    gen = torch.Generator().manual_seed(N * 100 + L * 10 + C)
    tokens = [int(torch.randint(0, 12, (1,), generator=gen)) for _ in range(R)]
    in_rank = [torch.rand(tokens[r], R, generator=gen) < 0.4 for r in range(R)]
    for n, j in itertools.product(range(N), range(L)):
        dst = n * L + j
        # Network leg: forwarder (n, l) holds rows of sources (m, l), by source node, channel, token.
        forwarder_rows, forwarder_offsets = {}, {}
        for l in range(L):
            rows_fwd, offsets = [], []
            for m in range(N):
                src = m * L + l
                in_node = in_rank[src].view(tokens[src], N, L).any(dim=2)[:, n]
                for ch in range(C):
                    offsets.append(len(rows_fwd))
                    begin, end = _channel_range(tokens[src], C, ch)
                    rows_fwd += [(src, t) for t in range(begin, end) if bool(in_node[t])]
            offsets.append(len(rows_fwd))
            forwarder_rows[l], forwarder_offsets[l] = rows_fwd, torch.tensor(offsets, dtype=torch.int32)
            got_nodes = forwarder_source_nodes(forwarder_offsets[l], len(rows_fwd), C, N)
            assert got_nodes.tolist() == [src // L for src, _ in rows_fwd]
        # Intranode stage at (n, j): blocks by forwarder l, each in the forwarder's row order.
        intra, tags, block_offsets = [], [], [0]
        for l in range(L):
            for (src, t), node_of_row in zip(forwarder_rows[l], forwarder_source_nodes(
                    forwarder_offsets[l], len(forwarder_rows[l]), C, N).tolist()):
                if bool(in_rank[src][t, dst]):
                    intra.append((src, t))
                    tags.append(node_of_row)
            block_offsets.append(len(intra))
        num_recv = len(intra)
        tags += [12345] * padding  # padding rows carry garbage tags
        perm, inv_perm = source_order(torch.tensor(tags, dtype=torch.int32),
                                      torch.tensor(block_offsets, dtype=torch.int32),
                                      torch.tensor([num_recv], dtype=torch.int32), L, R)
        want = [(src, t) for src in range(R) for t in range(tokens[src]) if bool(in_rank[src][t, dst])]
        assert [intra[i] for i in perm[:num_recv].tolist()] == want
        assert sorted(perm[num_recv:].tolist()) == list(range(num_recv, num_recv + padding))
        assert torch.equal(perm[inv_perm], torch.arange(num_recv + padding))


# ---- GPU helpers (run inside the spawned ranks) --------------------------------------------------------
MAX_HIDDEN = 8192
SMALL_RING = Config(24, 2, 16, 2, 2)      # two ring slots: every few tokens wait for the receiver
ONE_SLOT = Config(24, 2, 16, 1, 1)        # one slot: strict lock-step
TWO_SMS = Config(2, 8, 64, 6, 32)         # one channel
MANY_SMS = Config(48, 8, 64, 6, 64)       # 24 channels


def _configs(num_sms: int, R: int):
    return [default_dispatch_config(num_sms, R), default_combine_config(num_sms, R), SMALL_RING, ONE_SLOT,
            TWO_SMS, MANY_SMS]


def make_buffers(group, ranks_per_node: int = 1, num_sms: int = 24, timeout_s: float = 30.0,
                 check_inputs: bool = True, force_puts: bool = False):
    R = group.size()
    num_nvl_bytes = max(c.get_nvl_buffer_size_hint(MAX_HIDDEN * 2, ranks_per_node) for c in _configs(num_sms, R))
    num_rdma_bytes = max(c.get_rdma_buffer_size_hint(MAX_HIDDEN * 2, R, ranks_per_node) for c in _configs(num_sms, R))
    topology = {"ranks_per_node": ranks_per_node}
    # transport: nvlink -> NVSHMEM_REMOTE_TRANSPORT=none: the emulated nodes share one host.
    native = Buffer(group, num_nvl_bytes, num_rdma_bytes, explicitly_destroy=True,
                    config={"backend": "native", "transport": "nvlink", "num_sms": num_sms, "timeout_s": timeout_s,
                            "check_inputs": check_inputs, "topology": topology,
                            "network": {"force_puts": force_puts}})
    reference = Buffer(group, explicitly_destroy=True, config={"backend": "reference", "topology": topology})
    assert native.backend_name == "native" and reference.backend_name == "reference"
    return native, reference


CASES = NORMAL_MODE_CASES + (
    [dict(name="small_ring", T=700, H=4096, K=8, E=64, config=SMALL_RING, combine_config=SMALL_RING),
       dict(name="one_slot", T=200, H=2048, K=8, E=64, config=ONE_SLOT, combine_config=ONE_SLOT),
       dict(name="ring_change", T=300, H=2048, K=8, E=64, config=SMALL_RING, combine_config=ONE_SLOT,
            cached_config=ONE_SLOT),
       dict(name="sms2", T=300, H=2048, K=8, E=64, config=TWO_SMS, combine_config=TWO_SMS),
       dict(name="sms48", T=1000, H=7168, K=8, E=256, config=MANY_SMS, combine_config=MANY_SMS),
       dict(name="few_tokens", T=3, H=2048, K=8, E=64)]
)


def cases_rank(rank: int, R: int, group, ranks_per_node: int, names, network_puts: bool = False) -> dict:
    """Runs the named cases. `network_puts`: the network leg stages and puts with signal (the code
    path of real RDMA) instead of storing straight into its NVLink peers."""
    torch.manual_seed(rank)
    native, reference = make_buffers(group, ranks_per_node, force_puts=network_puts)
    net = native._backend._net
    if net.puts_only != network_puts or (not network_puts and not all(net.direct_peers())):
        raise AssertionError(f"rank {rank}: network path is not the one under test (puts_only={net.puts_only}, "
                             f"direct peers {net.direct_peers()})")
    by_name = {c["name"]: c for c in CASES}
    seeds = {name: 1000 + i for i, name in enumerate(by_name)}
    results = run_each({name: (lambda c=by_name[name]: run_case(native, reference, rank, R, c, seeds[c["name"]]))
                        for name in names}, names)
    torch.cuda.synchronize()
    native.destroy()
    reference.destroy()
    return results


CASE_NAMES = [c["name"] for c in CASES]


@pytest.fixture(scope="module")
def two_node_results():
    return parallel_launch(2, cases_rank, 1, CASE_NAMES, timeout_s=480.0)


@needs_gpus(2)
@pytest.mark.parametrize("case", CASE_NAMES)
def test_emulated_two_nodes(two_node_results, case):
    assert_case_passed(two_node_results, case, "2 GPUs as 2 nodes x 1 GPU")


# The RDMA path of the network leg (staged puts with signal, announced in chunks), which direct
# stores replace between NVLink peers: the cases that stress the rings and every row layout.
PUTS_CASE_NAMES = ["hidden7168", "fp8_hidden1536", "topk9", "routing_minus_one", "empty_rank", "no_weights", "bias2",
                   "small_ring", "one_slot", "ring_change", "sms2", "sms48", "large"]


@pytest.fixture(scope="module")
def network_puts_results():
    return parallel_launch(2, cases_rank, 1, PUTS_CASE_NAMES, True, timeout_s=480.0)


@needs_gpus(2)
@pytest.mark.parametrize("case", PUTS_CASE_NAMES)
def test_emulated_two_nodes_through_network_puts(network_puts_results, case):
    assert_case_passed(network_puts_results, case, "2 GPUs as 2 nodes x 1 GPU, network.force_puts")


@needs_gpus(4)
@pytest.mark.parametrize("ranks_per_node", [1, 2])
def test_emulated_four_ranks(ranks_per_node):
    names = ["hidden7168", "fp8_hidden1536", "topk9", "routing_minus_one", "routing_one_rank", "empty_rank",
             "bias2", "small_ring", "ring_change", "alignment128"]
    results = parallel_launch(4, cases_rank, ranks_per_node, names, timeout_s=480.0)
    for name in names:
        assert_case_passed(results, name, f"4 GPUs as {4 // ranks_per_node} nodes x {ranks_per_node}")


# ---- CUDA graphs (num_worst_tokens), back-to-back runs ------------------------------------------------
def graph_rank(rank: int, R: int, group, ranks_per_node: int, replays: int) -> int:
    """Capture layout + dispatch(num_worst_tokens) + combine in one graph and replay with new data.

    NOTE: Buffer.dispatch rejects num_worst_tokens > 0 across nodes (a DeepEP V1 restriction kept in
    buffer.py), so this drives the backend directly with the same arguments Buffer would pass.
    """
    native, reference = make_buffers(group, ranks_per_node)
    backend = native._backend
    T, H, K, E = 512, 4096, 8, 64
    num_worst = T * R
    config = default_dispatch_config(24, R)
    case = dict(T=T, H=H, K=K, E=E, routing="minus_one")
    x0, topk0, w0 = make_inputs(rank, R, case, seed=5)
    x_s, topk_s, w_s = x0.clone(), topk0.clone(), w0.clone()

    def step():
        layout = backend.get_dispatch_layout(topk_s, E)
        out = backend.dispatch(x_s, None, topk_s, w_s, layout[0], layout[3], layout[2], 1, num_worst, config)
        combined = backend.combine(out[0], out[5], out[3], None, None, config)
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
        assert out_s[0].size(0) == num_worst
        assert_same(f"replay {i} recv_x", out_s[0][:n], want[0])
        assert_same(f"replay {i} recv_topk_idx", out_s[2][:n], want[1])
        assert_same(f"replay {i} recv_topk_weights", out_s[3][:n], want[2])
        assert bool((out_s[2][n:] == -1).all()), "padding rows must have recv_topk_idx == -1"
        want_c = reference.combine(want[0], want[4], topk_weights=want[2])
        torch.testing.assert_close(combined_s[0].float(), want_c[0].float(), rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(combined_s[1], want_c[1], rtol=1e-6, atol=1e-6)
    torch.cuda.synchronize()
    native.destroy()
    reference.destroy()
    return replays


@needs_gpus(2)
def test_cuda_graph_capture_and_replay():
    assert parallel_launch(2, graph_rank, 1, 30) == [30, 30]


@needs_gpus(4)
def test_cuda_graph_two_nodes_of_two():
    assert parallel_launch(4, graph_rank, 2, 10) == [10] * 4


def long_run_rank(rank: int, R: int, group, iterations: int) -> int:
    """Counters never reset: many calls in a row, mixing ring sizes, cached dispatches and graph-free
    dispatches of different widths."""
    native, reference = make_buffers(group, 1)
    for i in range(iterations):
        case = dict(T=128 + (i % 5) * 37, H=(2048, 4096, 1536)[i % 3], K=8, E=64, routing="minus_one",
                    fp8=(i % 4 == 3))
        config = (None, SMALL_RING, ONE_SLOT)[i % 3]
        x, topk_idx, weights = make_inputs(rank, R, case, seed=20000 + i)
        layout = native.get_dispatch_layout(topk_idx, 64)
        out = native.dispatch(x, num_tokens_per_rank=layout[0], num_tokens_per_rdma_rank=layout[1],
                              is_token_in_rank=layout[3], num_tokens_per_expert=layout[2], topk_idx=topk_idx,
                              topk_weights=weights, config=config)
        want = reference.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                                  num_tokens_per_expert=layout[2], topk_idx=topk_idx, topk_weights=weights)
        assert_same(f"iteration {i} recv_x", out[0], want[0])
        assert_same(f"iteration {i} recv_topk_idx", out[1], want[1])
        if i % 7 == 0:
            again = native.dispatch(x, handle=out[4])
            assert_same(f"iteration {i} cached recv_x", again[0], want[0])
        expert_out = (want[0][0].float() if isinstance(want[0], tuple) else want[0].float()).to(torch.bfloat16) * 2
        combined = native.combine(expert_out, out[4], topk_weights=out[2], config=config)
        want_c = reference.combine(expert_out, want[4], topk_weights=want[2])
        torch.testing.assert_close(combined[0].float(), want_c[0].float(), rtol=1e-2, atol=1e-2)
    torch.cuda.synchronize()
    native.destroy()
    reference.destroy()
    return iterations


@needs_gpus(2)
def test_300_back_to_back_iterations():
    assert parallel_launch(2, long_run_rank, 300, timeout_s=480.0) == [300, 300]


# ---- failures: a missing peer, ranks that disagree ----------------------------------------------------
def missing_peer_rank(rank: int, R: int, group, op: str) -> str:
    native, _ = make_buffers(group, 1, timeout_s=3.0)
    case = dict(T=64, H=2048, K=4, E=16)
    x, topk_idx, weights = make_inputs(rank, R, case, seed=1)
    layout = native.get_dispatch_layout(topk_idx, 16)
    kwargs = dict(num_tokens_per_rank=layout[0], num_tokens_per_rdma_rank=layout[1], is_token_in_rank=layout[3],
                  num_tokens_per_expert=layout[2], topk_idx=topk_idx, topk_weights=weights)
    return missing_peer_scenario(native, rank, op, x, kwargs, absent_s=10)


@needs_gpus(2, own_gpus=True)
@pytest.mark.parametrize("op", ["dispatch", "combine"])
def test_missing_peer_times_out_with_rank_and_peer(op):
    results = parallel_launch(2, missing_peer_rank, op)
    assert results[1] == "absent"
    assert "rank 0" in results[0] and "peer 1" in results[0] and "timeout" in results[0], results[0]


def mismatch_rank(rank: int, R: int, group) -> str:
    native, _ = make_buffers(group, 1)
    H = 2048 if rank == 0 else 4096  # ranks disagree on the row width
    case = dict(T=64, H=H, K=4, E=16)
    x, topk_idx, weights = make_inputs(rank, R, case, seed=2)
    layout = native.get_dispatch_layout(topk_idx, 16)
    message = dispatch_error(native, layout, x, topk_idx, weights)
    # The buffer stays usable: a consistent dispatch right after works on every rank.
    x, topk_idx, weights = make_inputs(rank, R, dict(T=64, H=2048, K=4, E=16), seed=3)
    dispatch_and_combine(native, native.get_dispatch_layout(topk_idx, 16), x, topk_idx, weights)
    native.destroy()
    return message


@needs_gpus(2)
def test_ranks_that_disagree_on_the_row_layout_fail_on_every_rank():
    results = parallel_launch(2, mismatch_rank)
    assert "rank 1" in results[0] and "different layout" in results[0], results[0]
    assert "rank 0" in results[1] and "different layout" in results[1], results[1]


def auto_rank(rank: int, R: int, group) -> str:
    buffer = Buffer(group, 4 << 20, 0, explicitly_destroy=True,
                    config={"backend": "auto", "transport": "nvlink", "topology": {"ranks_per_node": 1}})
    name = buffer.backend_name
    buffer.destroy()
    return name


@needs_gpus(2)
def test_auto_selection_across_emulated_nodes():
    from ep_plugin.backends import native
    want = "native" if native.INTERNODE_BY_DEFAULT else "reference"
    assert parallel_launch(2, auto_rank) == [want, want]
