"""Argument checks shared by every backend: each raises before any kernel runs, naming the argument."""
from __future__ import annotations

import functools
from typing import Iterable, Optional, Sequence, Tuple

import torch

from .tuning import MAX_TOPK

FP8_DTYPE = torch.float8_e4m3fn


@functools.lru_cache(maxsize=None)
def _cuda_available() -> bool:
    return torch.cuda.is_available()  # NOTE: asked once: each call reads the environment and may ask NVML


def is_capturing() -> bool:
    return _cuda_available() and torch.cuda.is_current_stream_capturing()


def check_tensor(name: str, tensor, dtypes: Sequence[torch.dtype], ndim: int,
                 device: Optional[torch.device] = None, shape: Optional[Sequence[Optional[int]]] = None) -> None:
    """Type, dtype, rank, device and (partial: None = any size) shape of one tensor argument."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in dtypes:
        allowed = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype {allowed}, got {tensor.dtype}")
    size = tensor.shape
    if len(size) != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(size)}")
    if device is not None and tensor.device != device:
        raise ValueError(f"{name} must be on {device}, got {tensor.device}")
    if shape is not None and size != shape:  # a full match first: the common case, and quick
        for axis, want in enumerate(shape):
            if want is not None and want != size[axis]:
                raise _size_error(name, want, axis, size)


def _size_error(name: str, want: int, axis: int, size: torch.Size) -> ValueError:
    return ValueError(f"{name} must have size {want} in dimension {axis}, got shape {tuple(size)}")


def check_row_bytes(name: str, tensor: torch.Tensor) -> None:
    row_bytes = tensor.shape[-1] * tensor.element_size()
    if row_bytes % 16 != 0:
        raise ValueError(f"{name}: rows must be a multiple of 16 bytes (hidden {tensor.shape[-1]} x "
                         f"{tensor.element_size()} B = {row_bytes} B)")


def check_topk(name: str, topk_idx: torch.Tensor, num_tokens: Optional[int], device: torch.device) -> None:
    """`[T, K]` int64 expert ids with T = num_tokens (None: any) and K in [1, MAX_TOPK]."""
    check_tensor(name, topk_idx, (torch.int64,), 2, device)
    rows, num_topk = topk_idx.shape
    if num_tokens is not None and rows != num_tokens:
        raise _size_error(name, num_tokens, 0, topk_idx.shape)
    if num_topk < 1 or num_topk > MAX_TOPK:
        raise ValueError(f"{name}: top-k must be in [1, {MAX_TOPK}], got {num_topk}")


def check_expert_ids(name: str, topk_idx: torch.Tensor, num_experts: int) -> None:
    """Expert ids must be -1 (not routed) or in [0, num_experts). One host sync; skipped under capture."""
    if topk_idx.numel() == 0 or is_capturing():
        return
    low, high = torch.stack(torch.aminmax(topk_idx)).tolist()  # one device-to-host copy, not two
    if low >= -1 and high < num_experts:
        return
    bad = ((topk_idx < -1) | (topk_idx >= num_experts)).nonzero()[0].tolist()
    value = int(topk_idx[bad[0], bad[1]])
    raise ValueError(f"{name}[{bad[0]}, {bad[1]}] = {value} is not an expert id: expected -1 or a value in "
                     f"[0, {num_experts})")


def check_hook_without_async(async_finish: bool, return_recv_hook: bool) -> None:
    """Low-latency calls take a receive hook or async_finish, not both (as DeepEP requires)."""
    if async_finish and return_recv_hook:
        raise ValueError("async_finish=True and return_recv_hook=True cannot be combined: with the hook, the "
                         "receive runs when hook() is called, on the calling stream, after the send")


def check_dispatch_route(route, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> None:
    """A low-latency dispatch given topk_weights (its `DispatchRoute`, or None) binds its combine to the
    same topk_idx and topk_weights tensors, not modified in place since (version counters unchanged)."""
    if route is None:
        return
    for name, given, sent, version in (("topk_idx", topk_idx, route.topk_idx, route.idx_version),
                                       ("topk_weights", topk_weights, route.topk_weights, route.weights_version)):
        if given is not sent:
            raise ValueError(f"low_latency_combine: the dispatch was given topk_weights, so the combine must be "
                             f"given the dispatch's own {name} tensor (the weights went ahead with the tokens)")
        if given._version != version:
            raise ValueError(f"low_latency_combine: {name} was modified in place after the dispatch that was given "
                             f"topk_weights (the weights went ahead with the tokens); mask or reweight before the "
                             f"dispatch")


def check_num_experts(num_experts: int, num_ranks: int) -> None:
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts <= 0:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if num_experts % num_ranks != 0:
        raise ValueError(f"num_experts ({num_experts}) must be divisible by the number of ranks ({num_ranks})")


def split_x(x, device: torch.device, name: str = "x") -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Accept a bf16 [T, H] tensor or an (fp8 [T, H], scales [T, S]) tuple; scales float32, or int32 (packed
    UE8M0 words, as DeepEP takes them), in any layout (DeepGEMM's column-major one included)."""
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise ValueError(f"{name} as a tuple must be (fp8 tensor, float32 or int32 scales), got {len(x)} items")
        data, scales = x
        check_tensor(f"{name}[0]", data, (FP8_DTYPE,), 2, device)
        check_tensor(f"{name}[1]", scales, (torch.float32, torch.int32), 2, device, (data.size(0), None))
        if scales.size(1) < 1:
            raise ValueError(f"{name}[1] must have at least one scale per token")
        check_row_bytes(f"{name}[0]", data)
        # Scales keep their layout (the intranode kernels read any positive strides, DeepGEMM's column-major
        # ones included, without a copy); a broadcast one (stride 0) is made whole.
        return data.contiguous(), scales if min(scales.stride()) > 0 else scales.contiguous()
    check_tensor(name, x, (torch.bfloat16,), 2, device)
    check_row_bytes(name, x)
    return x.contiguous(), None


def unpack_bias(bias, num_tokens: int, hidden: int, device: torch.device
                ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """`bias` is None, one tensor, or a tuple of two, each [T, H] bf16."""
    if bias is None:
        return None, None
    items = bias if isinstance(bias, (tuple, list)) else (bias,)
    if len(items) > 2:
        raise ValueError(f"bias must be one tensor or a tuple of two, got {len(items)}")
    checked = []
    for i, item in enumerate(items):
        if item is None:
            checked.append(None)
            continue
        check_tensor(f"bias[{i}]", item, (torch.bfloat16,), 2, device, (num_tokens, hidden))
        checked.append(item.contiguous())
    checked += [None] * (2 - len(checked))
    return checked[0], checked[1]


def flatten_tensors(values: Iterable) -> list:
    out = []
    for value in values:
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (tuple, list)):
            out.extend(flatten_tensors(value))
    return out
