"""YAML configuration of ep_plugin: schema, loading and validation.

Precedence (lowest first): the defaults below < the YAML file (`path`, or `$EP_PLUGIN_CONFIG`)
< explicit arguments (keyword overrides, `Buffer(...)` arguments, per-call `config=`).

How the config becomes NCCL / NVSHMEM environment variables lives in `environment.py`. Every key
is documented in docs/configuration.md and, with its default, in configs/default.yaml.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, Mapping, Optional, Tuple, Union

import yaml

logger = logging.getLogger("ep_plugin")

CONFIG_ENV_VAR = "EP_PLUGIN_CONFIG"

MODES = ("normal", "low_latency")
BACKENDS = ("auto", "native", "reference")
TRANSPORTS = ("auto", "nvlink", "ibgda", "ibrc", "libfabric", "ucx")
LOG_LEVELS = ("debug", "info", "warning", "error")
# Values NVSHMEM 3.x accepts for NVSHMEM_IBGDA_NIC_HANDLER and NVSHMEM_LIBFABRIC_PROVIDER.
NIC_HANDLERS = ("auto", "gpu", "cpu", "cpu_host_memory")
LIBFABRIC_PROVIDERS = ("cxi", "efa", "verbs")
# How the low-latency combine's expert-side sums cross to the token's rank (low_latency_dispatch given
# topk_weights): rounded to bf16 (half the bytes), or as fp32.
EXPERT_SUMS_PARTIALS = ("bf16", "fp32")
# NVSHMEM's IBGDA bounds on NVSHMEM_QP_DEPTH (NVSHMEMI_IBGDA_MIN/MAX_QP_DEPTH).
QP_DEPTH_RANGE = (128, 32768)
# The direct dispatch's grid is at most num_sms blocks (2 per channel, 64 channels).
MAX_DIRECT_BLOCKS = 128


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type, or impossible."""


AUTO = "auto"


@dataclass(frozen=True)
class TuningSection:
    """Chunk sizes of one normal-mode operation; `None` means the library's recommendation."""
    nvl_chunked_send_tokens: Optional[int] = None
    nvl_chunked_recv_tokens: Optional[int] = None
    rdma_chunked_send_tokens: Optional[int] = None
    rdma_chunked_recv_tokens: Optional[int] = None


@dataclass(frozen=True)
class DispatchSection(TuningSection):
    """The dispatch's chunk sizes, and how the direct dispatch spreads its rows over the SMs."""
    direct_max_blocks: int = 16      # blocks of the direct dispatch at most (0: num_sms)
    direct_chunk_tokens: int = 1     # tokens a warp of the direct dispatch claims at a time


@dataclass(frozen=True)
class BufferSection:
    max_hidden: int = 7168
    num_nvl_bytes: Union[int, str] = AUTO
    num_rdma_bytes: Union[int, str] = AUTO
    combine_staging_tokens: Union[int, str] = AUTO
    dispatch_output_bytes: Union[int, str] = AUTO


@dataclass(frozen=True)
class LowLatencySection:
    max_dispatch_tokens_per_rank: int = 128
    num_experts: int = 256
    use_fp8: bool = True
    round_scale: bool = False
    use_ue8m0: bool = False
    num_qps_per_rank: int = 24
    allow_nvlink: bool = True
    allow_mnnvl: bool = False
    expert_sums_partials: str = "bf16"


@dataclass(frozen=True)
class TopologySection:
    ranks_per_node: Optional[int] = None


@dataclass(frozen=True)
class NetworkSection:
    """NVSHMEM network settings; `None` leaves the variable unset (NVSHMEM's own default).

    `hca_list` and `hca_pe_mapping` are stored as NVSHMEM's comma-separated strings.
    """
    qps_per_connection: Optional[int] = None
    qp_depth: Optional[int] = None
    hca_list: Optional[str] = None
    hca_pe_mapping: Optional[str] = None
    nic_pe_mapping: Optional[bool] = None
    multi_port: Optional[bool] = None
    ibgda_nic_handler: Optional[str] = None
    libfabric_provider: Optional[str] = None
    gid_index: Optional[int] = None
    traffic_class: Optional[int] = None
    force_puts: bool = False  # the internode network leg puts even to NVLink peers (emulated nodes)


