"""Config -> NCCL / NVSHMEM environment: transport mapping, precedence, logging, NCCL guidance (CPU, fast)."""
from __future__ import annotations

import dataclasses
import glob
import logging
import os

import pytest

from ep_plugin import environment as E
from ep_plugin.config import CONFIG_ENV_VAR, EpConfig, load_config, validate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
MULTICAST_OFF = {"NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


@pytest.fixture(autouse=True)
def clean_state(monkeypatch):
    """Restore os.environ and ep_plugin's record of what it set, whatever a test did."""
    monkeypatch.delenv(CONFIG_ENV_VAR, raising=False)
    saved = dict(os.environ)
    E._set_by_ep_plugin.clear()
    yield
    os.environ.clear()
    os.environ.update(saved)
    E._set_by_ep_plugin.clear()


def cfg_of(**data):
    return validate(data)


def with_ll(cfg, **changes):
    """As Buffer does: its arguments replace low_latency fields without re-validation."""
    return cfg.replace(low_latency=dataclasses.replace(cfg.low_latency, **changes))


# ---- transport mapping ---------------------------------------------------------------------------

TRANSPORT_CASES = [
    # transport, low_latency_mode, expected subset, names that must be absent
    ("auto", False, {}, {"NVSHMEM_REMOTE_TRANSPORT", "NVSHMEM_IB_ENABLE_IBGDA", "NVSHMEM_IBGDA_NUM_RC_PER_PE",
                         "NVSHMEM_DISABLE_P2P", "NVSHMEM_DISABLE_MNNVL"}),
    ("auto", True, {"NVSHMEM_IB_ENABLE_IBGDA": "1", "NVSHMEM_IBGDA_NUM_RC_PER_PE": "24",
                    "NVSHMEM_DISABLE_P2P": "0", "NVSHMEM_DISABLE_MNNVL": "1"}, {"NVSHMEM_REMOTE_TRANSPORT"}),
    ("nvlink", False, {"NVSHMEM_REMOTE_TRANSPORT": "none", "NVSHMEM_IB_ENABLE_IBGDA": "0",
                       "NVSHMEM_DISABLE_P2P": "0"}, {"NVSHMEM_IBGDA_NUM_RC_PER_PE", "NVSHMEM_DISABLE_MNNVL"}),
    ("nvlink", True, {"NVSHMEM_REMOTE_TRANSPORT": "none", "NVSHMEM_IB_ENABLE_IBGDA": "0",
                      "NVSHMEM_DISABLE_P2P": "0", "NVSHMEM_DISABLE_MNNVL": "1"}, {"NVSHMEM_IBGDA_NUM_RC_PER_PE"}),
    ("ibgda", False, {"NVSHMEM_IB_ENABLE_IBGDA": "1", "NVSHMEM_IBGDA_NUM_RC_PER_PE": "24"},
     {"NVSHMEM_REMOTE_TRANSPORT", "NVSHMEM_DISABLE_P2P", "NVSHMEM_DISABLE_MNNVL"}),
    ("ibgda", True, {"NVSHMEM_IB_ENABLE_IBGDA": "1", "NVSHMEM_IBGDA_NUM_RC_PER_PE": "24",
                     "NVSHMEM_DISABLE_P2P": "0", "NVSHMEM_DISABLE_MNNVL": "1"}, {"NVSHMEM_REMOTE_TRANSPORT"}),
    ("ibrc", False, {"NVSHMEM_REMOTE_TRANSPORT": "ibrc", "NVSHMEM_IB_ENABLE_IBGDA": "0"},
     {"NVSHMEM_IBGDA_NUM_RC_PER_PE", "NVSHMEM_DISABLE_P2P"}),
    ("ibrc", True, {"NVSHMEM_REMOTE_TRANSPORT": "ibrc", "NVSHMEM_IB_ENABLE_IBGDA": "0",
                    "NVSHMEM_DISABLE_P2P": "0", "NVSHMEM_DISABLE_MNNVL": "1"}, {"NVSHMEM_IBGDA_NUM_RC_PER_PE"}),
    ("libfabric", False, {"NVSHMEM_REMOTE_TRANSPORT": "libfabric", "NVSHMEM_IB_ENABLE_IBGDA": "0"},
     {"NVSHMEM_IBGDA_NUM_RC_PER_PE", "NVSHMEM_LIBFABRIC_PROVIDER"}),
    ("libfabric", True, {"NVSHMEM_REMOTE_TRANSPORT": "libfabric", "NVSHMEM_IB_ENABLE_IBGDA": "0",
                         "NVSHMEM_DISABLE_P2P": "0", "NVSHMEM_DISABLE_MNNVL": "1"}, {"NVSHMEM_IBGDA_NUM_RC_PER_PE"}),
    ("ucx", False, {"NVSHMEM_REMOTE_TRANSPORT": "ucx", "NVSHMEM_IB_ENABLE_IBGDA": "0"}, {"NVSHMEM_DISABLE_P2P"}),
    ("ucx", True, {"NVSHMEM_REMOTE_TRANSPORT": "ucx", "NVSHMEM_IB_ENABLE_IBGDA": "0",
                   "NVSHMEM_DISABLE_P2P": "0"}, {"NVSHMEM_IBGDA_NUM_RC_PER_PE"}),
]


@pytest.mark.parametrize("transport,low_latency,expected,absent", TRANSPORT_CASES,
                         ids=[f"{c[0]}-{'ll' if c[1] else 'normal'}" for c in TRANSPORT_CASES])
def test_transport_mapping(transport, low_latency, expected, absent):
    env = E.derived_environment(cfg_of(transport=transport), low_latency_mode=low_latency)
    assert {name: env.get(name) for name in expected} == expected
    assert not absent & set(env), absent & set(env)
    assert {name: env[name] for name in MULTICAST_OFF} == MULTICAST_OFF


def test_low_latency_flags():
    cfg = cfg_of(transport="ibgda", low_latency={"num_qps_per_rank": 8, "allow_nvlink": False, "allow_mnnvl": True})
    env = E.derived_environment(cfg, low_latency_mode=True)
    assert env["NVSHMEM_IBGDA_NUM_RC_PER_PE"] == "8"
    assert env["NVSHMEM_DISABLE_P2P"] == "1"
    assert env["NVSHMEM_DISABLE_MNNVL"] == "0"


def test_mode_comes_from_config_unless_given():
    cfg = cfg_of(mode="low_latency", transport="ibrc")
    assert "NVSHMEM_DISABLE_MNNVL" in E.derived_environment(cfg)
    assert "NVSHMEM_DISABLE_MNNVL" not in E.derived_environment(cfg, low_latency_mode=False)
    assert "NVSHMEM_DISABLE_MNNVL" in E.derived_environment(cfg_of(transport="ibrc"), low_latency_mode=True)


def test_buffer_arguments_reach_the_environment():
    cfg = with_ll(cfg_of(transport="ibgda"), num_qps_per_rank=12, allow_nvlink=False, allow_mnnvl=True)
    env = E.derived_environment(cfg, low_latency_mode=True)
    assert (env["NVSHMEM_IBGDA_NUM_RC_PER_PE"], env["NVSHMEM_DISABLE_P2P"], env["NVSHMEM_DISABLE_MNNVL"]) == \
        ("12", "1", "0")


def test_qps_per_connection():
    ibgda = cfg_of(transport="ibgda", network={"qps_per_connection": 8})
    assert E.derived_environment(ibgda, False)["NVSHMEM_IBGDA_NUM_RC_PER_PE"] == "8"
    assert E.derived_environment(ibgda, True)["NVSHMEM_IBGDA_NUM_RC_PER_PE"] == "24"   # LL: num_qps_per_rank
    _, notes = E.plan_environment(ibgda, {}, low_latency_mode=True)
    assert any("qps_per_connection is not used" in note for note in notes)
    for transport in ("ibrc", "auto"):
        env = E.derived_environment(cfg_of(transport=transport, network={"qps_per_connection": 4}), False)
        assert env["NVSHMEM_IB_NUM_RC_PER_DEVICE"] == "4"
        assert "NVSHMEM_IBGDA_NUM_RC_PER_PE" not in env
    _, notes = E.plan_environment(cfg_of(transport="ucx", network={"qps_per_connection": 4}), {})
    assert any("no effect with transport: ucx" in note for note in notes)


def test_network_keys_map_to_nvshmem_variables():
    cfg = cfg_of(transport="ibgda", network={
        "qp_depth": 2048, "hca_list": ["mlx5_0:1", "mlx5_0:2"], "nic_pe_mapping": True, "multi_port": True,
        "ibgda_nic_handler": "gpu", "gid_index": 3, "traffic_class": 106})
    env = E.derived_environment(cfg, low_latency_mode=False)
    assert env["NVSHMEM_QP_DEPTH"] == "2048"
    assert env["NVSHMEM_HCA_LIST"] == "mlx5_0:1,mlx5_0:2"
    assert env["NVSHMEM_ENABLE_NIC_PE_MAPPING"] == "1"
    assert env["NVSHMEM_IBGDA_ENABLE_MULTI_PORT"] == "1"
    assert env["NVSHMEM_IBGDA_NIC_HANDLER"] == "gpu"
    assert env["NVSHMEM_IB_GID_INDEX"] == "3"
    assert env["NVSHMEM_IB_TRAFFIC_CLASS"] == "106"
    env = E.derived_environment(cfg_of(transport="ibrc", network={"hca_pe_mapping": "mlx5_0:1:2,mlx5_0:2:2",
                                                                  "nic_pe_mapping": False}))
    assert env["NVSHMEM_HCA_PE_MAPPING"] == "mlx5_0:1:2,mlx5_0:2:2"
    assert env["NVSHMEM_ENABLE_NIC_PE_MAPPING"] == "0"
    env = E.derived_environment(cfg_of(transport="libfabric", network={"libfabric_provider": "efa"}))
    assert env["NVSHMEM_LIBFABRIC_PROVIDER"] == "efa"


def test_unset_network_keys_leave_nvshmem_defaults():
    env = E.derived_environment(cfg_of(transport="ibgda"), low_latency_mode=True)
    for name in ("NVSHMEM_QP_DEPTH", "NVSHMEM_HCA_LIST", "NVSHMEM_ENABLE_NIC_PE_MAPPING", "NVSHMEM_IBGDA_NIC_HANDLER",
                 "NVSHMEM_IBGDA_ENABLE_MULTI_PORT", "NVSHMEM_IB_GID_INDEX", "NVSHMEM_LIBFABRIC_PROVIDER"):
        assert name not in env


def test_ibgda_only_keys_without_ibgda_are_noted():
    cfg = cfg_of(transport="auto", network={"multi_port": True})
    assert "NVSHMEM_IBGDA_ENABLE_MULTI_PORT" not in E.derived_environment(cfg, low_latency_mode=False)
    _, notes = E.plan_environment(cfg, {}, low_latency_mode=False)
    assert any("network.multi_port has no effect" in note for note in notes)
    assert E.derived_environment(cfg, low_latency_mode=True)["NVSHMEM_IBGDA_ENABLE_MULTI_PORT"] == "1"


def test_nvlink_transport_with_buffer_disallowing_nvlink_is_noted():
    cfg = with_ll(cfg_of(transport="nvlink"), allow_nvlink=False)
    settings, notes = E.plan_environment(cfg, {}, low_latency_mode=True)
    assert {s.name: s.value for s in settings}["NVSHMEM_DISABLE_P2P"] == "0"
    assert any("contradicts transport: nvlink" in note for note in notes)


# ---- precedence: user > config env > derived -----------------------------------------------------

def test_user_environment_is_never_overridden():
    cfg = cfg_of(transport="ibgda", env={"NCCL_RUNTIME_CONNECT": "0"})
    environ = {"NVSHMEM_IB_ENABLE_IBGDA": "0", "NCCL_RUNTIME_CONNECT": "1", "NCCL_NVLS_ENABLE": "0"}
    applied = E.apply_environment(cfg, low_latency_mode=False, environ=environ, nccl_version=None)
    assert environ["NVSHMEM_IB_ENABLE_IBGDA"] == "0" and environ["NCCL_RUNTIME_CONNECT"] == "1"
    assert not {"NVSHMEM_IB_ENABLE_IBGDA", "NCCL_RUNTIME_CONNECT", "NCCL_NVLS_ENABLE"} & set(applied)
    assert applied["NVSHMEM_DISABLE_NVLS"] == "1" and environ["NVSHMEM_IBGDA_NUM_RC_PER_PE"] == "24"


def test_config_env_beats_derived():
    cfg = cfg_of(transport="ibgda", env={"NVSHMEM_IB_ENABLE_IBGDA": "0", "NVSHMEM_MAX_TEAMS": "7"})
    environ = {}
    E.apply_environment(cfg, low_latency_mode=True, environ=environ, nccl_version=None)
    assert environ["NVSHMEM_IB_ENABLE_IBGDA"] == "0" and environ["NVSHMEM_MAX_TEAMS"] == "7"
    settings, _ = E.plan_environment(cfg, {}, low_latency_mode=True)
    by_name = {s.name: s for s in settings}
    assert by_name["NVSHMEM_IB_ENABLE_IBGDA"].origin == E.CONFIG_ENV
    assert "replaces derived 1" in by_name["NVSHMEM_IB_ENABLE_IBGDA"].reason
    assert by_name["NVSHMEM_IBGDA_NUM_RC_PER_PE"].origin == E.DERIVED


def test_user_beats_config_env_and_records_the_request():
    cfg = cfg_of(env={"NCCL_RUNTIME_CONNECT": "0"})
    settings, _ = E.plan_environment(cfg, {"NCCL_RUNTIME_CONNECT": "1"})
    setting = {s.name: s for s in settings}["NCCL_RUNTIME_CONNECT"]
    assert (setting.value, setting.origin, setting.requested) == ("1", E.USER, "0")
    to_set, kept = E.resolve_environment(cfg, {"NCCL_RUNTIME_CONNECT": "1"})
    assert kept == {"NCCL_RUNTIME_CONNECT": "1"} and "NCCL_RUNTIME_CONNECT" not in to_set


def test_requested_environment_merges_config_env_over_derived():
    cfg = cfg_of(transport="nvlink", env={"NVSHMEM_REMOTE_TRANSPORT": "ibrc", "X": "1"})
    env = E.requested_environment(cfg)
    assert env["NVSHMEM_REMOTE_TRANSPORT"] == "ibrc" and env["X"] == "1"


def test_apply_is_idempotent():
    cfg = load_config(os.path.join(ROOT, "configs", "low_latency_ibgda.yaml"))
    environ = {}
    first = E.apply_environment(cfg, environ=environ, nccl_version=None)
    assert first and environ == {**first}
    assert E.apply_environment(cfg, environ=environ, nccl_version=None) == {}


def test_process_environment_tracks_what_ep_plugin_set():
    names = ["NVSHMEM_DISABLE_P2P", "NVSHMEM_DISABLE_MNNVL", *MULTICAST_OFF, "NVSHMEM_REMOTE_TRANSPORT",
             "NVSHMEM_IB_ENABLE_IBGDA", "NVSHMEM_IBGDA_NUM_RC_PER_PE"]
    for name in names:
        os.environ.pop(name, None)
    cfg = cfg_of(transport="ibrc")
    assert E.apply_environment(cfg, low_latency_mode=True, nccl_version=None)["NVSHMEM_DISABLE_P2P"] == "0"
    # A second buffer with other arguments may update what ep_plugin set itself ...
    applied = E.apply_environment(with_ll(cfg, allow_nvlink=False), low_latency_mode=True, nccl_version=None)
    assert applied == {"NVSHMEM_DISABLE_P2P": "1"} and os.environ["NVSHMEM_DISABLE_P2P"] == "1"
    # ... but never a value the user changed since.
    os.environ["NVSHMEM_DISABLE_P2P"] = "0"
    assert E.apply_environment(with_ll(cfg, allow_nvlink=False), low_latency_mode=True, nccl_version=None) == {}
    assert os.environ["NVSHMEM_DISABLE_P2P"] == "0"


# ---- logging -------------------------------------------------------------------------------------

def test_apply_logs_one_line_for_set_and_one_for_kept(caplog):
    cfg = cfg_of(transport="ibgda", env={"NCCL_RUNTIME_CONNECT": "0"})
    with caplog.at_level(logging.INFO, logger="ep_plugin"):
        E.apply_environment(cfg, low_latency_mode=False, environ={"NVSHMEM_IB_ENABLE_IBGDA": "0"}, nccl_version=None)
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(info) == 2
    assert info[0].startswith("ep_plugin env: set ") and "NCCL_RUNTIME_CONNECT=0 (config env)" in info[0]
    assert "NVSHMEM_DISABLE_NVLS=1 (derived)" in info[0]
    assert info[1] == "ep_plugin env: kept user values NVSHMEM_IB_ENABLE_IBGDA=0 (config wanted 1)"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_apply_warns_about_multicast_and_nccl(caplog):
    with caplog.at_level(logging.INFO, logger="ep_plugin"):
        E.apply_environment(cfg_of(), environ={"NCCL_NVLS_ENABLE": "1"}, nccl_version=(2, 27, 3))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("NCCL_NVLS_ENABLE=1 in your environment enables NVLink multicast" in w for w in warnings)
    assert any("NCCL_RUNTIME_CONNECT=0" in w and "2.27.3" in w for w in warnings)


def test_apply_detects_nccl_version_safely():
    environ = {}
    E.apply_environment(cfg_of(), environ=environ)      # CPU: no CUDA, no version, no error
    assert environ["NVSHMEM_DISABLE_NVLS"] == "1"


# ---- NCCL guidance -------------------------------------------------------------------------------

@pytest.mark.parametrize("version,environ,cfg_env,transport,warns", [
    (None, {}, {}, "auto", False),
    ((2, 21, 5), {}, {}, "auto", False),
    ((2, 22, 0), {}, {}, "auto", True),
    ((2, 28, 9), {}, {}, "ibgda", True),
    ((3, 0, 0), {}, {}, "ibrc", True),
    (22203, {}, {}, "auto", True),
    (2708, {}, {}, "auto", False),
    ("2.23.4+cuda12.4", {}, {}, "auto", True),
    ((2, 27, 3), {"NCCL_RUNTIME_CONNECT": "0"}, {}, "auto", False),
    ((2, 27, 3), {"NCCL_RUNTIME_CONNECT": "1"}, {}, "auto", False),    # the user decided
    ((2, 27, 3), {}, {"NCCL_RUNTIME_CONNECT": "0"}, "ibgda", False),
    ((2, 27, 3), {}, {}, "nvlink", False),                              # no internode traffic
])
def test_nccl_warnings(version, environ, cfg_env, transport, warns):
    messages = E.nccl_warnings(cfg_of(transport=transport, env=cfg_env), version, environ)
    assert bool(messages) == warns
    if warns:
        assert len(messages) == 1 and "NCCL_RUNTIME_CONNECT=0" in messages[0]
        assert "NCCL_IB_QPS_PER_CONNECTION=4" in messages[0] and "NCCL_MAX_NCHANNELS=4" in messages[0]


@pytest.mark.parametrize("raw,expected", [
    ((2, 22, 3), (2, 22, 3)), ([2, 21, 5], (2, 21, 5)), (22203, (2, 22, 3)), (21803, (2, 18, 3)),
    (2708, (2, 7, 8)), ("2.19.3", (2, 19, 3)), ("garbage", None), (None, None),
])
def test_nccl_version_tuple(raw, expected):
    assert E.nccl_version_tuple(raw) == expected


def test_detect_nccl_version(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert E.detect_nccl_version() is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 26, 2))
    assert E.detect_nccl_version() == (2, 26, 2)

    def broken():
        raise RuntimeError("no NCCL")
    monkeypatch.setattr(torch.cuda.nccl, "version", broken)
    assert E.detect_nccl_version() is None


