"""DeepEP-compatible performance `Config` and the buffer-size formulas of the native kernels.

The formulas mirror `csrc/kernels/buffer_layout.cuh` (the single source of truth for how the native
kernels carve their buffers); `tests/test_native_layout.py` checks that both agree wherever the
extension is importable (CI builds it).
"""
from __future__ import annotations

import math
from typing import Optional

# Limits shared with csrc/kernels/buffer_layout.cuh.
NUM_MAX_NVL_PEERS = 8          # ranks of one NVLink domain handled by the intranode kernels
MAX_CHANNELS = 64              # channels = num_sms / 2
MAX_TOPK = 32                  # top-k carried per token
MAX_LOCAL_EXPERTS = 1024       # experts per rank reported by the notify step
WARPS_PER_CHANNEL = 16         # sender/receiver warps per channel, one sub-ring each
SLOT_META_BYTES = 272          # row, source index, top-k ids and weights: align16(8 + 8 * MAX_TOPK)
SLOT_LINE_BYTES = 128          # payloads start, and slots end, on whole 128-byte lines
NVL_HEADER_BYTES = 1 << 20     # notify area, barrier signals, ring counters, persistent state
# The copy-engine combine's staging area (StagingLayout): per peer, up to 64 slots of 512-row pieces;
# a row is its bf16 hidden plus room for MAX_TOPK float weights.
STAGING_ROWS_PER_PIECE = 512
MAX_STAGING_SLOTS = 64

