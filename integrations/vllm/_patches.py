"""Everything ep_plugin changes inside vLLM, in one place, checked against the installed release.

Supported: vLLM 0.33.x. `apply()` first checks the version (an unknown release raises
`VllmVersionError` unless `EP_PLUGIN_VLLM_ALLOW_UNTESTED=1`), then checks that every symbol it
touches is where 0.33 keeps it, then patches:

    1. `ParallelConfig.all2all_backend`: its `Literal` gains "ep_plugin" (pydantic validation and
       the `--all2all-backend` CLI choices both read it); `use_sequence_parallel_moe` counts the
       backend like DeepEP's (TP ranks split their tokens instead of dispatching duplicates).
    2. `CudaCommunicator` / `CpuCommunicator.__init__`: the EP group's communicator gets
       `EpPluginAll2AllManager` (0.33 raises "Unknown all2all backend" for names it lacks).
    3. `FusedMoEParallelConfig.use_batched_activation_format`: true in low-latency mode, so the
       kernel oracles pick batched experts, as they do for DeepEP low-latency.
    4. `all2all_utils.maybe_make_prepare_finalize`: returns `EpPluginPrepareFinalizeFactory.create(...)`
       for the backend. Where vLLM has the prepare/finalize factory registry
       (`register_moe_prepare_finalize_factory`, vLLM PR 50556), the factory is registered there
       instead and patches 1 and 4 are not needed (the registry accepts the name itself).
    5. `CompilationConfig.set_splitting_ops_for_v1`: in normal mode, CUDA graphs are turned off (with
       an info line), as vLLM does for DeepEP's high-throughput backend, whose dispatch likewise
       waits on the host for the received-token count. Low-latency mode keeps CUDA graphs.

Nothing else of vLLM is modified; every patch defers to the original for other backends.
"""
from __future__ import annotations

import functools
import os
import sys
import typing
import warnings
from typing import Any, Callable, Tuple

from .._release import parse_release

BACKEND_NAME = "ep_plugin"
# Inclusive range of (major, minor) releases this module was written and tested against.
SUPPORTED_MIN = (0, 33)
SUPPORTED_MAX = (0, 33)
# Set to 1 to try an unlisted vLLM release (the structural checks still run).
ALLOW_UNTESTED_ENV = "EP_PLUGIN_VLLM_ALLOW_UNTESTED"

_applied = False


class VllmVersionError(RuntimeError):
    """vLLM is missing, outside the supported range, or lacks a symbol the patches need."""


def vllm_version() -> str:
    """The installed vLLM version string."""
    try:
        import vllm
    except Exception as error:  # noqa: BLE001 - vLLM's optional dependencies fail with anything
        raise VllmVersionError(f"importing vllm failed ({type(error).__name__}: {error}); ep_plugin's vLLM "
                               "integration needs vLLM 0.33 (see docs/vllm.md)") from error
    return str(vllm.__version__)


def parse_version(text: str) -> Tuple[int, int, int]:
    """'0.33.1+cu130' -> (0, 33, 1); see `parse_release`."""
    release = parse_release(text)
    if release is None:
        raise VllmVersionError(f"cannot parse the vLLM version {text!r}")
    return release


def check_version(text: str | None = None) -> Tuple[int, int, int]:
    """Raise `VllmVersionError` unless the release (default: the installed one) is supported."""
    text = vllm_version() if text is None else text
    parsed = parse_version(text)
    if not SUPPORTED_MIN <= parsed[:2] <= SUPPORTED_MAX:
        lo, hi = ".".join(map(str, SUPPORTED_MIN)), ".".join(map(str, SUPPORTED_MAX))
        message = (f"ep_plugin's vLLM integration supports vLLM {lo}.x to {hi}.x, found {text}: its patch surface "
                   "(ParallelConfig.all2all_backend, the EP communicator's all2all manager, "
                   "maybe_make_prepare_finalize) has not been checked against this release.")
        if os.environ.get(ALLOW_UNTESTED_ENV) != "1":
            raise VllmVersionError(message + f" Set {ALLOW_UNTESTED_ENV}=1 to try anyway.")
        warnings.warn(message + f" Continuing because {ALLOW_UNTESTED_ENV}=1.", RuntimeWarning, stacklevel=3)
    return parsed


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise VllmVersionError(f"vLLM {vllm_version()}: {what}; ep_plugin's vLLM patches do not know this layout "
                               "(see integrations/vllm/_patches.py)")


def has_factory_registry() -> bool:
    """Whether vLLM has the out-of-tree prepare/finalize factory registry (proposed in PR 50556)."""
    from vllm.model_executor.layers.fused_moe import all2all_utils
    return callable(getattr(all2all_utils, "register_moe_prepare_finalize_factory", None))


