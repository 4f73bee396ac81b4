"""What differs between the supported megatron-core releases, in one place.

Supported: megatron-core 0.16.x to 0.19.x. `check_version` and `check_surface` run at registration:
an unknown release or a missing symbol raises `MegatronVersionError` naming what was expected,
instead of failing later inside a training step.

Differences handled here:
    - `moe_utils.permute` returns 3 values in 0.16 and 5 from 0.17 on (pad offsets and padded
      tokens per expert, with `tokens_per_expert` / `align_size` arguments for TransformerEngine's
      fused permute-and-pad); `unpermute` takes `pad_offsets` from 0.17 on.
    - `MoETokenDispatcher.__init__` sets `ep_rank` from 0.18 on (the dispatcher sets it itself).
    - `SharedExpertMLP.wait_current_stream` exists from 0.18 on; before, `pre_forward_comm` waits.
    - MoE module specs are `ModuleSpec`s up to 0.17 and `functools.partial`s from 0.18 on (only the
      tests build specs; `MoELayer.__init__(config, submodules, ...)` is the same in every release).
    - Megatron-LM's `--moe-token-dispatcher-type` is an explicit argparse option up to 0.16 and is
      generated from `TransformerConfig`'s `Literal` annotation from 0.17 on (see cli.py).
"""
from __future__ import annotations

import functools
import inspect
from typing import Optional

import torch

from .._release import Release, SupportedReleases, UnsupportedRelease


class MegatronVersionError(UnsupportedRelease):
    """megatron-core is missing, outside the supported range, or lacks a symbol the patches need."""


RELEASES = SupportedReleases("megatron-core", minimum=(0, 16), maximum=(0, 19),
                             allow_untested_env="EP_PLUGIN_MEGATRON_ALLOW_UNTESTED", error=MegatronVersionError)
PATCH_SURFACE = "TransformerConfig.__post_init__, MoELayer.__init__, moe_utils.permute"

_DISPATCHER_METHODS = ("dispatch_preprocess", "token_dispatch", "dispatch_postprocess", "combine_preprocess",
                       "token_combine", "combine_postprocess", "set_shared_experts")


def megatron_version() -> str:
    """The version of the imported `megatron.core` (its `package_info`, which travels with the code, so a
    Megatron-LM source tree ahead on `sys.path` reports its own version, not the installed wheel's)."""
    try:
        from megatron.core import package_info
    except ImportError as error:
        raise MegatronVersionError(f"megatron.core is not importable ({error}); ep_plugin's Megatron integration "
                                   f"needs megatron-core {RELEASES.describe()} (see docs/megatron.md)") from None
    return str(package_info.__version__)


def check_version(text: Optional[str] = None) -> Release:
    """The release of `text` (default: the imported megatron.core); raises `MegatronVersionError` outside
    `RELEASES` unless EP_PLUGIN_MEGATRON_ALLOW_UNTESTED=1."""
    return RELEASES.check(megatron_version() if text is None else text, PATCH_SURFACE)


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise MegatronVersionError(f"megatron-core {megatron_version()}: {what}; ep_plugin's Megatron patches do not "
                                   f"know this layout (see integrations/megatron/_compat.py)")