# Low-latency mode (csrc/kernels/low_latency_layout.cuh): a token's payload crosses to a rank once,
# each (token, expert) message is a 4-byte index entry; a signal header of two rounds x 2 x 65536 u64
# words + 128 bytes of state, each round's header rounded up to 4 KiB.
LL_INDEX_ENTRY_BYTES = 4
LL_MAX_TOPK = MAX_TOPK
LL_MAX_EXPERTS = 65536
LL_AREA_ALIGN = 128
LL_HEADER_BYTES = 2 * ((2 * LL_MAX_EXPERTS * 8 + 128 + 4095) // 4096 * 4096)
LL_ROUTE_BYTES = 2 * 4 * LL_MAX_TOPK               # a payload's route: int32 ids, float weights
LL_ROUTE_RECORD_BYTES = 16 + 2 * 4 * LL_MAX_TOPK   # RouteRecord: mask (+ padding), weights, rows

# Internode normal mode (csrc/kernels/internode_layout.cuh): a fixed header (notify slots and
# signal words for 256 nodes, ring counters for 2 kinds x 128 channels x 256 nodes, state), rounded
# up to 1 MiB; slots of align16(hidden_bytes) + 416 bytes. The network leg's channels are
# sub-channels: a block of 16 warps serves up to 16 / nodes of them.
INTERNODE_MAX_NODES = 256
INTERNODE_MAX_CHANNELS = 128
INTERNODE_NOTIFY_SLOT_BYTES = 1024
INTERNODE_SLOT_EXTRA_BYTES = 16 + 8 * MAX_TOPK + 4 * MAX_TOPK + 16
INTERNODE_AREA_ALIGN = 128
INTERNODE_HEADER_BYTES = (4 * INTERNODE_MAX_NODES * INTERNODE_NOTIFY_SLOT_BYTES + 8 * INTERNODE_MAX_NODES
                          + 4 * 8 * 2 * INTERNODE_MAX_CHANNELS * INTERNODE_MAX_NODES + 128 + (1 << 20) - 1) >> 20 << 20


def _align(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


SLOT_PAYLOAD_OFFSET = _align(SLOT_META_BYTES, SLOT_LINE_BYTES)  # where a slot's payload starts


def slots_per_sub_ring(num_max_nvl_chunked_recv_tokens: int) -> int:
    """Ring slots of one sender/receiver warp pair: the channel's receive budget split over warps."""
    return max(2, math.ceil(num_max_nvl_chunked_recv_tokens / WARPS_PER_CHANNEL))


def nvl_slot_bytes(payload_bytes: int) -> int:
    return SLOT_PAYLOAD_OFFSET + _align(payload_bytes, SLOT_LINE_BYTES)


# The copy-engine combine (`auto`: 4096 rows per peer). At 2 ranks the engines copy each sender's rows into
# the owner's staging area. From PULL_MIN_RANKS on, copies into several peers at once were slower than the SM
# combine (docs/design.md, "Copy engines at 3-8 ranks"): each sender's engines copy the rows within its own
# GPU and the owner pulls them across NVLink ("Pulled by the owners"). The pulled sum holds a token's copies
# from at most STAGING_MAX_RANKS ranks; above that no staging area is allocated, whatever the setting.
AUTO_STAGING_TOKENS = 4096
STAGING_MAX_RANKS = 4
PULL_MIN_RANKS = 3


# A combine whose largest block (the most rows any rank sends any one owner, times their bytes; the same
# count on every rank) is smaller takes the rings: the copy engines' host side (about 50 us a combine at 2
# ranks, 90 us pulled at 4, against the rings' 30) would outlast the rings' GPU time, and eager calls would
# wait for the host (docs/design.md, "Small combines").
COPY_ENGINE_MIN_BLOCK_BYTES = 4 << 20
PULL_MIN_BLOCK_BYTES = 16 << 20


def pulls_rows(num_ranks: int) -> bool:
    """Whether a copy-engine combine of `num_ranks` ranks has its owners pull the rows (StagedReduceArgs.pull_rows)."""
    return num_ranks >= PULL_MIN_RANKS


def block_takes_copy_engines(num_ranks: int, largest_block_rows: int, hidden: int) -> bool:
    """Whether a combine whose largest block has `largest_block_rows` bf16 rows of `hidden` is large enough for
    the copy engines at `num_ranks` ranks."""
    least = PULL_MIN_BLOCK_BYTES if pulls_rows(num_ranks) else COPY_ENGINE_MIN_BLOCK_BYTES
    return largest_block_rows * 2 * hidden >= least


def staging_tokens(buffer, num_ranks: int) -> int:
    """Rows per peer of the copy-engine combine's staging area that `buffer` asks for (0: none)."""
    if num_ranks > STAGING_MAX_RANKS:
        return 0
    if buffer.combine_staging_tokens == "auto":
        return AUTO_STAGING_TOKENS
    return int(buffer.combine_staging_tokens)


def staging_bytes(buffer, num_ranks: int) -> int:
    """Bytes of the copy-engine combine's staging area for the `buffer` config section.

    Room for `staging_tokens` rows (rounded up to whole pieces, at least two, at most
    MAX_STAGING_SLOTS) of `buffer.max_hidden` from every other rank of the NVLink domain;
    0 when that is 0 or there is no other rank.
    """
    peers = min(num_ranks, NUM_MAX_NVL_PEERS) - 1
    tokens = staging_tokens(buffer, num_ranks)
    if peers < 1 or tokens == 0:
        return 0
    pieces = min(MAX_STAGING_SLOTS, max(2, math.ceil(tokens / STAGING_ROWS_PER_PIECE)))
    return peers * pieces * STAGING_ROWS_PER_PIECE * (2 * buffer.max_hidden + 4 * MAX_TOPK)


# `buffer.dispatch_output_bytes: auto`: the direct dispatch at 1 to 4 ranks, with room for two dispatches of
# 4096 tokens per rank from every rank (at least 2), alive at once: 16384 received rows of `max_hidden` at 1
# and 2 ranks, 32768 at 4. Measured faster than the rings at 2 ranks (2x H200: 177 against 234 us, BF16
# cached) and at 4 (4x H200: 466 against 596 us); none at more ranks, where it has not
# run on GPUs of their own. Dispatches that do not fit take the rings.
AUTO_OUTPUT_TOKENS_PER_RANK = 4096
AUTO_OUTPUT_DISPATCHES = 2
AUTO_OUTPUT_MAX_RANKS = 4


def auto_output_rows(num_ranks: int) -> int:
    """Received rows the `auto` output region holds at `num_ranks` (0: no region)."""
    if num_ranks > AUTO_OUTPUT_MAX_RANKS:
        return 0
    return AUTO_OUTPUT_DISPATCHES * AUTO_OUTPUT_TOKENS_PER_RANK * max(num_ranks, 2)


def output_row_bytes(max_hidden: int) -> int:
    """Region bytes of one received row at most: BF16 row, FP32 scales per 128 channels, top-k ids and
    weights (at most MAX_TOPK), source index."""
    return 2 * max_hidden + 4 * math.ceil(max_hidden / 128) + 12 * MAX_TOPK + 4


def output_region_bytes(buffer, num_ranks: int) -> int:
    """Bytes of the direct dispatch's output region that `buffer` asks for (0: none)."""
    if buffer.dispatch_output_bytes == "auto":
        return auto_output_rows(num_ranks) * output_row_bytes(buffer.max_hidden)
    return int(buffer.dispatch_output_bytes)


def staging_rows(staging_bytes_: int, num_ranks: int, hidden: int) -> int:
    """Rows per peer that `staging_bytes_` hold at `hidden` (0: fewer than two pieces)."""
    if num_ranks < 2:
        return 0
    piece_bytes = STAGING_ROWS_PER_PIECE * (2 * hidden + 4 * MAX_TOPK)
    slots = min(MAX_STAGING_SLOTS, staging_bytes_ // (num_ranks - 1) // piece_bytes)
    return 0 if slots < 2 else slots * STAGING_ROWS_PER_PIECE


class Config:
    """Tuning of one normal-mode operation, same constructor and methods as DeepEP's `Config`.

    Arguments:
        num_sms: SMs the kernel may use (even: one sender and one receiver block per channel).
        num_max_nvl_chunked_send_tokens: tokens a sender publishes at once (kept for DeepEP
            compatibility; the native kernels publish every token).
        num_max_nvl_chunked_recv_tokens: ring capacity per (channel, peer) in tokens.
        num_max_rdma_chunked_send_tokens: rows a network-leg sender announces at once (internode
            mode): one put with signal over the network, one counter update over NVLink.
        num_max_rdma_chunked_recv_tokens: ring capacity per (channel, node) in tokens of the
            network leg (split among a block's sub-channels).
    """

    def __init__(self, num_sms: int = 20,
                 num_max_nvl_chunked_send_tokens: int = 6, num_max_nvl_chunked_recv_tokens: int = 256,
                 num_max_rdma_chunked_send_tokens: int = 6, num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        values = dict(num_sms=num_sms,
                      num_max_nvl_chunked_send_tokens=num_max_nvl_chunked_send_tokens,
                      num_max_nvl_chunked_recv_tokens=num_max_nvl_chunked_recv_tokens,
                      num_max_rdma_chunked_send_tokens=num_max_rdma_chunked_send_tokens,
                      num_max_rdma_chunked_recv_tokens=num_max_rdma_chunked_recv_tokens)
        for name, value in values.items():
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Config.{name} must be a positive int, got {value!r}")
        if num_sms % 2 != 0:
            raise ValueError(f"Config.num_sms must be even (one sender and one receiver SM per channel), got {num_sms}")
        if num_sms // 2 > MAX_CHANNELS:
            raise ValueError(f"Config.num_sms must be at most {2 * MAX_CHANNELS}, got {num_sms}")
        if num_max_nvl_chunked_send_tokens > num_max_nvl_chunked_recv_tokens:
            raise ValueError("Config.num_max_nvl_chunked_send_tokens must not exceed num_max_nvl_chunked_recv_tokens")
        if num_max_rdma_chunked_send_tokens > num_max_rdma_chunked_recv_tokens:
            raise ValueError("Config.num_max_rdma_chunked_send_tokens must not exceed num_max_rdma_chunked_recv_tokens")
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    @property
    def num_channels(self) -> int:
        return self.num_sms // 2

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of NVLink buffer the native normal-mode kernels need for rows of `hidden_bytes`.

        `hidden_bytes` is the largest payload per token, as DeepEP users compute it:
        `hidden * max(x.element_size(), 2)` (FP8 rows plus their scales fit in that).
        """
        num_nvl_peers = min(num_ranks, NUM_MAX_NVL_PEERS)
        rings = (num_nvl_peers - 1) * self.num_channels * WARPS_PER_CHANNEL
        slots = slots_per_sub_ring(self.num_max_nvl_chunked_recv_tokens)
        return NVL_HEADER_BYTES + rings * slots * nvl_slot_bytes(hidden_bytes)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int,
                                  ranks_per_node: Optional[int] = None) -> int:
        """Bytes of RDMA (NVSHMEM) buffer for internode normal mode; 0 inside one node.

        `ranks_per_node`: GPUs per node (default: DeepEP's assumption of 8, so 0 up to 8 ranks);
        pass it for other shapes, e.g. 1 to emulate one node per GPU (`topology.ranks_per_node`).
        Mirrors `InternodeLayout::total_bytes` (csrc/kernels/internode_layout.cuh): a fixed header,
        then a dispatch and a combine area, each with a receive ring and a send staging ring per
        (channel, node) of `num_max_rdma_chunked_recv_tokens` slots of
        align16(hidden_bytes) + 416 bytes (slot meta, top-k ids and weights at top-k 32, alignment).
        """
        if ranks_per_node is None:
            ranks_per_node = NUM_MAX_NVL_PEERS
            num_nodes = math.ceil(num_ranks / ranks_per_node)
        else:
            if not isinstance(ranks_per_node, int) or ranks_per_node < 1 or num_ranks % ranks_per_node != 0:
                raise ValueError(f"ranks_per_node = {ranks_per_node!r} must be a positive divisor of num_ranks = "
                                 f"{num_ranks}")
            num_nodes = num_ranks // ranks_per_node
        if num_nodes <= 1:
            return 0
        if num_nodes > INTERNODE_MAX_NODES:
            raise ValueError(f"{num_nodes} nodes; internode mode supports at most {INTERNODE_MAX_NODES}")
        slot = _align(hidden_bytes, 16) + INTERNODE_SLOT_EXTRA_BYTES
        ring = self.num_channels * num_nodes * self.num_max_rdma_chunked_recv_tokens * slot
        return INTERNODE_HEADER_BYTES + 2 * _align(2 * ring, INTERNODE_AREA_ALIGN)

    def __repr__(self) -> str:
        return (f"Config(num_sms={self.num_sms}, num_max_nvl_chunked_send_tokens={self.num_max_nvl_chunked_send_tokens}, "
                f"num_max_nvl_chunked_recv_tokens={self.num_max_nvl_chunked_recv_tokens}, "
                f"num_max_rdma_chunked_send_tokens={self.num_max_rdma_chunked_send_tokens}, "
                f"num_max_rdma_chunked_recv_tokens={self.num_max_rdma_chunked_recv_tokens})")


def _default_config(num_sms: int, num_ranks: int) -> Config:
    # A sub-ring holds two publication chunks, so senders keep writing while receivers drain. Small
    # rings measured fastest at 2 ranks (4/128 against 8/256 and 16/512: docs/performance.md).
    if num_ranks <= 2:
        return Config(num_sms, 4, 128, 6, 128)
    if num_ranks <= NUM_MAX_NVL_PEERS:
        return Config(num_sms, 6, 128, 6, 128)
    return Config(num_sms, 6, 128, 16, 256)


def default_dispatch_config(num_sms: int, num_ranks: int) -> Config:
    """Recommended dispatch tuning for any rank count (no closed table)."""
    return _default_config(num_sms, num_ranks)


# The SM combine inside one NVLink domain: rings of 256 rows published every 9 (DeepEP V1's own chunks
# at 4 ranks). 4x H100, BF16, 24 SMs, one combine per rank (benchmarks/probes/combine_times.py): EP4
# 687-716 us against 722-793 with 24 / 512, 845-932 with 6 / 256 and 1293-1356 with 2 / 64; EP2 431 us
# against 437-439 with 16 / 256 and 699-735 with 4 / 128 (docs/design.md, docs/configuration.md).
COMBINE_SEND_TOKENS = 9
COMBINE_RECV_TOKENS = 256


def default_combine_config(num_sms: int, num_ranks: int) -> Config:
    """Recommended combine tuning for any rank count (no closed table)."""
    base = _default_config(num_sms, num_ranks)
    if num_ranks > NUM_MAX_NVL_PEERS:
        return base
    return Config(num_sms, COMBINE_SEND_TOKENS, COMBINE_RECV_TOKENS,
                  base.num_max_rdma_chunked_send_tokens, base.num_max_rdma_chunked_recv_tokens)


def low_latency_payload_bytes(hidden: int) -> int:
    """Room for one low-latency payload: the bf16 row, or the FP8 row and its float scales; then the
    route (top-k ids and weights) that a dispatch given topk_weights adds."""
    fp8 = _align(hidden, 16) + _align(4 * math.ceil(hidden / 128), 16)
    return max(_align(hidden * 2, 16), fp8) + LL_ROUTE_BYTES


def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int,
                                   num_ranks: int, num_experts: int) -> int:
    """Symmetric-buffer bytes for low-latency mode (two rounds in flight, as DeepEP allows).

    A fixed signal header, then per round (T_max tokens, E experts, R ranks):
        dispatch receive   the larger of: R * T_max token payloads + E * T_max index entries (the
                           dispatch), and E * T_max bf16 rows (the combine sends from it; it is the
                           zero-copy buffer)
        combine receive    T_max * 32 bf16 rows (token, top-k slot)
        dispatch send      T_max payloads + T_max * 32 staged index entries (network peers)
        route table        R * T_max records (a mask, 32 weights, 32 rows) for expert-side sums, then
                           the pair list (R * T_max int32)
    """
    if num_experts % num_ranks != 0:
        raise ValueError(f"num_experts ({num_experts}) must be divisible by num_ranks ({num_ranks})")
    T, payload = num_max_dispatch_tokens_per_rank, low_latency_payload_bytes(hidden)
    token_recv = _align(num_ranks * T * payload, LL_AREA_ALIGN)
    recv_index = _align(num_experts * T * LL_INDEX_ENTRY_BYTES, LL_AREA_ALIGN)
    dispatch_recv = max(token_recv + recv_index, _align(num_experts * T * hidden * 2, LL_AREA_ALIGN))
    combine_recv = _align(T * LL_MAX_TOPK * hidden * 2, LL_AREA_ALIGN)
    dispatch_send = _align(T * payload, LL_AREA_ALIGN) + _align(T * LL_MAX_TOPK * LL_INDEX_ENTRY_BYTES, LL_AREA_ALIGN)
    route_table = _align(num_ranks * T * LL_ROUTE_RECORD_BYTES, LL_AREA_ALIGN) + _align(num_ranks * T * 4, LL_AREA_ALIGN)
    return LL_HEADER_BYTES + 2 * (dispatch_recv + combine_recv + dispatch_send + route_table)