def check_surface() -> None:
    """Check every vLLM symbol the patches touch, before touching any."""
    from vllm.config import ParallelConfig
    from vllm.distributed.device_communicators import cpu_communicator, cuda_communicator
    from vllm.engine import arg_utils
    from vllm.model_executor.layers.fused_moe import all2all_utils, config, modular_kernel

    fields = getattr(ParallelConfig, "__dataclass_fields__", {})
    _require("all2all_backend" in fields, "ParallelConfig has no all2all_backend field")
    _require(typing.get_origin(fields["all2all_backend"].type) is typing.Literal,
             "ParallelConfig.all2all_backend is not a Literal")
    _require(isinstance(getattr(ParallelConfig, "use_sequence_parallel_moe", None), property),
             "ParallelConfig.use_sequence_parallel_moe is not a property")
    _require(hasattr(getattr(arg_utils, "_compute_kwargs", None), "cache_clear"),
             "engine.arg_utils._compute_kwargs (the cached CLI kwargs) is missing")
    for module, name in ((cuda_communicator, "CudaCommunicator"), (cpu_communicator, "CpuCommunicator")):
        cls = getattr(module, name, None)
        _require(cls is not None, f"{module.__name__}.{name} is missing")
    parallel = getattr(config, "FusedMoEParallelConfig", None)
    _require(parallel is not None and isinstance(getattr(parallel, "use_batched_activation_format", None),
                                                 property),
             "FusedMoEParallelConfig.use_batched_activation_format is not a property")
    _require(callable(getattr(all2all_utils, "maybe_make_prepare_finalize", None)),
             "fused_moe.all2all_utils.maybe_make_prepare_finalize is missing")
    _require(callable(getattr(all2all_utils, "get_ep_all2all_manager", None)),
             "fused_moe.all2all_utils.get_ep_all2all_manager is missing")
    for name in ("FusedMoEPrepareAndFinalizeModular", "FusedMoEActivationFormat", "ExpertTokensMetadata"):
        _require(hasattr(modular_kernel, name), f"fused_moe.modular_kernel.{name} is missing")
    from vllm.config.compilation import CompilationConfig, CUDAGraphMode
    _require(callable(getattr(CompilationConfig, "set_splitting_ops_for_v1", None)) and hasattr(CUDAGraphMode, "NONE"),
             "CompilationConfig.set_splitting_ops_for_v1 or CUDAGraphMode.NONE is missing")


def apply() -> None:
    """Check the installed vLLM and patch it (idempotent; every process calls it via `register()`)."""
    global _applied
    if _applied:
        return
    check_version()
    check_surface()
    if has_factory_registry():
        _register_factory()
    else:
        _accept_backend_name()
        _route_prepare_finalize()
    _give_communicators_our_manager()
    _batched_format_in_low_latency_mode()
    _no_cuda_graphs_in_normal_mode()
    _applied = True


# ---- 1. the backend name ------------------------------------------------------------------------
def _accept_backend_name() -> None:
    from pydantic.dataclasses import rebuild_dataclass
    from vllm.config import ParallelConfig
    from vllm.engine import arg_utils

    field = ParallelConfig.__dataclass_fields__["all2all_backend"]
    choices = typing.get_args(field.type)
    if BACKEND_NAME not in choices:
        extended = typing.Literal[(*choices, BACKEND_NAME)]  # type: ignore[valid-type]
        field.type = extended
        ParallelConfig.__annotations__["all2all_backend"] = extended
        rebuild_dataclass(ParallelConfig, force=True)
        # The CLI builds its choices from the field type once and caches them.
        arg_utils._compute_kwargs.cache_clear()

    original = ParallelConfig.use_sequence_parallel_moe.fget
    if getattr(original, "_ep_plugin", False):
        return

    @functools.wraps(original)
    def use_sequence_parallel_moe(self) -> bool:
        if self.all2all_backend == BACKEND_NAME:
            return (self.enable_expert_parallel and self.tensor_parallel_size > 1
                    and self.data_parallel_size > 1)
        return original(self)

    use_sequence_parallel_moe._ep_plugin = True  # type: ignore[attr-defined]
    ParallelConfig.use_sequence_parallel_moe = property(use_sequence_parallel_moe)


# ---- 2. the all2all manager ---------------------------------------------------------------------
def _configured_backend() -> str | None:
    from vllm.config import get_current_vllm_config_or_none
    config = get_current_vllm_config_or_none()
    return None if config is None else config.parallel_config.all2all_backend


def _with_our_manager(original_init: Callable) -> Callable:
    """Wrap a device communicator's __init__: for our backend, build it without vLLM's manager, then add ours."""

    @functools.wraps(original_init)
    def __init__(self, cpu_group, *args: Any, use_all2all: bool = False, **kwargs: Any) -> None:
        if _configured_backend() != BACKEND_NAME:
            original_init(self, cpu_group, *args, use_all2all=use_all2all, **kwargs)
            return
        original_init(self, cpu_group, *args, use_all2all=False, **kwargs)
        self.use_all2all = self.is_ep_communicator and use_all2all
        if self.use_all2all:
            from .manager import EpPluginAll2AllManager
            self.all2all_manager = EpPluginAll2AllManager(self.cpu_group, kwargs.get("tcp_store_group"),
                                                          device_group=self.device_group)

    __init__._ep_plugin = True  # type: ignore[attr-defined]
    return __init__


