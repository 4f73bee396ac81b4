"""Everything ep_plugin changes inside vLLM, in one place, checked against the imported vLLM first.

Supported: vLLM 0.32.x and 0.33.x whose patched objects are as listed below. `apply()` checks the
release (`RELEASES`), then the objects it touches: their types, signatures, the backend `Literal`'s
names and that vLLM's CLI choices come from it (`check_surface`). Any difference raises
`VllmVersionError` before anything is patched. Then, in this order:

    1. `CudaCommunicator` / `CpuCommunicator.__init__`: the EP group's communicator gets
       `EpPluginAll2AllManager` (vLLM raises "Unknown all2all backend" for names it lacks).
    2. `FusedMoEParallelConfig.use_batched_activation_format`: true in low-latency mode, so the
       kernel oracles pick batched experts, as they do for DeepEP low-latency.
    3. `CompilationConfig.set_splitting_ops_for_v1`: in normal mode, CUDA graphs are turned off (with
       an info line), as vLLM does for DeepEP's high-throughput backend, whose dispatch likewise
       waits on the host for the received-token count. Low-latency mode keeps CUDA graphs.
    4. `all2all_utils.maybe_make_prepare_finalize`: returns `EpPluginPrepareFinalizeFactory.create(...)`
       for the backend. Where vLLM has the prepare/finalize factory registry
       (`register_moe_prepare_finalize_factory`, vLLM PR 50556), the factory is registered there
       instead and patches 4 and 5 are not needed (the registry accepts the name itself).
    5. `ParallelConfig.all2all_backend`: its `Literal` gains "ep_plugin" (pydantic validation and
       the `--all2all-backend` CLI choices both read it), checked afterwards by validating a
       `ParallelConfig` and reading the CLI choices; `use_sequence_parallel_moe` counts the backend
       like DeepEP's (TP ranks split their tokens instead of dispatching duplicates). Last, so that
       the name is never accepted while the patches that serve it are missing.

Nothing else of vLLM is modified; every patch defers to the original for other backends.
"""
from __future__ import annotations

import functools
import inspect
import logging
import sys
import typing
from typing import Any, Callable, List, Tuple

from .._release import Release, SupportedReleases, UnsupportedRelease

BACKEND_NAME = "ep_plugin"
# A child of vLLM's logger: its lines appear in vLLM's log, formatted as vLLM's own.
logger = logging.getLogger("vllm.ep_plugin")


class VllmVersionError(UnsupportedRelease):
    """vLLM is missing, outside the supported range, or its patched objects are not as expected."""


RELEASES = SupportedReleases("vLLM", minimum=(0, 32), maximum=(0, 33),
                             allow_untested_env="EP_PLUGIN_VLLM_ALLOW_UNTESTED", error=VllmVersionError)
PATCH_SURFACE = ("ParallelConfig.all2all_backend, the EP communicators' all2all manager, "
                 "maybe_make_prepare_finalize, FusedMoEParallelConfig, CompilationConfig.set_splitting_ops_for_v1")
# Built-in backend names the Literal must hold (a Literal without them is not the one ep_plugin extends).
BUILTIN_BACKENDS = ("allgather_reducescatter", "deepep_high_throughput", "deepep_low_latency")
# Leading parameters of the patched callables, as the wrappers call them.
COMMUNICATOR_INIT_PARAMS = ("self", "cpu_group")
PREPARE_FINALIZE_PARAMS = ("moe", "quant_config", "routing_tables", "allow_new_interface", "use_monolithic",
                           "all2all_manager")
SPLITTING_OPS_PARAMS = ("self", "all2all_backend", "data_parallel_size")
MANAGER_BASE_PARAMS = ("self", "cpu_group", "tcp_store_group")

_applied = False


def vllm_version() -> str:
    """The version of the imported vLLM (`vllm.__version__`)."""
    try:
        import vllm
    except Exception as error:  # noqa: BLE001 - vLLM's optional dependencies fail with anything
        raise VllmVersionError(f"importing vllm failed ({type(error).__name__}: {error}); ep_plugin's vLLM "
                               f"integration needs vLLM {RELEASES.describe()} (see docs/vllm.md)") from error
    return str(vllm.__version__)


def check_version(text: str | None = None) -> Release:
    """The release of `text` (default: the imported vLLM); raises `VllmVersionError` outside `RELEASES`."""
    return RELEASES.check(vllm_version() if text is None else text, PATCH_SURFACE)


def _params(function: Callable) -> Tuple[str, ...]:
    return tuple(inspect.signature(function).parameters)


