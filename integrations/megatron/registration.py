"""`register()`: make `moe_token_dispatcher_type="ep_plugin"` a Megatron-Core dispatcher type.

Three patches, each reversible (`unregister()`) and checked against the installed release first:

1. `TransformerConfig.__post_init__`: a config with type "ep_plugin" is validated as "alltoall" would
   be (the checks that list dispatcher types: shared-expert overlap, EP communication overlap,
   router padding, variable sequence lengths), then keeps "ep_plugin".
2. `MoELayer.__init__`: for type "ep_plugin", Megatron's dispatcher selection builds an
   `EpPluginTokenDispatcher`. NOTE: during that constructor only, `config.moe_token_dispatcher_type`
   reads "alltoall" and moe_layer's `MoEAlltoAllTokenDispatcher` name points to our class; both are
   restored before it returns (model construction is single-threaded in Megatron).
3. Megatron-LM's argument parser, as soon as `megatron.training.arguments` is imported (cli.py).
"""
from __future__ import annotations

import functools
import threading
from typing import Any, Dict, List, Optional

from . import _compat, buffers, cli
from .dispatcher import DISPATCHER_TYPE, EpPluginTokenDispatcher

# The built-in type whose config checks and constructor slot "ep_plugin" borrows.
VALIDATE_AS = "alltoall"

_UNSET = object()
_lock = threading.RLock()
_originals: Dict[str, Any] = {}


def is_registered() -> bool:
    """Whether `register()` is in effect."""
    return bool(_originals)


# Per-layer CUDA graph regions that leave the dispatch outside the graph (Megatron's CudaGraphModule names).
GRAPHABLE_WITHOUT_DISPATCH = frozenset({"attn", "mlp", "moe_router", "mamba"})


def _graph_modules(config) -> Optional[List[str]]:
    """Names of the per-layer CUDA graph regions (empty: the whole layer), or None without CUDA graphs."""
    impl = getattr(config, "cuda_graph_impl", None)
    if impl is None:  # releases before cuda_graph_impl
        impl = "local" if getattr(config, "enable_cuda_graph", False) else "none"
    if impl == "none":
        return None
    if impl == "full_iteration":
        return []
    modules = getattr(config, "cuda_graph_modules", None)
    if modules is None:
        modules = getattr(config, "cuda_graph_scope", None)
    if modules in (None, "full"):
        return []
    if not isinstance(modules, (list, tuple)):
        modules = [modules]
    return [getattr(module, "name", str(module)) for module in modules]


def refuse_unsupported(config) -> None:
    """Raise ValueError for the Megatron features that branch on the dispatcher type and that ep_plugin does
    not serve (docs/megatron.md lists every such branch)."""
    if getattr(config, "overlap_moe_expert_parallel_comm", False):
        raise ValueError(f"moe_token_dispatcher_type='{DISPATCHER_TYPE}' does not support "
                         "overlap_moe_expert_parallel_comm=True (Megatron's 1F1B expert-parallel overlap schedules "
                         "the dispatcher's steps as separate nodes and frees their inputs by dispatcher type); use "
                         "moe_shared_expert_overlap, or the alltoall / flex dispatcher for this overlap")
    modules = _graph_modules(config)
    if modules is not None and not (modules and set(modules) <= GRAPHABLE_WITHOUT_DISPATCH):
        covered = ", ".join(modules) if modules else "the whole layer"
        raise ValueError(f"moe_token_dispatcher_type='{DISPATCHER_TYPE}' cannot run inside a CUDA graph "
                         f"(cuda_graph_impl={getattr(config, 'cuda_graph_impl', None)!r} capturing {covered}): its "
                         "dispatch waits on the host for the received-token count. Set cuda_graph_modules to "
                         f"regions without the dispatch ({', '.join(sorted(GRAPHABLE_WITHOUT_DISPATCH))}) or "
                         "cuda_graph_impl='none'")