def _give_communicators_our_manager() -> None:
    from vllm.distributed.device_communicators import cpu_communicator, cuda_communicator

    for cls in (cuda_communicator.CudaCommunicator, cpu_communicator.CpuCommunicator):
        if not getattr(cls.__init__, "_ep_plugin", False):
            cls.__init__ = _with_our_manager(cls.__init__)


# ---- 3. the activation format -------------------------------------------------------------------
def _batched_format_in_low_latency_mode() -> None:
    from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig

    original = FusedMoEParallelConfig.use_batched_activation_format.fget
    if getattr(original, "_ep_plugin", False):
        return

    @functools.wraps(original)
    def use_batched_activation_format(self) -> bool:
        if self.all2all_backend == BACKEND_NAME:
            from .prepare_finalize import serving_config
            return self.use_all2all_kernels and serving_config().mode == "low_latency"
        return original(self)

    use_batched_activation_format._ep_plugin = True  # type: ignore[attr-defined]
    FusedMoEParallelConfig.use_batched_activation_format = property(use_batched_activation_format)


# ---- 4. the prepare/finalize object -------------------------------------------------------------
def _register_factory() -> None:
    from vllm.model_executor.layers.fused_moe import all2all_utils
    from vllm.model_executor.layers.fused_moe.prepare_finalize import MoEPrepareFinalizeFactory

    from .prepare_finalize import EpPluginPrepareFinalizeFactory

    registered = type("EpPluginRegisteredFactory", (EpPluginPrepareFinalizeFactory, MoEPrepareFinalizeFactory), {})
    all2all_utils.register_moe_prepare_finalize_factory(registered)


def _route_prepare_finalize() -> None:
    from vllm.model_executor.layers.fused_moe import all2all_utils

    original = all2all_utils.maybe_make_prepare_finalize
    if getattr(original, "_ep_plugin", False):
        return

    @functools.wraps(original)
    def maybe_make_prepare_finalize(moe, quant_config, routing_tables=None, allow_new_interface=False,
                                    use_monolithic=False, all2all_manager=None, **kwargs: Any):
        parallel = moe.moe_parallel_config
        if parallel.all2all_backend != BACKEND_NAME or not parallel.use_all2all_kernels:
            return original(moe, quant_config, routing_tables=routing_tables,
                            allow_new_interface=allow_new_interface, use_monolithic=use_monolithic,
                            all2all_manager=all2all_manager, **kwargs)
        from .prepare_finalize import EpPluginPrepareFinalizeFactory
        return EpPluginPrepareFinalizeFactory.create(
            moe=moe, quant_config=quant_config, routing_tables=routing_tables,
            allow_new_interface=allow_new_interface, use_monolithic=use_monolithic, eep_stage=False,
            all2all_manager=all2all_manager if all2all_manager is not None else all2all_utils.get_ep_all2all_manager())

    maybe_make_prepare_finalize._ep_plugin = True  # type: ignore[attr-defined]
    # NOTE: the oracles import the function by name; rebind it in every module already holding it.
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if isinstance(namespace, dict) and namespace.get("maybe_make_prepare_finalize") is original:
            module.maybe_make_prepare_finalize = maybe_make_prepare_finalize


# ---- 5. CUDA graphs -----------------------------------------------------------------------------
def _no_cuda_graphs_in_normal_mode() -> None:
    from vllm.config.compilation import CompilationConfig, CUDAGraphMode

    original = CompilationConfig.set_splitting_ops_for_v1
    if getattr(original, "_ep_plugin", False):
        return

    @functools.wraps(original)
    def set_splitting_ops_for_v1(self, all2all_backend: str, data_parallel_size: int = 1):
        result = original(self, all2all_backend, data_parallel_size)
        if all2all_backend != BACKEND_NAME or data_parallel_size <= 1 or self.cudagraph_mode == CUDAGraphMode.NONE:
            return result
        from .prepare_finalize import serving_config
        if serving_config().mode == "normal":
            import logging
            logging.getLogger("ep_plugin").info(
                "ep_plugin: disabling CUDA graphs: normal mode (throughput, prefill) waits on the host for the "
                "received-token count; for CUDA graphs in decode set `mode: low_latency` in $EP_PLUGIN_CONFIG")
            self.cudagraph_mode = CUDAGraphMode.NONE
        return result

    set_splitting_ops_for_v1._ep_plugin = True  # type: ignore[attr-defined]
    CompilationConfig.set_splitting_ops_for_v1 = set_splitting_ops_for_v1