@dataclass(frozen=True)
class EpConfig:
    mode: str = "normal"
    backend: str = AUTO
    transport: str = AUTO
    num_sms: int = 24
    timeout_s: float = 100.0
    check_inputs: bool = False
    log_level: str = "info"
    buffer: BufferSection = field(default_factory=BufferSection)
    dispatch: DispatchSection = field(default_factory=DispatchSection)
    combine: TuningSection = field(default_factory=TuningSection)
    low_latency: LowLatencySection = field(default_factory=LowLatencySection)
    topology: TopologySection = field(default_factory=TopologySection)
    network: NetworkSection = field(default_factory=NetworkSection)
    env: Dict[str, str] = field(default_factory=dict)
    source: Optional[str] = field(default=None, compare=False)

    def replace(self, **changes: Any) -> "EpConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> Dict[str, Any]:
        data = dataclasses.asdict(self)
        data.pop("source")
        return data


_SECTIONS = {
    "buffer": BufferSection,
    "dispatch": DispatchSection,
    "combine": TuningSection,
    "low_latency": LowLatencySection,
    "topology": TopologySection,
    "network": NetworkSection,
}


def default_items() -> Iterator[Tuple[str, Any]]:
    """Every dotted key of the schema with its default (sections expanded; `env` is `{}`)."""
    for f in dataclasses.fields(EpConfig):
        if f.name == "source":
            continue
        default = getattr(EpConfig(), f.name)
        if dataclasses.is_dataclass(default):
            for sub in dataclasses.fields(default):
                yield f"{f.name}.{sub.name}", getattr(default, sub.name)
        else:
            yield f.name, default


def _fail(source: Optional[str], key: str, message: str) -> ConfigError:
    where = source or "<config>"
    return ConfigError(f"{where}: key '{key}': {message}")


def _check_int(source, key, value, minimum=None, maximum=None, allow_none=False, allow_auto=False):
    if value is None and allow_none:
        return None
    if allow_auto and value == AUTO:
        return AUTO
    if not isinstance(value, int) or isinstance(value, bool):
        allowed = "an integer" + (" or null" if allow_none else "") + (" or 'auto'" if allow_auto else "")
        raise _fail(source, key, f"expected {allowed}, got {value!r}")
    if minimum is not None and value < minimum:
        raise _fail(source, key, f"must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise _fail(source, key, f"must be <= {maximum}, got {value}")
    return value


def _check_bool(source, key, value, allow_none=False):
    if value is None and allow_none:
        return None
    if not isinstance(value, bool):
        raise _fail(source, key, f"expected true or false{' or null' if allow_none else ''}, got {value!r}")
    return value


def _check_choice(source, key, value, choices, allow_none=False):
    if value is None and allow_none:
        return None
    if not isinstance(value, str) or value not in choices:
        allowed = ", ".join(choices) + (", or null" if allow_none else "")
        raise _fail(source, key, f"expected one of {allowed}, got {value!r}")
    return value


_HCA_NAME = r"[A-Za-z0-9][A-Za-z0-9_.\-]*"
_HCA_ENTRY = re.compile(rf"^{_HCA_NAME}(:[1-9][0-9]*)?$")
_HCA_PE_ENTRY = re.compile(rf"^{_HCA_NAME}:[1-9][0-9]*:[1-9][0-9]*$")


def _check_hca_entries(source, key, value, pattern, form, allow_exclude):
    """A comma-separated string or a list of entries -> NVSHMEM's comma-separated string."""
    if value is None:
        return None
    if isinstance(value, str):
        entries = [item.strip() for item in value.split(",")]
    elif isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value):
        entries = [item.strip() for item in value]
    else:
        raise _fail(source, key, f"expected a string or a list of strings of the form {form}, got {value!r}")
    if not entries or entries == [""]:
        raise _fail(source, key, f"expected at least one entry of the form {form}, got {value!r}")
    exclude = allow_exclude and entries[0].startswith("^")
    if exclude:
        entries[0] = entries[0][1:]
    for entry in entries:
        if not pattern.match(entry):
            hint = " ('^' may only prefix the first entry and then excludes the whole list)" \
                if allow_exclude and "^" in entry else ""
            raise _fail(source, key, f"entry {entry!r} is not of the form {form}{hint}")
    return ("^" if exclude else "") + ",".join(entries)