def _property_of_self(owner: type, name: str) -> bool:
    prop = owner.__dict__.get(name)
    return isinstance(prop, property) and _params(prop.fget) == ("self",)


def has_factory_registry() -> bool:
    """Whether vLLM has the out-of-tree prepare/finalize factory registry (proposed in PR 50556)."""
    from vllm.model_executor.layers.fused_moe import all2all_utils
    return callable(getattr(all2all_utils, "register_moe_prepare_finalize_factory", None))


def surface_problems() -> List[str]:
    """What differs from the objects the patches expect (empty: all as expected). Patches nothing."""
    from pydantic.dataclasses import rebuild_dataclass
    from vllm.config import ParallelConfig
    from vllm.config.compilation import CompilationConfig, CUDAGraphMode
    from vllm.distributed.device_communicators import base_device_communicator, cpu_communicator, cuda_communicator
    from vllm.engine import arg_utils
    from vllm.model_executor.layers.fused_moe import all2all_utils, config, modular_kernel

    problems: List[str] = []

    def expect(condition: bool, what: str) -> None:
        if not condition:
            problems.append(what)

    def expect_params(function: Any, expected: Tuple[str, ...], name: str) -> None:
        found = _params(function) if callable(function) else None
        expect(found is not None and found[:len(expected)] == expected,
               f"{name} takes {found}, expected {expected} first")

    # 5. the backend name: a Literal that validates, and CLI choices made from it.
    field = getattr(ParallelConfig, "__dataclass_fields__", {}).get("all2all_backend")
    names = typing.get_args(field.type) if field is not None and typing.get_origin(field.type) is typing.Literal \
        else ()
    expect(set(BUILTIN_BACKENDS) <= set(names),
           f"ParallelConfig.all2all_backend is not a Literal holding {BUILTIN_BACKENDS}")
    expect("force" in _params(rebuild_dataclass), "pydantic's rebuild_dataclass has no force argument")
    compute_kwargs = getattr(arg_utils, "_compute_kwargs", None)
    expect(hasattr(compute_kwargs, "cache_clear"), "engine.arg_utils._compute_kwargs (the cached CLI kwargs) is missing")
    if names and hasattr(compute_kwargs, "cache_clear"):
        choices = compute_kwargs(ParallelConfig).get("all2all_backend", {}).get("choices")
        expect(choices is not None and set(choices) == set(names),
               "--all2all-backend's choices are not the names of ParallelConfig.all2all_backend's Literal")
    expect(_property_of_self(ParallelConfig, "use_sequence_parallel_moe"),
           "ParallelConfig.use_sequence_parallel_moe is not a property")
    # 1. the communicators: built with use_all2all, the base class holds is_ep_communicator and the manager.
    for cls in (cuda_communicator.CudaCommunicator, cpu_communicator.CpuCommunicator):
        expect_params(cls.__init__, COMMUNICATOR_INIT_PARAMS, f"{cls.__name__}.__init__")
        expect("use_all2all" in _params(cls.__init__), f"{cls.__name__}.__init__ has no use_all2all argument")
    base_init = inspect.getsource(base_device_communicator.DeviceCommunicatorBase.__init__)
    expect("self.is_ep_communicator" in base_init and "self.all2all_manager" in base_init,
           "DeviceCommunicatorBase.__init__ no longer sets is_ep_communicator and all2all_manager")
    expect_params(base_device_communicator.All2AllManagerBase.__init__, MANAGER_BASE_PARAMS,
                  "All2AllManagerBase.__init__")
    # 2. the activation format.
    parallel = getattr(config, "FusedMoEParallelConfig", None)
    expect(parallel is not None and _property_of_self(parallel, "use_batched_activation_format")
           and _property_of_self(parallel, "use_all2all_kernels")
           and "all2all_backend" in getattr(parallel, "__dataclass_fields__", {}),
           "FusedMoEParallelConfig has no all2all_backend field or use_batched_activation_format / "
           "use_all2all_kernels properties")
    # 3. CUDA graphs.
    expect_params(getattr(CompilationConfig, "set_splitting_ops_for_v1", None), SPLITTING_OPS_PARAMS,
                  "CompilationConfig.set_splitting_ops_for_v1")
    expect(hasattr(CUDAGraphMode, "NONE"), "CUDAGraphMode.NONE is missing")
    # 4. the prepare/finalize object.
    expect_params(getattr(all2all_utils, "maybe_make_prepare_finalize", None), PREPARE_FINALIZE_PARAMS,
                  "fused_moe.all2all_utils.maybe_make_prepare_finalize")
    get_manager = getattr(all2all_utils, "get_ep_all2all_manager", None)
    expect(callable(get_manager) and all(p.default is not inspect.Parameter.empty
                                         for p in inspect.signature(get_manager).parameters.values()),
           "fused_moe.all2all_utils.get_ep_all2all_manager is missing or needs arguments")
    for name in ("FusedMoEPrepareAndFinalizeModular", "FusedMoEActivationFormat", "ExpertTokensMetadata"):
        expect(hasattr(modular_kernel, name), f"fused_moe.modular_kernel.{name} is missing")
    return problems