def _patched_post_init(original):
    @functools.wraps(original)
    def __post_init__(self, *args, **kwargs):
        if getattr(self, "moe_token_dispatcher_type", None) != DISPATCHER_TYPE:
            return original(self, *args, **kwargs)
        self.moe_token_dispatcher_type = VALIDATE_AS
        try:
            result = original(self, *args, **kwargs)
            refuse_unsupported(self)
            return result
        except Exception as error:
            if hasattr(error, "add_note"):  # Python 3.11+
                error.add_note(f"(moe_token_dispatcher_type='{DISPATCHER_TYPE}' is validated like '{VALIDATE_AS}')")
            raise
        finally:
            self.moe_token_dispatcher_type = DISPATCHER_TYPE

    __post_init__._ep_plugin_original = original
    return __post_init__


def _patched_moe_layer_init(original, moe_layer_module):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        config = args[0] if args else kwargs.get("config")
        if getattr(config, "moe_token_dispatcher_type", None) != DISPATCHER_TYPE:
            return original(self, *args, **kwargs)
        builtin = moe_layer_module.MoEAlltoAllTokenDispatcher
        with _lock:
            config.moe_token_dispatcher_type = VALIDATE_AS
            moe_layer_module.MoEAlltoAllTokenDispatcher = EpPluginTokenDispatcher
            try:
                original(self, *args, **kwargs)
            finally:
                moe_layer_module.MoEAlltoAllTokenDispatcher = builtin
                config.moe_token_dispatcher_type = DISPATCHER_TYPE
        dispatcher = getattr(self, "token_dispatcher", None)
        if not isinstance(dispatcher, EpPluginTokenDispatcher):
            raise _compat.MegatronVersionError(
                f"MoELayer built a {type(dispatcher).__name__} for moe_token_dispatcher_type='{DISPATCHER_TYPE}': "
                f"megatron-core {_compat.megatron_version()} selects dispatchers differently than ep_plugin expects")

    __init__._ep_plugin_original = original
    return __init__


def register(config: Any = _UNSET) -> None:
    """Make `TransformerConfig(moe_token_dispatcher_type="ep_plugin")` valid and MoELayer build
    `EpPluginTokenDispatcher`; add the Megatron-LM flags when Megatron-LM is importable. Idempotent.

    Arguments:
        config: ep_plugin's config for the dispatcher's buffers: a YAML path, a mapping or an
            `EpConfig`; it takes precedence over `--ep-plugin-config` and `$EP_PLUGIN_CONFIG`.
            `None` clears an earlier `register(config=...)`; omitted keeps it.

    Raises `MegatronVersionError` for a megatron-core release outside 0.16-0.19 or whose patched
    symbols changed.
    """
    if config is not _UNSET:
        buffers.set_explicit_config(config)
    with _lock:
        if _originals:
            return
        _compat.check_version()
        _compat.check_surface()
        from megatron.core.transformer.moe import moe_layer
        from megatron.core.transformer.transformer_config import TransformerConfig

        post_init = TransformerConfig.__post_init__
        layer_init = moe_layer.MoELayer.__init__
        TransformerConfig.__post_init__ = _patched_post_init(post_init)
        moe_layer.MoELayer.__init__ = _patched_moe_layer_init(layer_init, moe_layer)
        _originals["post_init"] = post_init
        _originals["moe_layer_init"] = layer_init
        try:
            cli.patch_megatron_lm_arguments()
        except Exception:
            _restore()
            raise


def _restore() -> None:
    from megatron.core.transformer.moe import moe_layer
    from megatron.core.transformer.transformer_config import TransformerConfig

    if "post_init" in _originals:
        TransformerConfig.__post_init__ = _originals.pop("post_init")
    if "moe_layer_init" in _originals:
        moe_layer.MoELayer.__init__ = _originals.pop("moe_layer_init")
    cli.unpatch_megatron_lm_arguments()


def unregister() -> None:
    """Undo `register()` (configs and layers built meanwhile keep working) and drop cached buffers."""
    with _lock:
        _restore()
        buffers.set_explicit_config(None)
        buffers.clear_buffers()