def _validate_section(source: Optional[str], name: str, value: Any):
    cls = _SECTIONS[name]
    if value is None:
        value = {}
    if isinstance(value, cls):
        value = dataclasses.asdict(value)
    if not isinstance(value, Mapping):
        raise _fail(source, name, f"expected a mapping of {', '.join(f.name for f in dataclasses.fields(cls))}, "
                                  f"got {value!r}")
    known = {f.name for f in dataclasses.fields(cls)}
    for key in value:
        if key not in known:
            raise _fail(source, f"{name}.{key}", f"unknown key; allowed: {', '.join(sorted(known))}")
    merged = {**dataclasses.asdict(cls()), **value}
    k = lambda sub: f"{name}.{sub}"  # noqa: E731
    if issubclass(cls, TuningSection):
        for sub in sorted(f.name for f in dataclasses.fields(TuningSection)):
            merged[sub] = _check_int(source, k(sub), merged[sub], minimum=1, maximum=1 << 16, allow_none=True)
        for leg in ("nvl", "rdma"):
            send, recv = merged[f"{leg}_chunked_send_tokens"], merged[f"{leg}_chunked_recv_tokens"]
            if send is not None and recv is not None and send > recv:
                raise _fail(source, k(f"{leg}_chunked_send_tokens"),
                            f"must not exceed {leg}_chunked_recv_tokens ({recv}), got {send}")
        if cls is DispatchSection:
            merged["direct_max_blocks"] = _check_int(source, k("direct_max_blocks"), merged["direct_max_blocks"],
                                                     minimum=0, maximum=MAX_DIRECT_BLOCKS)
            merged["direct_chunk_tokens"] = _check_int(source, k("direct_chunk_tokens"),
                                                       merged["direct_chunk_tokens"], minimum=1, maximum=1 << 16)
    elif cls is BufferSection:
        merged["max_hidden"] = _check_int(source, k("max_hidden"), merged["max_hidden"], minimum=8, maximum=1 << 20)
        for sub in ("num_nvl_bytes", "num_rdma_bytes"):
            merged[sub] = _check_int(source, k(sub), merged[sub], minimum=0, allow_auto=True)
        merged["combine_staging_tokens"] = _check_int(source, k("combine_staging_tokens"),
                                                      merged["combine_staging_tokens"], minimum=0, maximum=32768,
                                                      allow_auto=True)
        merged["dispatch_output_bytes"] = _check_int(source, k("dispatch_output_bytes"),
                                                     merged["dispatch_output_bytes"], minimum=0, allow_auto=True)
    elif cls is LowLatencySection:
        merged["max_dispatch_tokens_per_rank"] = _check_int(
            source, k("max_dispatch_tokens_per_rank"), merged["max_dispatch_tokens_per_rank"], minimum=1, maximum=1 << 16)
        merged["num_experts"] = _check_int(source, k("num_experts"), merged["num_experts"], minimum=1, maximum=1 << 16)
        merged["num_qps_per_rank"] = _check_int(source, k("num_qps_per_rank"), merged["num_qps_per_rank"],
                                                minimum=1, maximum=1024)
        for sub in ("use_fp8", "round_scale", "use_ue8m0", "allow_nvlink", "allow_mnnvl"):
            merged[sub] = _check_bool(source, k(sub), merged[sub])
        merged["expert_sums_partials"] = _check_choice(source, k("expert_sums_partials"),
                                                       merged["expert_sums_partials"], EXPERT_SUMS_PARTIALS)
        if merged["use_ue8m0"] and not merged["round_scale"]:
            raise _fail(source, k("use_ue8m0"), "UE8M0 scales are powers of two: it needs round_scale: true")
        if merged["use_ue8m0"] and not merged["use_fp8"]:
            raise _fail(source, k("use_ue8m0"), "UE8M0 scales only exist with use_fp8: true")
    elif cls is TopologySection:
        merged["ranks_per_node"] = _check_int(source, k("ranks_per_node"), merged["ranks_per_node"],
                                              minimum=1, maximum=1 << 16, allow_none=True)
    elif cls is NetworkSection:
        merged["qps_per_connection"] = _check_int(source, k("qps_per_connection"), merged["qps_per_connection"],
                                                  minimum=1, maximum=1024, allow_none=True)
        merged["qp_depth"] = _check_int(source, k("qp_depth"), merged["qp_depth"], minimum=QP_DEPTH_RANGE[0],
                                        maximum=QP_DEPTH_RANGE[1], allow_none=True)
        merged["hca_list"] = _check_hca_entries(source, k("hca_list"), merged["hca_list"], _HCA_ENTRY,
                                                "'name' or 'name:port' (e.g. mlx5_0:1)", allow_exclude=True)
        merged["hca_pe_mapping"] = _check_hca_entries(source, k("hca_pe_mapping"), merged["hca_pe_mapping"],
                                                      _HCA_PE_ENTRY, "'name:port:count' (e.g. mlx5_0:1:4)",
                                                      allow_exclude=False)
        if merged["hca_list"] is not None and merged["hca_pe_mapping"] is not None:
            raise _fail(source, k("hca_pe_mapping"),
                        "cannot be combined with network.hca_list (NVSHMEM ignores the mapping when a list is "
                        "given); set only one of them")
        for sub in ("nic_pe_mapping", "multi_port"):
            merged[sub] = _check_bool(source, k(sub), merged[sub], allow_none=True)
        merged["ibgda_nic_handler"] = _check_choice(source, k("ibgda_nic_handler"), merged["ibgda_nic_handler"],
                                                    NIC_HANDLERS, allow_none=True)
        merged["libfabric_provider"] = _check_choice(source, k("libfabric_provider"), merged["libfabric_provider"],
                                                     LIBFABRIC_PROVIDERS, allow_none=True)
        merged["gid_index"] = _check_int(source, k("gid_index"), merged["gid_index"], minimum=0, maximum=65535,
                                         allow_none=True)
        merged["traffic_class"] = _check_int(source, k("traffic_class"), merged["traffic_class"], minimum=0,
                                             maximum=255, allow_none=True)
        merged["force_puts"] = _check_bool(source, k("force_puts"), merged["force_puts"])
    return cls(**merged)


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _nvshmem_bool(value: str) -> bool:
    """How NVSHMEM reads a boolean variable: false iff it starts with 0, n, N, f or F."""
    return not (value[:1] in ("0", "n", "N", "f", "F"))


