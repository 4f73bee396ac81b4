"""Megatron's grouped-GEMM experts without TransformerEngine, for the layer benchmark.

Megatron builds grouped-GEMM experts as `TEGroupedMLP`, whose `linear_fc1` / `linear_fc2` are any
modules following its `GroupedLinearFc1Interface` / `GroupedLinearFc2Interface` protocols
(megatron/core/transformer/moe/experts.py). TransformerEngine's GroupedLinear is the usual one; TE
is not installed on the GPU machine. `TorchGroupedLinear` follows the same protocol on PyTorch's
own grouped GEMM (`torch.nn.functional.grouped_mm`, CUTLASS on sm90), so the layer runs one GEMM per
linear for all local experts, as with TE, instead of SequentialMLP's chain of small kernels per
expert. Benchmark scope: bf16, no bias, expert tensor parallel size 1.
"""
from __future__ import annotations

import functools
import itertools
from typing import List, Optional, Tuple

import torch


class TorchGroupedLinear(torch.nn.Module):
    """`num_local_experts` linears [output_size, input_size]; rows of expert e are the e-th run of
    `tokens_per_expert` rows of the input."""

    def __init__(self, num_local_experts: int, input_size: int, output_size: int, /, *, config, init_method,
                 bias: bool, skip_bias_add: bool, is_expert: bool, tp_comm_buffer_name: Optional[str],
                 pg_collection, name: Optional[str] = None) -> None:
        super().__init__()
        if bias:
            raise ValueError("TorchGroupedLinear has no bias (set add_bias_linear=False)")
        expert_tp = getattr(pg_collection, "expt_tp", None)
        if expert_tp is not None and expert_tp.size() > 1:
            raise ValueError("TorchGroupedLinear needs expert tensor parallel size 1")
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        weight = torch.empty(num_local_experts, output_size, input_size, dtype=config.params_dtype, device=device)
        for expert in range(num_local_experts):
            init_method(weight[expert])
        self.weight = torch.nn.Parameter(weight)
        self.weight.allreduce = not is_expert  # Megatron's mark for expert-parallel parameters

    def forward(self, hidden: torch.Tensor, tokens_per_expert: List[int], /) -> Tuple[torch.Tensor, None]:
        ends = torch.tensor(list(itertools.accumulate(tokens_per_expert)), dtype=torch.int32)
        ends = ends.to(hidden.device, non_blocking=True)
        # grouped_mm computes hidden[rows of e] @ mat_b[e]; mat_b is the weight transposed (a view).
        return torch.nn.functional.grouped_mm(hidden, self.weight.transpose(1, 2), offs=ends), None

    def backward_dw(self) -> None:
        """Weight gradients are computed in the backward pass itself (no delayed wgrad)."""


def grouped_experts_builder():
    """The `experts` entry of Megatron's MoESubmodules: TEGroupedMLP over TorchGroupedLinear."""
    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP

    linears = GroupedMLPSubmodules(linear_fc1=TorchGroupedLinear, linear_fc2=TorchGroupedLinear)
    return functools.partial(TEGroupedMLP, submodules=linears)
