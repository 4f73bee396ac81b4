"""The contract between `ep_plugin.Buffer` and a backend.

`Buffer` validates every argument (types, shapes, dtypes, devices, limits) and handles streams and
events; a backend receives canonical, validated inputs and returns plain tensors. Backends run on
the current CUDA stream (Buffer makes its communication stream current) and allocate there.

A backend's handles are wrapped by `ep_plugin.handles` into DeepEP's tuples (the positions read
the fields named there); backends get their own handle back. Every handle carries `owner` (the backend that made it, so that
Buffer can reject foreign handles); a low-latency handle also carries `num_tokens` (T of the
dispatch) and `recv_shape` ((E_local, R * T_max, H), the shape combine's `x` must have). The semantics of
each operation are written down in `Buffer`'s docstrings and in docs/design.md; the reference
backend is their executable definition.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..config import EpConfig
from ..tuning import Config


@dataclass(frozen=True)
class GroupInfo:
    """Who we are in the expert-parallel group."""
    group: dist.ProcessGroup
    rank: int
    num_ranks: int
    ranks_per_node: int
    device: torch.device

    @property
    def num_nodes(self) -> int:
        return self.num_ranks // self.ranks_per_node

    @property
    def is_intranode(self) -> bool:
        return self.num_nodes == 1


# (recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle)
DispatchOutput = Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor],
                       List[int], object]

# (recv_x or (recv_x_fp8, recv_scales), recv_count, handle, hook or None)
@dataclass(frozen=True)
class DispatchRoute:
    """The topk_idx and topk_weights of a low-latency dispatch given topk_weights, with their version
    counters then: the combine must get the same tensors, unmodified (a backend may have sent the
    weights ahead with the tokens and summed on the expert side)."""
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    idx_version: int
    weights_version: int

    @classmethod
    def of(cls, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> "DispatchRoute":
        return cls(topk_idx, topk_weights, topk_idx._version, topk_weights._version)


LowLatencyDispatchOutput = Tuple[object, torch.Tensor, object, Optional[Callable[[], None]]]


class Backend(abc.ABC):
    """One implementation of the expert-parallel all-to-all."""

    name: str = "abstract"

    def __init__(self, info: GroupInfo, settings: EpConfig, num_nvl_bytes: int, num_rdma_bytes: int,
                 low_latency_mode: bool) -> None:
        self.info = info
        self.settings = settings
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode

    # ---- normal mode -------------------------------------------------------------------------
    @abc.abstractmethod
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int
                            ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
        """topk_idx: [T, K] int64 -> (num_tokens_per_rank [R] int32,
        num_tokens_per_rdma_rank [num_nodes] int32 or None when intranode,
        num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool)."""

    @abc.abstractmethod
    def dispatch(self, x: torch.Tensor, x_scales: Optional[torch.Tensor],
                 topk_idx: Optional[torch.Tensor], topk_weights: Optional[torch.Tensor],
                 num_tokens_per_rank: torch.Tensor, is_token_in_rank: torch.Tensor,
                 num_tokens_per_expert: torch.Tensor, expert_alignment: int, num_worst_tokens: int,
                 config: Config) -> DispatchOutput:
        """Non-cached dispatch; see `Buffer.dispatch`. Without `topk_idx` (then no `topk_weights`) rows go
        by `is_token_in_rank` alone and recv_topk_idx / recv_topk_weights are None."""

    @abc.abstractmethod
    def cached_dispatch(self, x: torch.Tensor, x_scales: Optional[torch.Tensor], handle: object,
                        config: Config) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Dispatch reusing the layout of an earlier dispatch's handle; returns (recv_x, recv_x_scales)."""

    @abc.abstractmethod
    def combine(self, x: torch.Tensor, handle: object, topk_weights: Optional[torch.Tensor],
                bias_0: Optional[torch.Tensor], bias_1: Optional[torch.Tensor],
                config: Config) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Reverse of dispatch with an unweighted fp32 sum; returns (combined_x, combined_topk_weights)."""

    @abc.abstractmethod
    def handle_num_recv_rows(self, handle: object) -> int:
        """Rows of the `x` that `combine` expects for this handle (received tokens, or num_worst_tokens)."""

    @abc.abstractmethod
    def handle_num_tokens(self, handle: object) -> int:
        """Tokens this rank dispatched (rows of combine's output)."""

    # ---- low-latency mode --------------------------------------------------------------------
    @abc.abstractmethod
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor,
                             num_max_dispatch_tokens_per_rank: int, num_experts: int,
                             cumulative_local_expert_recv_stats: Optional[torch.Tensor],
                             use_fp8: bool, round_scale: bool, use_ue8m0: bool,
                             return_recv_hook: bool, topk_weights: Optional[torch.Tensor]) -> LowLatencyDispatchOutput:
        """See `Buffer.low_latency_dispatch`. `topk_weights` (or None): the weights the combine will use,
        for a backend that sums on the expert side."""

    @abc.abstractmethod
    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: object, zero_copy: bool, return_recv_hook: bool,
                            out: Optional[torch.Tensor]) -> Tuple[torch.Tensor, Optional[Callable[[], None]]]:
        """See `Buffer.low_latency_combine`; returns (combined_x, hook or None)."""

    @abc.abstractmethod
    def get_next_low_latency_combine_buffer(self, handle: object) -> torch.Tensor:
        """[E_local, R * T_max, H] bf16 tensor that the next `low_latency_combine(zero_copy=True)` reads."""

    @abc.abstractmethod
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int,
                                 num_experts: int) -> None:
        """Reset the state low-latency kernels rely on (after normal-mode use of the same buffer)."""

    def destroy(self, collective: bool = True) -> None:
        """Release device resources; the backend is unusable afterwards.

        `collective`: every rank is destroying its buffer now, so the backend may synchronise the
        group first (False from a destructor, where a barrier could hang).
        """
