"""YAML configuration of ep_plugin: schema, loading, validation and environment.

Precedence (lowest first): the defaults below < the YAML file (`path`, or `$EP_PLUGIN_CONFIG`)
< explicit arguments (keyword overrides, `Buffer(...)` arguments, per-call `config=`).

Every key is documented in README.md ("Configuration reference") and in configs/default.yaml.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Union

import yaml

logger = logging.getLogger("ep_plugin")

CONFIG_ENV_VAR = "EP_PLUGIN_CONFIG"

MODES = ("normal", "low_latency")
BACKENDS = ("auto", "native", "reference")
TRANSPORTS = ("auto", "nvlink", "ibgda", "ibrc", "libfabric", "ucx")
LOG_LEVELS = ("debug", "info", "warning", "error")


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
class BufferSection:
    max_hidden: int = 7168
    num_nvl_bytes: Union[int, str] = AUTO
    num_rdma_bytes: Union[int, str] = AUTO


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


@dataclass(frozen=True)
class TopologySection:
    ranks_per_node: Optional[int] = None


@dataclass(frozen=True)
class EpConfig:
    mode: str = "normal"
    backend: str = AUTO
    transport: str = AUTO
    num_sms: int = 24
    timeout_s: float = 100.0
    check_inputs: bool = True
    log_level: str = "info"
    buffer: BufferSection = field(default_factory=BufferSection)
    dispatch: TuningSection = field(default_factory=TuningSection)
    combine: TuningSection = field(default_factory=TuningSection)
    low_latency: LowLatencySection = field(default_factory=LowLatencySection)
    topology: TopologySection = field(default_factory=TopologySection)
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
    "dispatch": TuningSection,
    "combine": TuningSection,
    "low_latency": LowLatencySection,
    "topology": TopologySection,
}


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


def _check_bool(source, key, value):
    if not isinstance(value, bool):
        raise _fail(source, key, f"expected true or false, got {value!r}")
    return value


def _check_choice(source, key, value, choices):
    if value not in choices:
        raise _fail(source, key, f"expected one of {', '.join(choices)}, got {value!r}")
    return value


def _validate_section(source: Optional[str], name: str, value: Any):
    cls = _SECTIONS[name]
    if isinstance(value, cls):
        value = dataclasses.asdict(value)
    if not isinstance(value, Mapping):
        raise _fail(source, name, f"expected a mapping, got {value!r}")
    known = {f.name for f in dataclasses.fields(cls)}
    for key in value:
        if key not in known:
            raise _fail(source, f"{name}.{key}", f"unknown key; allowed: {', '.join(sorted(known))}")
    merged = {**dataclasses.asdict(cls()), **value}
    k = lambda sub: f"{name}.{sub}"  # noqa: E731
    if cls is TuningSection:
        for sub in known:
            merged[sub] = _check_int(source, k(sub), merged[sub], minimum=1, maximum=1 << 16, allow_none=True)
        send, recv = merged["nvl_chunked_send_tokens"], merged["nvl_chunked_recv_tokens"]
        if send is not None and recv is not None and send > recv:
            raise _fail(source, k("nvl_chunked_send_tokens"),
                        f"must not exceed nvl_chunked_recv_tokens ({recv}), got {send}")
        send, recv = merged["rdma_chunked_send_tokens"], merged["rdma_chunked_recv_tokens"]
        if send is not None and recv is not None and send > recv:
            raise _fail(source, k("rdma_chunked_send_tokens"),
                        f"must not exceed rdma_chunked_recv_tokens ({recv}), got {send}")
    elif cls is BufferSection:
        merged["max_hidden"] = _check_int(source, k("max_hidden"), merged["max_hidden"], minimum=8, maximum=1 << 20)
        for sub in ("num_nvl_bytes", "num_rdma_bytes"):
            merged[sub] = _check_int(source, k(sub), merged[sub], minimum=0, allow_auto=True)
    elif cls is LowLatencySection:
        merged["max_dispatch_tokens_per_rank"] = _check_int(
            source, k("max_dispatch_tokens_per_rank"), merged["max_dispatch_tokens_per_rank"], minimum=1, maximum=1 << 16)
        merged["num_experts"] = _check_int(source, k("num_experts"), merged["num_experts"], minimum=1, maximum=1 << 16)
        merged["num_qps_per_rank"] = _check_int(source, k("num_qps_per_rank"), merged["num_qps_per_rank"],
                                                minimum=1, maximum=1024)
        for sub in ("use_fp8", "round_scale", "use_ue8m0", "allow_nvlink", "allow_mnnvl"):
            merged[sub] = _check_bool(source, k(sub), merged[sub])
        if merged["use_ue8m0"] and not merged["round_scale"]:
            raise _fail(source, k("use_ue8m0"), "UE8M0 scales are powers of two: it needs round_scale: true")
        if merged["use_ue8m0"] and not merged["use_fp8"]:
            raise _fail(source, k("use_ue8m0"), "UE8M0 scales only exist with use_fp8: true")
    elif cls is TopologySection:
        merged["ranks_per_node"] = _check_int(source, k("ranks_per_node"), merged["ranks_per_node"],
                                              minimum=1, maximum=1 << 16, allow_none=True)
    return cls(**merged)


def _validate_env(source: Optional[str], value: Any) -> Dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise _fail(source, "env", f"expected a mapping of variable names to values, got {value!r}")
    env = {}
    for name, item in value.items():
        if not isinstance(name, str) or not name or not (name[0].isalpha() or name[0] == "_") \
                or not all(c.isalnum() or c == "_" for c in name):
            raise _fail(source, f"env.{name}", "not a valid environment variable name")
        if isinstance(item, bool):
            item = "1" if item else "0"
        if not isinstance(item, (str, int, float)):
            raise _fail(source, f"env.{name}", f"expected a string or number, got {item!r}")
        env[name] = str(item)
    return env


def validate(data: Mapping[str, Any], source: Optional[str] = None) -> EpConfig:
    """Build an `EpConfig` from a mapping (parsed YAML), rejecting unknown keys and bad values."""
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
        values[name] = _validate_section(source, name, data.get(name) or {})
    values["env"] = _validate_env(source, data.get("env"))
    return EpConfig(source=source, **values)


def _deep_merge(base: Dict[str, Any], update: Mapping[str, Any]) -> Dict[str, Any]:
    result = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(result.get(key), Mapping) and key != "env":
            result[key] = _deep_merge(result[key], value)
        elif key == "env" and isinstance(value, Mapping) and isinstance(result.get(key), Mapping):
            result[key] = {**result[key], **value}
        else:
            result[key] = value
    return result


def _dotted_to_nested(overrides: Mapping[str, Any]) -> Dict[str, Any]:
    nested: Dict[str, Any] = {}
    for dotted, value in overrides.items():
        parts = dotted.split(".")
        node = nested
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return nested


def read_yaml(path: str) -> Dict[str, Any]:
    try:
        with open(path, "r", encoding="utf-8") as handle:
            data = yaml.safe_load(handle)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from None
    return {} if data is None else data


def load_config(path: Optional[str] = None, overrides: Optional[Mapping[str, Any]] = None) -> EpConfig:
    """Load the configuration: defaults < YAML file < overrides.

    Arguments:
        path: a YAML file; `None` uses `$EP_PLUGIN_CONFIG` if set, else only the defaults.
        overrides: explicit values, nested (`{"low_latency": {"use_fp8": False}}`) or dotted
            (`{"low_latency.use_fp8": False}`).
    """
    path = path if path is not None else os.environ.get(CONFIG_ENV_VAR) or None
    data = read_yaml(path) if path else {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(data).__name__}")
    if overrides:
        data = _deep_merge(data, _dotted_to_nested(overrides))
    return validate(data, source=path)


def as_config(config: Union[None, str, os.PathLike, Mapping[str, Any], EpConfig]) -> EpConfig:
    """Accept an `EpConfig`, a YAML path, a mapping, or `None` (defaults / `$EP_PLUGIN_CONFIG`)."""
    if isinstance(config, EpConfig):
        return config
    if config is None:
        return load_config()
    if isinstance(config, (str, os.PathLike)):
        return load_config(os.fspath(config))
    if isinstance(config, Mapping):
        return validate(config, source="<mapping>")
    raise ConfigError(f"expected an EpConfig, a YAML path or a mapping, got {type(config).__name__}")
