"""The native layout kernel (`_C.get_dispatch_layout`, csrc/kernels/layout.cu) against the reference's
`dispatch_layout` (GPU machine; the argument checks run wherever ep_plugin._C is built).

The kernel zeroes nothing before it counts, so every output entry must be one it wrote: the kernel
cases hand it outputs filled with 0x7F bytes, each followed by a guard that must stay so; the backend
cases allocate their outputs from a private memory pool whose memory was filled with 0x7F bytes. Counts
and the token -> rank map must equal the reference's exactly, on fresh random ids with -1 entries,
out-of-range ids (skipped like -1) and repeated ids.
"""
from __future__ import annotations

import math
import random

import pytest
import torch

from ep_plugin import Buffer, Config
from ep_plugin.backends.reference import dispatch_layout
from ep_plugin.launch import parallel_launch
from native_helpers import assert_same, multi_gpu_ranks, needs_ranks

_C = pytest.importorskip("ep_plugin._C", reason="the native extension is not built here")

RANKS = multi_gpu_ranks()  # 2 unless EP_TEST_RANKS says otherwise
GUARD_BYTES = 64
POISON = 0x7F
NAMES = ("num_tokens_per_rank", "num_tokens_per_rdma_rank", "num_tokens_per_expert", "is_token_in_rank")

# (T, K, E, R, ranks_per_node). The kernel's blocks: experts in ranges of max(64, ceil(E / 64)) (at most
# 4096), ranks and nodes in ranges of 32; 1024 threads, a token's ids loaded 8 at a time.
KERNEL_CASES = [
    (0, 8, 256, 2, 2),              # no tokens: the counts are still written (zeros)
    (1, 1, 2, 2, 2),
    (127, 8, 256, 2, 2),
    (1025, 8, 256, 8, 8),           # one token past a block's threads
    (4097, 9, 64, 4, 4),            # K not a multiple of the ids loaded together
    (300, 32, 512, 16, 8),          # the largest top-k; 2 nodes
    (1000, 8, 4160, 32, 8),         # 65 experts per block
    (200, 8, 33 * 8, 33, 1),        # 33 ranks and 33 nodes: a second, partial rank and node block
    (20001, 8, 256, 64, 8),         # many tokens per thread; 2 rank blocks, 8 nodes
    (100, 8, 1024 * 4, 1024, 8),    # the most ranks, 128 nodes
    (64, 6, 1024 * 1024, 1024, 512),  # the most experts (1024 per rank): 4096 per block
    (50, 4, 3, 1, 1),               # one rank
    (96, 8, 96 * 2, 96, 3),         # 32 nodes of 3 ranks: a node block exactly full
]
ROUTINGS = ("random", "unrouted", "one_rank")


def random_ids(T: int, K: int, E: int, R: int, routing: str, generator: torch.Generator) -> torch.Tensor:
    """[T, K] int64 ids: "random": repeats allowed, about 15 % -1, 3 % E + 7 and 3 % -3 (not routed);
    "unrouted": all -1; "one_rank": rank R - 1's experts and -1 only."""
    if routing == "unrouted":
        return torch.full((T, K), -1, dtype=torch.int64)
    low = E - E // R if routing == "one_rank" else 0
    ids = torch.randint(low, E, (T, K), generator=generator)
    pick = torch.rand(T, K, generator=generator)
    ids[pick < 0.15] = -1
    if routing == "random":
        ids[pick > 0.97] = E + 7
        ids[(pick > 0.94) & (pick <= 0.97)] = -3
    return ids


def poisoned(shape, dtype: torch.dtype):
    """(a CUDA tensor of `shape` and `dtype`, its guard: the GUARD_BYTES after it), every byte POISON."""
    size = math.prod(shape) * dtype.itemsize
    raw = torch.full((size + GUARD_BYTES,), POISON, dtype=torch.uint8, device="cuda")
    return raw[:size].view(dtype).view(shape), raw[size:]


