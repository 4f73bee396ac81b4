"""Megatron-LM command line: `--moe-token-dispatcher-type ep_plugin` and `--ep-plugin-config FILE`.

Megatron-LM (megatron/training/arguments.py, shipped beside megatron-core from 0.17 on) builds its
parser in `add_megatron_arguments`; 0.17+ generates `--moe-token-dispatcher-type` from
TransformerConfig's `Literal` annotation, older trees declare it in `_add_moe_args`. `register()`
wraps whichever of the two the tree has, so every parser it builds accepts `ep_plugin` and
`--ep-plugin-config`. The wrap happens as soon as `megatron.training.arguments` is imported (an
import hook; nothing of Megatron-LM is imported early). Scripts that build their own parser, or want
no patching, pass `add_ep_plugin_args` as `extra_args_provider`.
"""
from __future__ import annotations

import argparse
import importlib.abc
import logging
import sys
import threading
from typing import Callable, Dict, Optional

from . import buffers
from ._compat import MegatronVersionError

logger = logging.getLogger("ep_plugin.megatron")

DISPATCHER_FLAG = "--moe-token-dispatcher-type"
CONFIG_FLAG = "--ep-plugin-config"
DISPATCHER_CHOICE = "ep_plugin"
ARGUMENTS_MODULE = "megatron.training.arguments"

# Megatron-LM functions that build the parser; the first one the module has is wrapped.
_PARSER_HOOKS = ("add_megatron_arguments", "_add_moe_args")

_lock = threading.RLock()
_patched: Dict[str, Callable] = {}   # name -> Megatron-LM's original function
_finder: Optional["_ArgumentsImportHook"] = None


class _ConfigPathAction(argparse.Action):
    """Stores the path and tells the dispatcher's buffer factory about it."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        buffers.set_cli_config_path(values)


def add_ep_plugin_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add `ep_plugin` to `--moe-token-dispatcher-type`'s choices (when the parser has that option) and
    add `--ep-plugin-config FILE`. Idempotent. Returns the parser (Megatron-LM's `extra_args_provider`
    contract), so `pretrain(..., extra_args_provider=add_ep_plugin_args)` works.
    """
    actions = parser._option_string_actions  # noqa: SLF001 - argparse keeps no public index of options
    dispatcher = actions.get(DISPATCHER_FLAG)
    if dispatcher is not None and dispatcher.choices is not None and DISPATCHER_CHOICE not in dispatcher.choices:
        dispatcher.choices = [*dispatcher.choices, DISPATCHER_CHOICE]
        if dispatcher.help:
            dispatcher.help = f"{dispatcher.help} 'ep_plugin': ep_plugin.Buffer (see {CONFIG_FLAG})."
    if CONFIG_FLAG not in actions:
        group = parser.add_argument_group(title="ep_plugin")
        group.add_argument(CONFIG_FLAG, type=str, default=None, metavar="FILE", action=_ConfigPathAction,
                           help=f"ep_plugin YAML config used by {DISPATCHER_FLAG} {DISPATCHER_CHOICE} "
                                "(default: $EP_PLUGIN_CONFIG, else ep_plugin's defaults).")
    return parser


def _wrap(hook: Callable, name: str) -> Callable:
    def wrapper(parser, *args, **kwargs):
        parser = hook(parser, *args, **kwargs)
        if name == "add_megatron_arguments" and DISPATCHER_FLAG not in parser._option_string_actions:  # noqa: SLF001
            raise MegatronVersionError(f"Megatron-LM's {name} no longer adds {DISPATCHER_FLAG}; ep_plugin cannot add "
                                       f"its choice (see integrations/megatron/cli.py)")
        return add_ep_plugin_args(parser)

    wrapper.__wrapped__ = hook
    wrapper.__name__ = getattr(hook, "__name__", name)
    wrapper.__doc__ = getattr(hook, "__doc__", None)
    wrapper._ep_plugin_wrapper = True
    return wrapper


def _patch_module(arguments) -> str:
    """Wrap the parser builder of an imported `megatron.training.arguments`; returns its name."""
    with _lock:
        for name in _PARSER_HOOKS:
            hook = getattr(arguments, name, None)
            if callable(hook):
                if not getattr(hook, "_ep_plugin_wrapper", False):
                    _patched[name] = hook
                    setattr(arguments, name, _wrap(hook, name))
                return name
    raise MegatronVersionError(f"{ARGUMENTS_MODULE} has none of {_PARSER_HOOKS}; ep_plugin cannot add "
                               f"{DISPATCHER_FLAG} {DISPATCHER_CHOICE} (pass add_ep_plugin_args as extra_args_provider)")


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader, then wraps the parser builder; everything else is the real loader's."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        if _finder is not None:  # still registered
            _patch_module(module)

    def __getattr__(self, name):  # get_source, get_filename, ... for inspect and tracebacks
        return getattr(self._inner, name)


class _ArgumentsImportHook(importlib.abc.MetaPathFinder):
    """Finds `megatron.training.arguments` through the other finders and hands back a patching loader."""

    def find_spec(self, fullname, path, target=None):
        if fullname != ARGUMENTS_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


def patch_megatron_lm_arguments() -> Optional[str]:
    """Make Megatron-LM's parser accept the flags: now if `megatron.training.arguments` is imported,
    else when it is. Returns the wrapped function's name, or None when the wrap is deferred.
    Raises `MegatronVersionError` when the module has none of the known parser builders."""
    global _finder
    with _lock:
        module = sys.modules.get(ARGUMENTS_MODULE)
        if module is not None:
            return _patch_module(module)
        if _finder is None:
            _finder = _ArgumentsImportHook()
            sys.meta_path.insert(0, _finder)
        logger.debug("ep_plugin: %s will be patched when imported", ARGUMENTS_MODULE)
        return None


def unpatch_megatron_lm_arguments() -> None:
    """Undo `patch_megatron_lm_arguments` (and drop the import hook)."""
    global _finder
    with _lock:
        if _finder is not None:
            if _finder in sys.meta_path:
                sys.meta_path.remove(_finder)
            _finder = None
        module = sys.modules.get(ARGUMENTS_MODULE)
        if module is not None:
            for name, hook in _patched.items():
                setattr(module, name, hook)
        _patched.clear()