# ep_plugin never uses NVLink multicast (NVLS): these variables may only keep it off.
MULTICAST_OFF = {
    "NVSHMEM_DISABLE_NVLS": ("1", lambda v: _nvshmem_bool(v)),
    "NCCL_NVLS_ENABLE": ("0", lambda v: v.strip() == "0"),
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": ("1", lambda v: v.strip() == "1"),
}


def _validate_env(source: Optional[str], value: Any) -> Dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise _fail(source, "env", f"expected a mapping of variable names to values, got {value!r}")
    env = {}
    for name, item in value.items():
        if not isinstance(name, str) or not _ENV_NAME.match(name):
            raise _fail(source, f"env.{name}", "not a valid environment variable name "
                                               "(letters, digits and '_', not starting with a digit)")
        if isinstance(item, bool):
            item = "1" if item else "0"
        if not isinstance(item, (str, int, float)):
            raise _fail(source, f"env.{name}", f"expected a string or number, got {item!r}")
        item = str(item)
        if "\0" in item:
            raise _fail(source, f"env.{name}", "value contains a NUL character")
        if name in MULTICAST_OFF and not MULTICAST_OFF[name][1](item):
            raise _fail(source, f"env.{name}", f"ep_plugin keeps NVLink multicast off: the only allowed value is "
                                               f"{MULTICAST_OFF[name][0]!r}, got {item!r}")
        env[name] = item
    return env