# ---- describe_config -----------------------------------------------------------------------------

def test_describe_config_reports_variables_and_origins():
    path = os.path.join(ROOT, "configs", "normal_ibgda.yaml")
    cfg = load_config(path)
    environ = {"NVSHMEM_IB_ENABLE_IBGDA": "0", "NVSHMEM_DEBUG": "WARN", "HOME": "/root"}
    before = dict(environ)
    text = E.describe_config(cfg, environ=environ)
    assert environ == before                                     # describing changes nothing
    assert path in text and "transport: ibgda" in text and "num_sms: 24" in text
    lines = {line.split()[0]: line for line in text.splitlines() if line.startswith("  ") and "=" in line}
    assert "derived" in lines["NVSHMEM_DISABLE_NVLS=1"]
    assert "derived" in lines["NVSHMEM_IBGDA_NUM_RC_PER_PE=24"]
    assert "config env" in lines["NCCL_RUNTIME_CONNECT=0"]
    assert "user" in lines["NVSHMEM_IB_ENABLE_IBGDA=0"] and "config asks 1" in lines["NVSHMEM_IB_ENABLE_IBGDA=0"]
    assert "user" in lines["NVSHMEM_DEBUG=WARN"]
    assert not any(name.startswith("HOME") for name in lines)
    assert "normal mode" in text


def test_describe_config_low_latency_and_warnings():
    cfg = cfg_of(transport="ibgda")
    text = E.describe_config(cfg, low_latency_mode=True, environ={"NVSHMEM_DISABLE_NVLS": "0"})
    assert "low-latency mode" in text
    assert "NVSHMEM_DISABLE_MNNVL=1" in text and "NVSHMEM_DISABLE_P2P=0" in text
    assert "enables NVLink multicast" in text
    assert "NCCL_RUNTIME_CONNECT" in text                        # guidance even when the version is unknown


@pytest.mark.parametrize("path", SHIPPED, ids=os.path.basename)
def test_describe_every_shipped_config(path):
    text = E.describe_config(load_config(path), environ={})
    for name, value in MULTICAST_OFF.items():
        assert f"{name}={value}" in text
    assert os.path.basename(path) in text


def test_defaults_describe_without_environ_argument():
    assert "built-in defaults" in E.describe_config(EpConfig())