def run_kernel(topk_idx: torch.Tensor, E: int, R: int, ranks_per_node: int):
    """The kernel's outputs (per-node counts only with several nodes) and their guards."""
    T, K = topk_idx.shape
    per_rank, per_rank_guard = poisoned((R,), torch.int32)
    per_node, per_node_guard = poisoned((R // ranks_per_node,), torch.int32) if R > ranks_per_node else (None, None)
    per_expert, per_expert_guard = poisoned((E,), torch.int32)
    in_rank, in_rank_guard = poisoned((T, R), torch.bool)
    _C.get_dispatch_layout(topk_idx.data_ptr(), T, K, E, R, ranks_per_node, per_rank.data_ptr(),
                           0 if per_node is None else per_node.data_ptr(), per_expert.data_ptr(), in_rank.data_ptr(),
                           torch.cuda.current_stream().cuda_stream)
    return (per_rank, per_node, per_expert, in_rank), (per_rank_guard, per_node_guard, per_expert_guard, in_rank_guard)


@needs_ranks(1)
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("T,K,E,R,ranks_per_node", KERNEL_CASES)
def test_kernel_writes_every_entry_as_the_reference(T, K, E, R, ranks_per_node, routing):
    seed = random.randrange(1 << 31)
    topk_idx = random_ids(T, K, E, R, routing, torch.Generator().manual_seed(seed)).cuda()
    got, guards = run_kernel(topk_idx, E, R, ranks_per_node)
    want = dispatch_layout(topk_idx, E, R, ranks_per_node)
    torch.cuda.synchronize()
    for name, got_one, want_one, guard in zip(NAMES, got, want, guards):
        assert_same(f"{name} (seed {seed})", got_one, want_one)
        assert guard is None or bool((guard == POISON).all()), f"{name}: written past its end (seed {seed})"


def test_kernel_arguments_are_checked_before_launch():
    """ValueErrors naming the argument, raised before any launch (no GPU needed)."""
    address = 1 << 20  # aligned; never dereferenced
    good = dict(topk_idx=address, num_tokens=4, num_topk=8, num_experts=256, num_ranks=2, ranks_per_node=2,
                num_tokens_per_rank=address, num_tokens_per_node=0, num_tokens_per_expert=address,
                is_token_in_rank=address, stream=0)
    bad = [(dict(num_ranks=0), "ranks"), (dict(num_ranks=1025, num_experts=1025), "ranks"),
           (dict(ranks_per_node=3), "ranks_per_node"), (dict(num_experts=255), "num_experts"),
           (dict(num_tokens=-1), "token count"), (dict(topk_idx=0), "topk_idx"),
           (dict(num_tokens_per_expert=0), "num_tokens_per_expert"), (dict(is_token_in_rank=0), "is_token_in_rank"),
           (dict(num_tokens_per_expert=address + 2), "num_tokens_per_expert")]
    for change, named in bad:
        with pytest.raises(ValueError, match=named):
            _C.get_dispatch_layout(**{**good, **change})


# ---- through the backend (2 ranks; outputs from torch's allocator) --------------------------------
BACKEND_CASES = [(0, 8, 256), (1, 1, 2 * RANKS), (129, 9, 64), (4097, 8, 256), (300, 8, 65 * 64)]  # (T, K, E)


def poison_pool() -> None:
    """Fill the memory a fresh pool's next allocations get with POISON bytes: two 1 MiB blocks (one whole
    2 MiB segment of small blocks) and a 20 MiB block (a segment of large ones), allocated, filled, freed."""
    blocks = [torch.full((size,), POISON, dtype=torch.uint8, device="cuda") for size in (1 << 20, 1 << 20, 20 << 20)]
    del blocks


def backend_rank(rank: int, R: int, group, seed: int) -> bool:
    num_nvl_bytes = Config(24, 8, 256).get_nvl_buffer_size_hint(7168 * 2, R)
    native = Buffer(group, num_nvl_bytes, explicitly_destroy=True, config={"backend": "native"})
    assert native.backend_name == "native"
    generator = torch.Generator().manual_seed(seed + rank)
    for T, K, E in BACKEND_CASES:
        topk_idx = random_ids(T, K, E, R, "random", generator).cuda()
        pool = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(pool):
            poison_pool()
            got = native._backend.get_dispatch_layout(topk_idx, E)
        want = dispatch_layout(topk_idx, E, R, R)
        for name, got_one, want_one in zip(NAMES, got, want):
            assert_same(f"{name} (T {T}, K {K}, E {E}, seed {seed})", got_one, want_one)
        # Buffer's call (its checks take ids in [-1, E) only).
        valid = torch.where(topk_idx < E, topk_idx.clamp(min=-1), -1)
        got = native.get_dispatch_layout(valid, E)[:4]
        for name, got_one, want_one in zip(NAMES, got, dispatch_layout(valid, E, R, R)):
            assert_same(f"Buffer {name} (T {T}, K {K}, E {E}, seed {seed})", got_one, want_one)
    torch.cuda.synchronize()
    native.destroy()
    return True


@needs_ranks(RANKS)
def test_backend_layout_in_poisoned_memory():
    assert parallel_launch(RANKS, backend_rank, random.randrange(1 << 30)) == [True] * RANKS


# ---- Buffer's eager fast path (backends/intranode.py, csrc/torch_outputs.cpp LayoutCalls) ---------------
def refuse(*args, **kwargs):
    raise AssertionError("the checked path ran where the fast path should have")


def fast_path_rank(rank: int, R: int, group, seed: int) -> bool:
    """After one checked call of an expert count, Buffer's plain calls of that count take the fast path (the
    checked path forbidden) and match the reference in poisoned memory, under torch's global default device
    and dtype too; calls it does not take (another layout or dtype, an event, async_finish) go to the checked
    path: the same answer or the same error."""
    num_nvl_bytes = Config(24, 8, 256).get_nvl_buffer_size_hint(7168 * 2, R)
    native = Buffer(group, num_nvl_bytes, explicitly_destroy=True, config={"backend": "native"})
    generator = torch.Generator().manual_seed(seed + rank)

    def fresh_ids(T: int, K: int, E: int) -> torch.Tensor:
        ids = random_ids(T, K, E, R, "random", generator)
        return torch.where(ids < E, ids.clamp(min=-1), -1).cuda()  # Buffer's ids: -1 or an expert

    def check(name: str, got, ids: torch.Tensor, E: int) -> None:
        for part, got_one, want_one in zip(NAMES, got[:4], dispatch_layout(ids, E, R, R)):
            assert_same(f"{name}: {part} (E {E}, seed {seed})", got_one, want_one)

    for T, K, E in BACKEND_CASES:
        native.get_dispatch_layout(fresh_ids(T, K, E), E)  # the checked path: it makes E's fast calls
        native._checked_dispatch_layout = refuse
        try:
            for global_defaults in (False, True):
                ids = fresh_ids(T, K, E)
                pool = torch.cuda.MemPool()
                with torch.cuda.use_mem_pool(pool):
                    poison_pool()
                    if global_defaults:
                        torch.set_default_device("cuda")
                        torch.set_default_dtype(torch.bfloat16)
                    try:
                        got = native.get_dispatch_layout(ids, E)
                    finally:
                        torch.set_default_device(None)
                        torch.set_default_dtype(torch.float32)
                assert got[4].event is None
                check(f"fast path, T {T}, K {K}, global defaults {global_defaults}", got, ids, E)
        finally:
            del native._checked_dispatch_layout
    E = 256
    ids = fresh_ids(300, 8, E)
    for name, call in [("column-major ids", lambda: native.get_dispatch_layout(ids.t().contiguous().t(), E)),
                       ("async_finish", lambda: native.get_dispatch_layout(ids, E, async_finish=True)),
                       ("allocate_on_comm_stream", lambda: native.get_dispatch_layout(
                           ids, E, previous_event=native.capture(), allocate_on_comm_stream=True))]:
        got = call()
        got[4].current_stream_wait()
        check(name, got, ids, E)
    with pytest.raises(TypeError, match="topk_idx must have dtype"):
        native.get_dispatch_layout(ids.int(), E)
    with pytest.raises(ValueError, match="top-k must be in"):
        native.get_dispatch_layout(torch.zeros(4, 33, dtype=torch.int64, device="cuda"), E)
    with pytest.raises(ValueError, match="num_experts must be a positive int"):
        native.get_dispatch_layout(ids, float(E))
    torch.cuda.synchronize()
    native.destroy()
    return True


@needs_ranks(RANKS)
def test_eager_fast_path_matches_the_reference_and_leaves_the_rest_to_the_checked_path():
    assert parallel_launch(RANKS, fast_path_rank, random.randrange(1 << 30)) == [True] * RANKS