def _check_combinations(source: Optional[str], values: Dict[str, Any]) -> None:
    """Reject settings that contradict each other across sections."""
    transport, net, ll = values["transport"], values["network"], values["low_latency"]
    if transport == "nvlink":
        if not ll.allow_nvlink:
            raise _fail(source, "low_latency.allow_nvlink",
                        "false contradicts transport: nvlink (NVLink is then the only path); "
                        "use a network transport or allow_nvlink: true")
        for sub in ("qps_per_connection", "qp_depth", "hca_list", "hca_pe_mapping", "nic_pe_mapping", "multi_port",
                    "ibgda_nic_handler", "libfabric_provider", "gid_index", "traffic_class"):
            if getattr(net, sub) is not None:
                raise _fail(source, f"network.{sub}", "transport: nvlink uses no network; remove this key or "
                                                      "choose a network transport")
    if net.libfabric_provider is not None and transport not in ("libfabric", AUTO):
        raise _fail(source, "network.libfabric_provider",
                    f"only used with transport: libfabric (or auto), got transport: {transport}")
    for sub in ("ibgda_nic_handler", "multi_port"):
        if getattr(net, sub) is not None and transport not in ("ibgda", AUTO):
            raise _fail(source, f"network.{sub}", f"only used by IBGDA (transport: ibgda, or auto in "
                                                  f"low-latency mode), got transport: {transport}")


def validate(data: Mapping[str, Any], source: Optional[str] = None) -> EpConfig:
    """Build an `EpConfig` from a mapping (parsed YAML), rejecting unknown keys and bad values.

    Raises `ConfigError` naming `source`, the dotted key and what is allowed, for the first problem.
    """
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{source or '<config>'}: the top level must be a mapping, got {type(data).__name__}")
    known = {f.name for f in dataclasses.fields(EpConfig)} - {"source"}
    for key in data:
        if key not in known:
            raise _fail(source, str(key), f"unknown key; allowed: {', '.join(sorted(known))}")
    defaults = EpConfig()
    values: Dict[str, Any] = {}
    values["mode"] = _check_choice(source, "mode", data.get("mode", defaults.mode), MODES)
    values["backend"] = _check_choice(source, "backend", data.get("backend", defaults.backend), BACKENDS)
    values["transport"] = _check_choice(source, "transport", data.get("transport", defaults.transport), TRANSPORTS)
    values["log_level"] = _check_choice(source, "log_level", data.get("log_level", defaults.log_level), LOG_LEVELS)
    num_sms = _check_int(source, "num_sms", data.get("num_sms", defaults.num_sms), minimum=2, maximum=128)
    if num_sms % 2 != 0:
        raise _fail(source, "num_sms", f"must be even (one sender and one receiver SM per channel), got {num_sms}")
    values["num_sms"] = num_sms
    timeout = data.get("timeout_s", defaults.timeout_s)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 86400:
        raise _fail(source, "timeout_s", f"expected a number of seconds in (0, 86400], got {timeout!r}")
    values["timeout_s"] = float(timeout)
    values["check_inputs"] = _check_bool(source, "check_inputs", data.get("check_inputs", defaults.check_inputs))
    for name in _SECTIONS:
        values[name] = _validate_section(source, name, data.get(name))
    values["env"] = _validate_env(source, data.get("env"))
    _check_combinations(source, values)
    return EpConfig(source=source, **values)


def _deep_merge(base: Mapping[str, Any], update: Mapping[str, Any]) -> Dict[str, Any]:
    """`update` over `base`; nested mappings (sections, `env`) are merged key by key."""
    result = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(result.get(key), Mapping):
            result[key] = _deep_merge(result[key], value)
        else:
            result[key] = value
    return result