def check_surface() -> None:
    """Raise `VllmVersionError` listing every patched object that is not as expected."""
    try:
        problems = surface_problems()
    except (ImportError, AttributeError, TypeError, ValueError, OSError) as error:
        problems = [f"{type(error).__name__}: {error}"]
    if problems:
        raise VllmVersionError(f"ep_plugin supports vLLM {RELEASES.describe()} with the objects its patches expect; "
                               f"in vLLM {vllm_version()}: " + "; ".join(problems))


def apply() -> None:
    """Check the imported vLLM, then patch it (idempotent; every vLLM process calls it via `register()`)."""
    global _applied
    if _applied:
        return
    check_version()
    check_surface()
    _give_communicators_our_manager()
    _batched_format_in_low_latency_mode()
    _no_cuda_graphs_in_normal_mode()
    if has_factory_registry():
        _register_factory()
    else:
        _route_prepare_finalize()
        _accept_backend_name()
    _applied = True


# ---- 1. the all2all manager ---------------------------------------------------------------------
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


# ---- 2. the activation format -------------------------------------------------------------------
def _batched_format_in_low_latency_mode() -> None:
    from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig

    original = FusedMoEParallelConfig.use_batched_activation_format.fget
    if getattr(original, "_ep_plugin", False):
        return

    @functools.wraps(original)
    def use_batched_activation_format(self) -> bool:
        if self.all2all_backend == BACKEND_NAME:
            from .manager import serving_config
            return self.use_all2all_kernels and serving_config().mode == "low_latency"
        return original(self)

    use_batched_activation_format._ep_plugin = True  # type: ignore[attr-defined]
    FusedMoEParallelConfig.use_batched_activation_format = property(use_batched_activation_format)


# ---- 3. CUDA graphs -----------------------------------------------------------------------------
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
        from .manager import serving_config
        if serving_config().mode == "normal":
            logger.info(
                "ep_plugin: disabling CUDA graphs: normal mode (throughput, prefill) waits on the host for the "
                "received-token count; for CUDA graphs in decode set `mode: low_latency` in $EP_PLUGIN_CONFIG")
            self.cudagraph_mode = CUDAGraphMode.NONE
        return result

    set_splitting_ops_for_v1._ep_plugin = True  # type: ignore[attr-defined]
    CompilationConfig.set_splitting_ops_for_v1 = set_splitting_ops_for_v1


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


# ---- 5. the backend name ------------------------------------------------------------------------
def _set_backend_names(names: Tuple[str, ...]) -> None:
    """Make ParallelConfig.all2all_backend accept exactly `names` (validation and CLI choices)."""
    from pydantic.dataclasses import rebuild_dataclass
    from vllm.config import ParallelConfig
    from vllm.engine import arg_utils

    literal = typing.Literal[names]  # type: ignore[valid-type]
    ParallelConfig.__dataclass_fields__["all2all_backend"].type = literal
    ParallelConfig.__annotations__["all2all_backend"] = literal
    rebuild_dataclass(ParallelConfig, force=True)
    # The CLI builds its choices from the field type once and caches them.
    arg_utils._compute_kwargs.cache_clear()


def _backend_name_works() -> bool:
    """Whether a ParallelConfig validates with the name and --all2all-backend lists it."""
    from vllm.config import ParallelConfig
    from vllm.engine import arg_utils

    try:
        ParallelConfig(all2all_backend=BACKEND_NAME)
        return BACKEND_NAME in arg_utils._compute_kwargs(ParallelConfig)["all2all_backend"]["choices"]
    except Exception:  # noqa: BLE001 - any failure means the name does not work; the caller undoes it
        return False


def _accept_backend_name() -> None:
    from vllm.config import ParallelConfig

    names = typing.get_args(ParallelConfig.__dataclass_fields__["all2all_backend"].type)
    if BACKEND_NAME not in names:
        _set_backend_names((*names, BACKEND_NAME))
        if not _backend_name_works():
            _set_backend_names(names)
            raise VllmVersionError(f"vLLM {vllm_version()}: ParallelConfig still rejects all2all_backend="
                                   f"{BACKEND_NAME!r} after its Literal was extended")

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
