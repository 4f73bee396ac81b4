"""Environment variables for NCCL / NVSHMEM, derived from the config and applied before either starts.

Precedence (highest first):
  1. the user's process environment: never overridden;
  2. the `env:` section of the config;
  3. variables derived from `transport`, `network` and, in low-latency mode, `low_latency`.

NVLink multicast (NVLS) is never used: NVSHMEM_DISABLE_NVLS=1, NCCL_NVLS_ENABLE=0 and
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 are always requested (and the config may not say otherwise).
docs/configuration.md has the transport -> variable table and where each name was checked.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, MutableMapping, Optional, Tuple

import yaml

from .config import AUTO, MULTICAST_OFF, EpConfig

logger = logging.getLogger("ep_plugin")

USER, CONFIG_ENV, DERIVED = "user", "config env", "derived"

NO_MULTICAST_ENV = {name: value for name, (value, _) in MULTICAST_OFF.items()}

# NCCL >= 2.22 connects peers lazily unless NCCL_RUNTIME_CONNECT=0.
NCCL_LAZY_CONNECT_VERSION = (2, 22)
NCCL_GUIDANCE = {
    "all": {"NCCL_RUNTIME_CONNECT": "0"},
    "single_port_roce": {"NCCL_RUNTIME_CONNECT": "0", "NCCL_IB_QPS_PER_CONNECTION": "4",
                         "NCCL_MAX_NCHANNELS": "4", "NCCL_NVLS_ENABLE": "0"},
}

# Prefixes of variables `describe_config` reports even when ep_plugin does not ask for them.
_REPORTED_PREFIXES = ("NVSHMEM_", "NCCL_", "TORCH_SYMM_MEM_")

# Variables this process's ep_plugin wrote into os.environ (name -> value): a later Buffer may
# update them, since the user did not set them. Only tracked for the real os.environ.
_set_by_ep_plugin: Dict[str, str] = {}


@dataclass(frozen=True)
class EnvSetting:
    """One variable of the resulting environment.

    Attributes:
        name, value: the variable and the value in effect after `apply_environment`.
        origin: 'user' (already in the environment), 'config env' (the `env:` section) or
            'derived' (from transport / network / low_latency).
        reason: why ep_plugin asks for it (e.g. 'transport: ibgda', 'env:'); for a user value,
            what ep_plugin would have asked for.
        requested: the value ep_plugin asked for when the user's value wins instead, else None.
    """
    name: str
    value: str
    origin: str
    reason: str
    requested: Optional[str] = None


def is_low_latency(cfg: EpConfig, low_latency_mode: Optional[bool]) -> bool:
    """`low_latency_mode` when given, else the config's `mode`."""
    return cfg.mode == "low_latency" if low_latency_mode is None else bool(low_latency_mode)


