"""Dense, single-process oracle: what each rank must get from dispatch and combine.

Every function takes all ranks' inputs (CPU tensors, lists indexed by rank) and computes one rank's
expected outputs with explicit loops over ranks, tokens and top-k entries, straight from the
semantics in `ep_plugin.Buffer`'s docstrings. It shares no code with the backends; FP8 values
come from `ep_plugin.fp8`, the definition of the FP8 format (tested on its own).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ep_plugin import fp8


def _rows(tensor: torch.Tensor, index: Sequence[int]) -> torch.Tensor:
    """tensor[index] for any dtype (FP8 through its bytes); [0, ...] for an empty index."""
    index = torch.tensor(list(index), dtype=torch.int64)
    if tensor.element_size() == 1 and tensor.dtype != torch.uint8:
        return tensor.view(torch.uint8)[index].view(tensor.dtype)
    return tensor[index]


def _owner(expert: int, num_local_experts: int) -> int:
    return expert // num_local_experts


# ---- normal mode -----------------------------------------------------------------------------------
def layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, ranks_per_node: int
           ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """get_dispatch_layout of one rank: (per rank, per node or None, per expert, is_token_in_rank)."""
    num_local_experts = num_experts // num_ranks
    num_nodes = num_ranks // ranks_per_node
    in_rank = [[False] * num_ranks for _ in range(topk_idx.size(0))]
    per_expert = [0] * num_experts
    for t, row in enumerate(topk_idx.tolist()):
        for expert in row:
            if expert >= 0:
                in_rank[t][_owner(expert, num_local_experts)] = True
                per_expert[expert] += 1
    per_rank = [sum(row[r] for row in in_rank) for r in range(num_ranks)]
    per_node = None
    if num_nodes > 1:
        per_node = [sum(any(row[n * ranks_per_node:(n + 1) * ranks_per_node]) for row in in_rank)
                    for n in range(num_nodes)]
        per_node = torch.tensor(per_node, dtype=torch.int32)
    return (torch.tensor(per_rank, dtype=torch.int32), per_node, torch.tensor(per_expert, dtype=torch.int32),
            torch.tensor(in_rank, dtype=torch.bool).reshape(topk_idx.size(0), num_ranks))


def dispatch_sources(rank: int, num_experts: int, topk_idxs: List[torch.Tensor]) -> List[Tuple[int, int]]:
    """(source rank, token) of each row `rank` receives, in receive order."""
    num_local_experts = num_experts // len(topk_idxs)
    sources = []
    for src, topk_idx in enumerate(topk_idxs):
        for t, row in enumerate(topk_idx.tolist()):
            if any(e >= 0 and _owner(e, num_local_experts) == rank for e in row):
                sources.append((src, t))
    return sources


def dispatch(rank: int, num_experts: int, xs: List[torch.Tensor], topk_idxs: List[torch.Tensor],
             topk_weights: Optional[List[torch.Tensor]] = None, x_scales: Optional[List[torch.Tensor]] = None,
             expert_alignment: int = 1) -> Dict[str, object]:
    """Expected dispatch outputs of `rank` (without padding rows).

    Returns a dict with recv_x, recv_x_scales (or None), recv_topk_idx, recv_topk_weights (or None),
    num_recv_tokens_per_expert_list, sources [(source rank, token)].
    """
    num_ranks = len(xs)
    num_local_experts = num_experts // num_ranks
    sources = dispatch_sources(rank, num_experts, topk_idxs)
    hidden = xs[0].size(1)
    top_k = topk_idxs[0].size(1)
    recv_x = [_rows(xs[src], [t]) for src, t in sources]
    recv_x = torch.cat(recv_x) if recv_x else xs[0].new_empty((0, hidden))
    recv_scales = None
    if x_scales is not None:
        parts = [x_scales[src][t:t + 1] for src, t in sources]
        recv_scales = torch.cat(parts) if parts else x_scales[0].new_empty((0, x_scales[0].size(1)))
    idx_rows, weight_rows = [], []
    per_expert = [0] * num_local_experts
    for src, t in sources:
        idx_row, weight_row = [], []
        for k, expert in enumerate(topk_idxs[src][t].tolist()):
            local = expert - rank * num_local_experts
            if expert >= 0 and 0 <= local < num_local_experts:
                idx_row.append(local)
                per_expert[local] += 1
                weight_row.append(float(topk_weights[src][t, k]) if topk_weights is not None else 0.0)
            else:
                idx_row.append(-1)
                weight_row.append(0.0)
        idx_rows.append(idx_row)
        weight_rows.append(weight_row)
    recv_topk_idx = torch.tensor(idx_rows, dtype=torch.int64).reshape(len(sources), top_k)
    recv_topk_weights = None
    if topk_weights is not None:
        recv_topk_weights = torch.tensor(weight_rows, dtype=torch.float32).reshape(len(sources), top_k)
    aligned = [-(-count // expert_alignment) * expert_alignment for count in per_expert]
    return dict(recv_x=recv_x, recv_x_scales=recv_scales, recv_topk_idx=recv_topk_idx,
                recv_topk_weights=recv_topk_weights, num_recv_tokens_per_expert_list=aligned, sources=sources)


def combine(rank: int, num_experts: int, topk_idxs: List[torch.Tensor], combine_xs: List[torch.Tensor],
            combine_weights: Optional[List[torch.Tensor]] = None,
            biases: Sequence[torch.Tensor] = ()) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Expected combine outputs of `rank`.

    combine_xs[d] are the rows rank d passes to combine (first the received rows, in receive order;
    padding rows after them are ignored). Sums in fp32, rank by rank, then adds the biases.
    """
    num_tokens = topk_idxs[rank].size(0)
    hidden = combine_xs[0].size(1)
    combined = torch.zeros((num_tokens, hidden), dtype=torch.float32)
    weights = None
    if combine_weights is not None:
        weights = torch.zeros((num_tokens, combine_weights[0].size(1)), dtype=torch.float32)
    for dst in range(len(topk_idxs)):
        tokens, rows = [], []
        for i, (src, t) in enumerate(dispatch_sources(dst, num_experts, topk_idxs)):
            if src == rank:
                tokens.append(t)
                rows.append(i)
        if not tokens:
            continue
        combined[tokens] += combine_xs[dst][rows].float()
        if weights is not None:
            weights[tokens] += combine_weights[dst][rows]
    for bias in biases:
        combined = combined + bias.float()
    return combined.to(torch.bfloat16), weights