def check_surface() -> None:
    """Check every Megatron symbol and signature the integration relies on."""
    from megatron.core.transformer import transformer_config
    from megatron.core.transformer.moe import moe_layer, moe_utils, token_dispatcher

    base = getattr(token_dispatcher, "MoETokenDispatcher", None)
    _require(base is not None, "megatron.core.transformer.moe.token_dispatcher.MoETokenDispatcher is missing")
    for name in _DISPATCHER_METHODS:
        _require(callable(getattr(base, name, None)), f"MoETokenDispatcher.{name} is missing")
    init_params = list(inspect.signature(base.__init__).parameters)
    _require(init_params[1:3] == ["config", "pg_collection"],
             f"MoETokenDispatcher.__init__ takes {init_params[1:]}, expected (config, pg_collection)")

    _require(hasattr(moe_layer, "MoEAlltoAllTokenDispatcher"), "moe_layer no longer imports MoEAlltoAllTokenDispatcher")
    source = inspect.getsource(moe_layer.MoELayer.__init__)
    _require("moe_token_dispatcher_type" in source and "MoEAlltoAllTokenDispatcher(" in source,
             "MoELayer.__init__ no longer selects its dispatcher from config.moe_token_dispatcher_type")

    config_cls = transformer_config.TransformerConfig
    fields = getattr(config_cls, "__dataclass_fields__", {})
    for name in ("moe_token_dispatcher_type", "moe_router_padding_for_quantization", "moe_permute_fusion",
                 "moe_pad_expert_input_to_capacity", "moe_shared_expert_overlap"):
        _require(name in fields, f"TransformerConfig has no {name} field")
    _require(callable(getattr(config_cls, "__post_init__", None)), "TransformerConfig has no __post_init__")

    for name in ("permute", "unpermute", "pad_routing_map", "get_align_size_for_quantization",
                 "get_default_pg_collection"):
        _require(callable(getattr(moe_utils, name, None)), f"moe_utils.{name} is missing")
    params = inspect.signature(moe_utils.permute).parameters
    for name in ("tokens", "routing_map", "probs", "num_out_tokens", "fused"):
        _require(name in params, f"moe_utils.permute has no '{name}' argument")


# ---- permutation ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _params(function) -> frozenset:
    return frozenset(inspect.signature(function).parameters)


def permute(tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor, num_out_tokens: int,
            fused: bool, tokens_per_expert: torch.Tensor, align_size: int):
    """Megatron's `moe_utils.permute` with the 0.17+ return convention on every release.

    Arguments:
        tokens: `[N, H]`; routing_map: `[N, E_local]` bool; probs: `[N, E_local]` float32.
        num_out_tokens: rows of the output (host int, the sum of `tokens_per_expert`).
        fused: TransformerEngine's fused kernels (Megatron's `moe_permute_fusion`).
        tokens_per_expert: `[E_local]` int64 on the host.
        align_size: per-expert alignment for TE's fused permute-and-pad (0: none; ignored on 0.16).

    Returns:
        permuted `[M, H]` (rows grouped by expert, in row order within an expert), permuted probs `[M]`,
        the mapping for `unpermute`, pad offsets or None, tokens per expert after any padding.
    """
    from megatron.core.transformer.moe import moe_utils
    accepted = _params(moe_utils.permute)
    kwargs = dict(probs=probs, num_out_tokens=num_out_tokens, fused=fused)
    if "tokens_per_expert" in accepted:
        kwargs["tokens_per_expert"] = tokens_per_expert
    if "align_size" in accepted and align_size > 0:
        kwargs["align_size"] = align_size
    result = moe_utils.permute(tokens, routing_map, **kwargs)
    if len(result) == 3:  # 0.16
        permuted, permuted_probs, mapping = result
        return permuted, permuted_probs, mapping, None, tokens_per_expert
    permuted, permuted_probs, mapping, pad_offsets, padded_tokens_per_expert = result
    if padded_tokens_per_expert is None:
        padded_tokens_per_expert = tokens_per_expert
    return permuted, permuted_probs, mapping, pad_offsets, padded_tokens_per_expert


def unpermute(permuted: torch.Tensor, mapping: torch.Tensor, restore_shape: torch.Size, routing_map: torch.Tensor,
              fused: bool, pad_offsets: Optional[torch.Tensor]) -> torch.Tensor:
    """Megatron's `moe_utils.unpermute` without probs (the experts applied them): rows summed back into `[N, H]`."""
    from megatron.core.transformer.moe import moe_utils
    kwargs = dict(restore_shape=restore_shape, routing_map=routing_map, fused=fused)
    if "pad_offsets" in _params(moe_utils.unpermute):
        kwargs["pad_offsets"] = pad_offsets
    elif pad_offsets is not None:
        raise MegatronVersionError("permute returned pad offsets but unpermute cannot take them")
    return moe_utils.unpermute(permuted, mapping, **kwargs)


# ---- shared experts --------------------------------------------------------------------------------
def shared_experts_wait(shared_experts) -> None:
    """Let the shared experts' stream wait for the current one where the release does so (0.18+)."""
    wait = getattr(shared_experts, "wait_current_stream", None)
    if wait is not None:
        wait()