def _derive(cfg: EpConfig, low_latency: bool) -> Tuple[Dict[str, Tuple[str, str]], List[str]]:
    """Derived variables (name -> (value, reason)) and notes about settings that have no effect."""
    out: Dict[str, Tuple[str, str]] = {}
    notes: List[str] = []

    def add(name: str, value: Any, reason: str) -> None:
        out[name] = (str(value), reason)

    for name, value in NO_MULTICAST_ENV.items():
        add(name, value, "NVLink multicast is always off")

    transport, net, ll = cfg.transport, cfg.network, cfg.low_latency
    why = f"transport: {transport}"
    ibgda = transport == "ibgda" or (transport == AUTO and low_latency)
    if transport == "nvlink":
        add("NVSHMEM_REMOTE_TRANSPORT", "none", why)
        add("NVSHMEM_IB_ENABLE_IBGDA", "0", why)
        add("NVSHMEM_DISABLE_P2P", "0", why)
    elif transport in ("ibrc", "libfabric", "ucx"):
        add("NVSHMEM_REMOTE_TRANSPORT", transport, why)
        add("NVSHMEM_IB_ENABLE_IBGDA", "0", why)
    elif ibgda:
        add("NVSHMEM_IB_ENABLE_IBGDA", "1", why if transport == "ibgda" else "transport: auto, low-latency mode")

    if ibgda:
        if low_latency or net.qps_per_connection is None:
            add("NVSHMEM_IBGDA_NUM_RC_PER_PE", ll.num_qps_per_rank, "low_latency.num_qps_per_rank")
            if low_latency and net.qps_per_connection is not None:
                notes.append("network.qps_per_connection is not used for IBGDA in low-latency mode: "
                             "low_latency.num_qps_per_rank (Buffer's num_qps_per_rank) sets its QPs")
        else:
            add("NVSHMEM_IBGDA_NUM_RC_PER_PE", net.qps_per_connection, "network.qps_per_connection")
        if net.ibgda_nic_handler is not None:
            add("NVSHMEM_IBGDA_NIC_HANDLER", net.ibgda_nic_handler, "network.ibgda_nic_handler")
        if net.multi_port is not None:
            add("NVSHMEM_IBGDA_ENABLE_MULTI_PORT", int(net.multi_port), "network.multi_port")
    else:
        for sub in ("ibgda_nic_handler", "multi_port"):
            if getattr(net, sub) is not None and transport != "nvlink":
                notes.append(f"network.{sub} has no effect: IBGDA is off (transport: {transport}, "
                             f"{'low-latency' if low_latency else 'normal'} mode)")
    if net.qps_per_connection is not None and not ibgda:
        if transport in ("ibrc", AUTO):
            add("NVSHMEM_IB_NUM_RC_PER_DEVICE", net.qps_per_connection, "network.qps_per_connection")
        elif transport in ("libfabric", "ucx"):
            notes.append(f"network.qps_per_connection has no effect with transport: {transport}")

    if low_latency:
        if transport == "nvlink":
            if not ll.allow_nvlink:
                notes.append("allow_nvlink_for_low_latency_mode=False contradicts transport: nvlink; "
                             "NVLink stays enabled (NVSHMEM_DISABLE_P2P=0)")
        else:
            add("NVSHMEM_DISABLE_P2P", "0" if ll.allow_nvlink else "1", "low_latency.allow_nvlink")
        add("NVSHMEM_DISABLE_MNNVL", "0" if ll.allow_mnnvl else "1", "low_latency.allow_mnnvl")

    for sub, name in (("qp_depth", "NVSHMEM_QP_DEPTH"), ("hca_list", "NVSHMEM_HCA_LIST"),
                      ("hca_pe_mapping", "NVSHMEM_HCA_PE_MAPPING"),
                      ("nic_pe_mapping", "NVSHMEM_ENABLE_NIC_PE_MAPPING"),
                      ("libfabric_provider", "NVSHMEM_LIBFABRIC_PROVIDER"),
                      ("gid_index", "NVSHMEM_IB_GID_INDEX"), ("traffic_class", "NVSHMEM_IB_TRAFFIC_CLASS")):
        value = getattr(net, sub)
        if value is not None:
            add(name, int(value) if isinstance(value, bool) else value, f"network.{sub}")
    return out, notes


def derived_environment(cfg: EpConfig, low_latency_mode: Optional[bool] = None) -> Dict[str, str]:
    """Variables derived from transport / network / low_latency (without the `env:` section)."""
    derived, _ = _derive(cfg, is_low_latency(cfg, low_latency_mode))
    return {name: value for name, (value, _) in derived.items()}


def requested_environment(cfg: EpConfig, low_latency_mode: Optional[bool] = None) -> Dict[str, str]:
    """Every variable the configuration asks for: derived ones, overridden by its `env:` section."""
    return {**derived_environment(cfg, low_latency_mode), **cfg.env}


def _user_set(environ: Mapping[str, str], name: str) -> bool:
    """True if `name` is in `environ` and was not written there by ep_plugin itself."""
    if name not in environ:
        return False
    return not (environ is os.environ and _set_by_ep_plugin.get(name) == environ[name])


def plan_environment(cfg: EpConfig, environ: Mapping[str, str],
                     low_latency_mode: Optional[bool] = None) -> Tuple[List[EnvSetting], List[str]]:
    """The resulting environment, variable by variable, and notes about settings without effect.

    Returns (settings, notes): one `EnvSetting` per requested variable, in request order.
    """
    derived, notes = _derive(cfg, is_low_latency(cfg, low_latency_mode))
    requested: Dict[str, Tuple[str, str, str]] = {
        name: (value, DERIVED, reason) for name, (value, reason) in derived.items()}
    for name, value in cfg.env.items():
        base = requested.get(name)
        reason = "env:" if base is None or base[0] == value else f"env: (replaces derived {base[0]} from {base[2]})"
        requested[name] = (value, CONFIG_ENV, reason)
    settings = []
    for name, (value, origin, reason) in requested.items():
        if _user_set(environ, name):
            user_value = environ[name]
            settings.append(EnvSetting(name, user_value, USER, f"{origin}: {reason}",
                                       None if user_value == value else value))
        else:
            settings.append(EnvSetting(name, value, origin, reason))
    return settings, notes


