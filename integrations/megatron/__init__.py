"""Megatron-Core integration: `--moe-token-dispatcher-type ep_plugin`.

Importing this package registers the dispatcher type (see `register`):

    import ep_plugin.integrations.megatron            # or: ...megatron.register(config="ep.yaml")
    config = TransformerConfig(..., moe_token_dispatcher_type="ep_plugin")
    layer = MoELayer(config, submodules)               # layer.token_dispatcher: EpPluginTokenDispatcher

Megatron-LM scripts run unmodified through the launcher, which registers and then runs the script:

    torchrun ... -m ep_plugin.integrations.megatron pretrain_gpt.py ... \
        --moe-token-dispatcher-type ep_plugin --ep-plugin-config normal.yaml

Supported: megatron-core 0.16 to 0.19 (checked at import; an unknown release raises
`MegatronVersionError`). docs/megatron.md has the details.
"""
from ._compat import MegatronVersionError, megatron_version

try:
    import megatron.core  # noqa: F401
except Exception as _error:  # noqa: BLE001 - an optional dependency of Megatron may fail with anything
    raise ImportError(f"ep_plugin.integrations.megatron needs megatron-core 0.16 to 0.19, and importing it failed: "
                      f"{type(_error).__name__}: {_error} (see docs/megatron.md)") from _error

from .buffers import clear_buffers, resolve_config  # noqa: E402
from .cli import add_ep_plugin_args  # noqa: E402
from .dispatcher import DISPATCHER_TYPE, EpPluginTokenDispatcher  # noqa: E402
from .registration import is_registered, register, unregister  # noqa: E402

register()

__all__ = ["DISPATCHER_TYPE", "EpPluginTokenDispatcher", "MegatronVersionError", "add_ep_plugin_args",
           "clear_buffers", "is_registered", "megatron_version", "register", "resolve_config", "unregister"]
