"""Expert-major permutation of received rows, and its reverse, without atomics.

After a normal-mode dispatch each received row carries the local experts it selected. Expert
frameworks want the rows grouped by expert: row n copied once per selected expert, experts in
order, rows in ascending order within an expert (Megatron's `permute` order). The reverse sums
each row's copies back. Megatron does the reverse with `scatter_add_` and the permute's backward
with `index_add_` (both atomics, and slow on large rows); here both are one gather-and-sum kernel
(`ep_plugin._C.gather_sum_rows`) in which every output row is owned by one warp and summed in fp32.

    order = ExpertMajorOrder.from_routing(routing_map, num_out_rows)
    permuted = permute_rows(x, order)            # [M, H]
    restored = unpermute_rows(permuted, order)   # [N, H]: the sum of each row's copies

Both are differentiable (each is the other's backward). bf16 CUDA tensors use the kernel; other
dtypes and CPU tensors take a PyTorch path with the same result.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    from . import _C
except ImportError:  # built without a CUDA toolkit: the PyTorch path only
    _C = None


@dataclass
class ExpertMajorOrder:
    """Where every copy goes.

    source_rows: `[M]` int64: the input row of output row m.
    slot_rows: `[N, E]` int32: the output row holding row n's copy for expert e, or -1.
    flat_positions: `[M]` int64: position (e * N + n) of output row m in the expert-major flattened map
        (to permute anything laid out like the routing map, e.g. probs).
    """
    source_rows: torch.Tensor
    slot_rows: torch.Tensor
    flat_positions: torch.Tensor

    @classmethod
    def from_routing(cls, routing_map: torch.Tensor, num_out_rows: int) -> "ExpertMajorOrder":
        """`routing_map`: `[N, E]` bool; `num_out_rows`: its number of True entries (a host int, so no sync)."""
        if routing_map.dim() != 2:
            raise ValueError(f"routing_map must be [rows, experts], got shape {tuple(routing_map.shape)}")
        num_rows, num_experts = routing_map.shape
        expert_major = routing_map.bool().T.reshape(-1)
        # A stable descending sort puts the True entries first, in (expert, row) order; fixed shapes, no sync.
        flat_positions = expert_major.argsort(descending=True, stable=True)[:num_out_rows]
        slot_rows = torch.full((num_experts * num_rows,), -1, dtype=torch.int32, device=routing_map.device)
        slot_rows.scatter_(0, flat_positions, torch.arange(num_out_rows, dtype=torch.int32, device=routing_map.device))
        slot_rows = slot_rows.view(num_experts, num_rows).T.contiguous()
        return cls(source_rows=flat_positions % max(num_rows, 1), slot_rows=slot_rows, flat_positions=flat_positions)

    def permute_like_routing(self, values: torch.Tensor) -> torch.Tensor:
        """`[N, E]` values (e.g. probs) -> `[M]`, one per output row (differentiable)."""
        return values.T.reshape(-1).index_select(0, self.flat_positions)


def gather_sum_rows(rows: torch.Tensor, slot_rows: torch.Tensor) -> torch.Tensor:
    """out[n] = sum of rows[slot_rows[n, e]] over e with slot_rows[n, e] >= 0 (fp32 sums, fp64 for fp64
    rows; the rows' dtype out)."""
    num_out, hidden = slot_rows.size(0), rows.size(1)
    if _uses_kernel(rows):
        rows = rows.contiguous()
        out = torch.empty(num_out, hidden, dtype=rows.dtype, device=rows.device)
        _C.gather_sum_rows(rows=rows.data_ptr(), index=slot_rows.data_ptr(), out=out.data_ptr(), num_out_rows=num_out,
                           num_slots=slot_rows.size(1), hidden=hidden,
                           num_sms=torch.cuda.get_device_properties(rows.device).multi_processor_count,
                           stream=torch.cuda.current_stream(rows.device).cuda_stream)
        return out
    valid = slot_rows >= 0
    targets = torch.arange(num_out, device=rows.device).unsqueeze(1).expand_as(slot_rows)[valid]
    sum_dtype = torch.float64 if rows.dtype == torch.float64 else torch.float32
    out = torch.zeros(num_out, hidden, dtype=sum_dtype, device=rows.device)
    out.index_add_(0, targets, rows.to(sum_dtype).index_select(0, slot_rows[valid].long()))
    return out.to(rows.dtype)


def _uses_kernel(rows: torch.Tensor) -> bool:
    return (_C is not None and rows.is_cuda and rows.dtype == torch.bfloat16 and rows.dim() == 2
            and rows.size(1) % 8 == 0)


class _PermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, source_rows: torch.Tensor, slot_rows: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(slot_rows)
        return x.index_select(0, source_rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (slot_rows,) = ctx.saved_tensors
        return gather_sum_rows(grad, slot_rows), None, None


class _UnpermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, permuted: torch.Tensor, source_rows: torch.Tensor, slot_rows: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(source_rows)
        return gather_sum_rows(permuted, slot_rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (source_rows,) = ctx.saved_tensors
        return grad.index_select(0, source_rows), None, None


def permute_rows(x: torch.Tensor, order: ExpertMajorOrder) -> torch.Tensor:
    """`[N, H]` -> `[M, H]`, one copy per (row, selected expert), grouped by expert."""
    return _PermuteRows.apply(x, order.source_rows, order.slot_rows)


def unpermute_rows(permuted: torch.Tensor, order: ExpertMajorOrder) -> torch.Tensor:
    """`[M, H]` -> `[N, H]`: each row's copies summed (rows with no copy are zero)."""
    return _UnpermuteRows.apply(permuted, order.source_rows, order.slot_rows)