# ---- low-latency mode ------------------------------------------------------------------------------
def low_latency_entries(rank: int, num_experts: int, topk_idxs: List[torch.Tensor]) -> List[List[Tuple[int, int, int]]]:
    """For each local expert of `rank`, the (source rank, token, k) in its slots, slot 0 first."""
    num_local_experts = num_experts // len(topk_idxs)
    entries: List[List[Tuple[int, int, int]]] = [[] for _ in range(num_local_experts)]
    for src, topk_idx in enumerate(topk_idxs):
        for t, row in enumerate(topk_idx.tolist()):
            for k, expert in enumerate(row):
                if expert >= 0 and _owner(expert, num_local_experts) == rank:
                    entries[expert - rank * num_local_experts].append((src, t, k))
    return entries


def low_latency_dispatch(rank: int, num_experts: int, xs: List[torch.Tensor], topk_idxs: List[torch.Tensor],
                         use_fp8: bool, round_scale: bool = False, use_ue8m0: bool = False) -> Dict[str, object]:
    """Expected low-latency dispatch of `rank`: per local expert, the rows of its valid slots.

    Returns a dict with recv_count (list), entries (see `low_latency_entries`), rows (list of
    [count, H] tensors: bf16, or FP8) and scales (list of [count, S] tensors, or None).
    """
    entries = low_latency_entries(rank, num_experts, topk_idxs)
    if use_fp8:
        quantized = [fp8.quantize(x, round_scale, use_ue8m0) for x in xs]
    rows, scales = [], []
    for expert_entries in entries:
        if use_fp8:
            data = [_rows(quantized[src][0], [t]) for src, t, _ in expert_entries]
            scale = [quantized[src][1][t:t + 1] for src, t, _ in expert_entries]
            empty_scales = quantized[0][1].new_empty((0, quantized[0][1].size(1)))
            scales.append(torch.cat(scale) if scale else empty_scales)
            rows.append(torch.cat(data) if data else quantized[0][0].new_empty((0, xs[0].size(1))))
        else:
            data = [xs[src][t:t + 1] for src, t, _ in expert_entries]
            rows.append(torch.cat(data) if data else xs[0].new_empty((0, xs[0].size(1))))
    return dict(recv_count=[len(e) for e in entries], entries=entries, rows=rows,
                scales=scales if use_fp8 else None)


def low_latency_combine(rank: int, num_experts: int, dispatch_topk_idxs: List[torch.Tensor],
                        combine_topk_idx: torch.Tensor, combine_weights: torch.Tensor,
                        combine_xs: List[torch.Tensor]) -> torch.Tensor:
    """Expected low-latency combine of `rank`: per token, sum over k (k = 0 first) with
    combine_topk_idx[t, k] >= 0 of weight * the row in the slot (t, k) took at dispatch, in fp32.

    combine_xs[d] is rank d's [E_local, R * T_max, H] expert output.
    """
    num_ranks = len(dispatch_topk_idxs)
    num_local_experts = num_experts // num_ranks
    slot_of = {}
    for dst in range(num_ranks):
        for j, expert_entries in enumerate(low_latency_entries(dst, num_experts, dispatch_topk_idxs)):
            for slot, (src, t, k) in enumerate(expert_entries):
                if src == rank:
                    slot_of[(t, k)] = (dst, j, slot)
    num_tokens, top_k = combine_topk_idx.shape
    hidden = combine_xs[0].size(2)
    combined = torch.zeros((num_tokens, hidden), dtype=torch.float32)
    ids = combine_topk_idx.tolist()
    for k in range(top_k):
        term = torch.zeros((num_tokens, hidden), dtype=torch.float32)
        for t in range(num_tokens):
            if ids[t][k] >= 0:
                dst, j, slot = slot_of[(t, k)]
                assert dst * num_local_experts + j == ids[t][k]
                term[t] = combine_weights[t, k] * combine_xs[dst][j, slot].float()
        combined += term
    return combined.to(torch.bfloat16)