def _dotted_to_nested(overrides: Mapping[str, Any], source: Optional[str] = None) -> Dict[str, Any]:
    """`{"low_latency.use_fp8": False}` -> `{"low_latency": {"use_fp8": False}}` (plain keys kept)."""
    nested: Dict[str, Any] = {}
    for dotted, value in overrides.items():
        if not isinstance(dotted, str):
            raise _fail(source, str(dotted), f"keys must be strings, got {type(dotted).__name__}")
        parts = dotted.split(".")
        if any(not part for part in parts):
            raise _fail(source, dotted, "not a valid dotted key")
        # `env.NAME` takes the rest verbatim: variable names never contain dots.
        if parts[0] == "env" and len(parts) > 2:
            parts = ["env", ".".join(parts[1:])]
        update: Any = value
        for part in reversed(parts[1:]):
            update = {part: update}
        head = parts[0]
        if head in nested and len(parts) > 1 and not isinstance(nested[head], Mapping):
            raise _fail(source, dotted, f"conflicts with the value given for '{head}'")
        if head in nested and isinstance(nested[head], Mapping) and isinstance(update, Mapping):
            nested[head] = _deep_merge(nested[head], update)
        elif head in nested and len(parts) == 1 and isinstance(nested[head], Mapping):
            if not isinstance(value, Mapping):
                raise _fail(source, dotted, f"conflicts with the dotted keys given under '{head}'")
            nested[head] = _deep_merge(value, nested[head])
        else:
            nested[head] = update
    return nested


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key given twice in one mapping."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False):
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            duplicate = key in seen
        except TypeError:
            continue  # unhashable keys are reported by the constructor below
        if duplicate:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def read_yaml(path: str) -> Dict[str, Any]:
    """Parse a YAML file; `ConfigError` for a missing or unreadable file, bad YAML or duplicate keys."""
    try:
        with open(path, "r", encoding="utf-8") as handle:
            data = yaml.load(handle, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path}: cannot read the config file: {error}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from None
    return {} if data is None else data


def load_config(path: Optional[str] = None, overrides: Optional[Mapping[str, Any]] = None) -> EpConfig:
    """Load the configuration: defaults < YAML file < overrides.

    Arguments:
        path: a YAML file; `None` uses `$EP_PLUGIN_CONFIG` if set, else only the defaults.
        overrides: explicit values, nested (`{"low_latency": {"use_fp8": False}}`) or dotted
            (`{"low_latency.use_fp8": False}`).

    Returns the validated `EpConfig`; its `source` names the file. Raises `ConfigError` naming the
    file (or "<path> + overrides" when the bad value came from `overrides`) and the dotted key.
    """
    path = os.fspath(path) if path is not None else os.environ.get(CONFIG_ENV_VAR) or None
    data = read_yaml(path) if path else {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    cfg = validate(data, source=path)
    if not overrides:
        return cfg
    if not isinstance(overrides, Mapping):
        raise ConfigError(f"overrides must be a mapping, got {type(overrides).__name__}")
    where = f"{path or '<defaults>'} + overrides"
    merged = _deep_merge(data, _dotted_to_nested(overrides, where))
    return dataclasses.replace(validate(merged, source=where), source=path)


def as_config(config: Union[None, str, os.PathLike, Mapping[str, Any], EpConfig]) -> EpConfig:
    """Accept an `EpConfig`, a YAML path, a mapping (nested or dotted keys), or `None`.

    `None` loads `$EP_PLUGIN_CONFIG` if set, else the built-in defaults. A mapping is validated on
    its own (the environment's file is not read); errors name it "<mapping>".
    """
    if isinstance(config, EpConfig):
        return config
    if config is None:
        return load_config()
    if isinstance(config, (str, os.PathLike)):
        return load_config(os.fspath(config))
    if isinstance(config, Mapping):
        return validate(_dotted_to_nested(config, "<mapping>"), source="<mapping>")
    raise ConfigError(f"expected an EpConfig, a YAML path or a mapping, got {type(config).__name__}")