def resolve_environment(cfg: EpConfig, environ: Mapping[str, str],
                        low_latency_mode: Optional[bool] = None) -> Tuple[Dict[str, str], Dict[str, str]]:
    """Split the requested variables into (to_set, kept_from_user)."""
    settings, _ = plan_environment(cfg, environ, low_latency_mode)
    to_set = {s.name: s.value for s in settings if s.origin != USER}
    kept = {s.name: s.value for s in settings if s.origin == USER}
    return to_set, kept


def multicast_warnings(environ: Mapping[str, str]) -> List[str]:
    """Warnings for user variables that switch NVLink multicast on (ep_plugin never uses it)."""
    warnings = []
    for name, (wanted, keeps_off) in MULTICAST_OFF.items():
        if _user_set(environ, name) and not keeps_off(environ[name]):
            warnings.append(f"{name}={environ[name]} in your environment enables NVLink multicast, which "
                            f"ep_plugin never uses; set {name}={wanted}")
    return warnings


def nccl_version_tuple(version: Any) -> Optional[Tuple[int, ...]]:
    """Normalize an NCCL version: a tuple, '2.22.3', or NCCL's integer code (22203, or 2708 before 2.9)."""
    if version is None:
        return None
    if isinstance(version, str):
        try:
            return tuple(int(part) for part in version.split("+")[0].split("."))
        except ValueError:
            return None
    if isinstance(version, int) and not isinstance(version, bool):
        if version >= 10000:
            return (version // 10000, version // 100 % 100, version % 100)
        return (version // 1000, version // 100 % 10, version % 100)
    try:
        return tuple(int(part) for part in version)
    except (TypeError, ValueError):
        return None


def detect_nccl_version() -> Optional[Tuple[int, ...]]:
    """NCCL's version as linked into torch, or None without CUDA (or if torch cannot tell)."""
    try:
        import torch
        if not torch.cuda.is_available():
            return None
        return nccl_version_tuple(torch.cuda.nccl.version())
    except Exception:  # noqa: BLE001 - a missing or CPU-only NCCL only means "unknown"
        return None


def nccl_warnings(cfg: EpConfig, nccl_version: Any, environ: Mapping[str, str]) -> List[str]:
    """Warnings about NCCL settings known to slow ep_plugin down.

    Arguments:
        cfg: the configuration (its `env:` section counts as set).
        nccl_version: (major, minor, patch), NCCL's integer code, a string, or None (unknown: no warning).
        environ: the process environment.

    Returns a list of messages (empty when nothing applies): with NCCL >= 2.22 and
    NCCL_RUNTIME_CONNECT set neither in `environ` nor in `cfg.env`, and a transport other than
    `nvlink` (lazy connection establishment only hurts internode traffic).
    """
    version = nccl_version_tuple(nccl_version)
    if version is None or tuple(version[:2]) < NCCL_LAZY_CONNECT_VERSION or cfg.transport == "nvlink":
        return []
    if "NCCL_RUNTIME_CONNECT" in environ or "NCCL_RUNTIME_CONNECT" in cfg.env:
        return []
    shown = ".".join(str(part) for part in version)
    return [f"NCCL {shown} establishes connections lazily (NCCL_RUNTIME_CONNECT defaults to 1 since 2.22), "
            "which has been measured to cut DeepEP-style internode bandwidth by about a third; set "
            "NCCL_RUNTIME_CONNECT=0 (config env: or your environment). On single-port RoCE NICs also "
            "NCCL_IB_QPS_PER_CONNECTION=4 and NCCL_MAX_NCHANNELS=4. See docs/configuration.md, "
            "'NCCL guidance'."]


_DETECT = object()


def apply_environment(cfg: EpConfig, low_latency_mode: Optional[bool] = None,
                      environ: Optional[MutableMapping[str, str]] = None, nccl_version: Any = _DETECT
                      ) -> Dict[str, str]:
    """Set the requested variables that the user has not set; returns what was set (name -> value).

    Logs at INFO one line with what was set and one with the user values kept; notes about
    settings without effect and NCCL / multicast warnings at WARNING. `nccl_version` defaults to
    `torch.cuda.nccl.version()` when CUDA is available.
    """
    environ = os.environ if environ is None else environ
    settings, notes = plan_environment(cfg, environ, low_latency_mode)
    warnings = multicast_warnings(environ)
    version = detect_nccl_version() if nccl_version is _DETECT else nccl_version
    warnings += nccl_warnings(cfg, version, environ)
    applied: Dict[str, str] = {}
    for setting in settings:
        if setting.origin == USER or environ.get(setting.name) == setting.value:
            continue
        environ[setting.name] = setting.value
        applied[setting.name] = setting.value
        if environ is os.environ:
            _set_by_ep_plugin[setting.name] = setting.value
    if applied:
        origin = {s.name: s.origin for s in settings}
        logger.info("ep_plugin env: set %s",
                    ", ".join(f"{name}={value} ({origin[name]})" for name, value in applied.items()))
    kept = [s for s in settings if s.origin == USER]
    if kept:
        logger.info("ep_plugin env: kept user values %s", ", ".join(
            f"{s.name}={s.value}" + (f" (config wanted {s.requested})" if s.requested is not None else "")
            for s in kept))
    for message in notes + warnings:
        logger.warning("ep_plugin env: %s", message)
    return applied


def describe_config(cfg: EpConfig, low_latency_mode: Optional[bool] = None,
                    environ: Optional[Mapping[str, str]] = None) -> str:
    """A human-readable report: the resolved config and the environment it results in.

    Arguments:
        cfg: the configuration.
        low_latency_mode: the mode to describe; None uses `cfg.mode`.
        environ: the process environment (default `os.environ`); not modified.

    Returns multi-line text: the config as YAML, then every variable ep_plugin asks for (and every
    other NVSHMEM_* / NCCL_* variable already set) with its value and origin (user / config env /
    derived), then notes and warnings. Printed by `ep-plugin config check FILE`.
    """
    environ = os.environ if environ is None else environ
    low_latency = is_low_latency(cfg, low_latency_mode)
    settings, notes = plan_environment(cfg, environ, low_latency_mode)
    requested = {s.name for s in settings}
    others = sorted(name for name in environ
                    if name.startswith(_REPORTED_PREFIXES) and name not in requested and _user_set(environ, name))

    lines = [f"# ep_plugin configuration: {cfg.source or 'built-in defaults'}",
             yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=False).rstrip(), "",
             f"# environment for {'low-latency' if low_latency else 'normal'} mode "
             "(precedence: user > config env > derived)"]
    rows = []
    for s in settings:
        if s.origin == USER:
            detail = f"kept; config asks {s.requested} ({s.reason})" if s.requested is not None else \
                f"same as requested ({s.reason})"
        else:
            detail = s.reason
        rows.append((f"{s.name}={s.value}", s.origin, detail))
    rows += [(f"{name}={environ[name]}", USER, "set outside ep_plugin") for name in others]
    width = min(max(len(row[0]) for row in rows), 44)   # long values (HCA lists) overflow their column
    lines += [f"  {var.ljust(width)}  {origin.ljust(10)}  {detail}" for var, origin, detail in rows]

    version = detect_nccl_version()
    messages = notes + multicast_warnings(environ) + nccl_warnings(cfg, version, environ)
    lines += ["", f"# NCCL: {'.'.join(map(str, version)) if version else 'version unknown (no CUDA here)'}"]
    if version is None and cfg.transport != "nvlink" and "NCCL_RUNTIME_CONNECT" not in environ \
            and "NCCL_RUNTIME_CONNECT" not in cfg.env:
        messages.append("NCCL_RUNTIME_CONNECT is not set: with NCCL >= 2.22 set NCCL_RUNTIME_CONNECT=0 for "
                        "internode runs (see docs/configuration.md, 'NCCL guidance')")
    lines += [f"- {message}" for message in messages] or ["- no warnings"]
    return "\n".join(lines) + "\n"
