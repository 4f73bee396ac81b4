"""The YAML config: schema, precedence, shipped files and every validation error path (CPU, fast)."""
from __future__ import annotations

import dataclasses
import glob
import os
import re
import textwrap

import pytest
import yaml

from ep_plugin.config import (CONFIG_ENV_VAR, ConfigError, EpConfig, LowLatencySection, NetworkSection, as_config,
                              default_items, load_config, validate)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
EXPECTED_SHIPPED = {"default.yaml", "normal_nvlink.yaml", "low_latency_nvlink.yaml", "normal_ibgda.yaml",
                    "normal_ibrc_dual_port.yaml", "low_latency_ibgda.yaml", "low_latency_efa.yaml"}


@pytest.fixture(autouse=True)
def no_config_env(monkeypatch):
    monkeypatch.delenv(CONFIG_ENV_VAR, raising=False)


def write(tmp_path, text, name="cfg.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return str(path)


def flatten(data, prefix=""):
    keys = set()
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and key != "env":
            keys |= flatten(value, dotted + ".")
        else:
            keys.add(dotted)
    return keys


# ---- defaults and shipped files ------------------------------------------------------------------

def test_defaults_without_file():
    cfg = load_config()
    assert cfg == EpConfig()
    assert cfg.source is None


def test_shipped_set_is_complete():
    assert EXPECTED_SHIPPED <= {os.path.basename(p) for p in SHIPPED}


@pytest.mark.parametrize("path", SHIPPED, ids=os.path.basename)
def test_shipped_config_loads(path):
    cfg = load_config(path)
    assert cfg.source == path
    assert validate(cfg.to_dict()) == cfg            # round trip through a plain mapping
    yaml.safe_dump(cfg.to_dict())                     # describable as YAML


def test_default_yaml_lists_every_key_with_its_default():
    path = os.path.join(ROOT, "configs", "default.yaml")
    with open(path) as handle:
        data = yaml.safe_load(handle)
    assert flatten(data) == {key for key, _ in default_items()}
    assert load_config(path) == EpConfig()


def test_docs_mention_every_key():
    with open(os.path.join(ROOT, "docs", "configuration.md")) as handle:
        text = handle.read()
    missing = [key for key, _ in default_items() if f"`{key}`" not in text]
    assert not missing, f"docs/configuration.md does not document {missing}"


def test_native_code_reads_no_environment_variable():
    """Settings reach the native code through the YAML config and the runtime constructors, never the
    environment: csrc reads no variable (getenv) and names no EP_PLUGIN_* switch or diagnostic macro."""
    sources = glob.glob(os.path.join(ROOT, "csrc", "**", "*.*"), recursive=True)
    assert any(path.endswith("runtime.cu") for path in sources), "csrc not found"
    found = []
    for path in sources:
        with open(path) as handle:
            text = handle.read()
        names = re.findall(r"\bgetenv\s*\(|\bEP_PLUGIN_[A-Z0-9_]+", text)
        # EP_PLUGIN_HAS_BULK_COPIES: set by common/ptx.cuh from the target architecture.
        found += [f"{os.path.relpath(path, ROOT)}: {m}" for m in names if m != "EP_PLUGIN_HAS_BULK_COPIES"]
    assert not found, f"csrc reads the environment or names a switch: {found}"


@pytest.mark.parametrize("path", [p for p in SHIPPED if "nvlink" not in p and "default" not in p],
                         ids=os.path.basename)
def test_network_configs_carry_nccl_guidance(path):
    assert load_config(path).env.get("NCCL_RUNTIME_CONNECT") == "0"


# ---- precedence: defaults < file < overrides -----------------------------------------------------

def test_file_beats_defaults_and_overrides_beat_file(tmp_path):
    path = write(tmp_path, """
        num_sms: 32
        transport: ibgda
        low_latency: {use_fp8: false, num_experts: 64}
        env: {A: "1", B: "2"}
    """)
    cfg = load_config(path)
    assert (cfg.num_sms, cfg.transport, cfg.low_latency.use_fp8, cfg.low_latency.num_experts) == (32, "ibgda", False, 64)
    assert cfg.low_latency.max_dispatch_tokens_per_rank == 128       # untouched default
    cfg = load_config(path, overrides={"num_sms": 16, "low_latency.num_experts": 128, "env": {"B": "3", "C": "4"}})
    assert cfg.num_sms == 16
    assert cfg.low_latency.num_experts == 128 and cfg.low_latency.use_fp8 is False   # merged, not replaced
    assert cfg.env == {"A": "1", "B": "3", "C": "4"}
    assert cfg.source == path
    cfg = load_config(path, overrides={"low_latency": {"use_fp8": True}, "env.D": 5})
    assert cfg.low_latency.use_fp8 is True and cfg.low_latency.num_experts == 64
    assert cfg.env["D"] == "5"


def test_overrides_accept_section_instances():
    cfg = load_config(overrides={"low_latency": LowLatencySection(use_fp8=False)})
    assert cfg.low_latency.use_fp8 is False


def test_environment_variable_selects_file(tmp_path, monkeypatch):
    path = write(tmp_path, "num_sms: 40\n")
    monkeypatch.setenv(CONFIG_ENV_VAR, path)
    assert load_config().num_sms == 40
    assert as_config(None).num_sms == 40
    assert load_config(write(tmp_path, "num_sms: 8\n", "other.yaml")).num_sms == 8   # explicit path wins
    assert as_config({"num_sms": 6}).num_sms == 6                                    # a mapping stands alone


def test_environment_variable_names_missing_file(tmp_path, monkeypatch):
    missing = str(tmp_path / "nope.yaml")
    monkeypatch.setenv(CONFIG_ENV_VAR, missing)
    with pytest.raises(ConfigError, match="nope.yaml: no such config file"):
        load_config()


def test_empty_file_gives_defaults(tmp_path):
    assert load_config(write(tmp_path, "# nothing\n")) == EpConfig()


def test_as_config_forms(tmp_path):
    cfg = EpConfig(num_sms=8)
    assert as_config(cfg) is cfg
    path = write(tmp_path, "num_sms: 10\n")
    assert as_config(path).num_sms == 10
    import pathlib
    assert as_config(pathlib.Path(path)).num_sms == 10
    assert as_config({"low_latency": {"use_fp8": False}}).low_latency.use_fp8 is False
    assert as_config({"low_latency.use_fp8": False, "network.qp_depth": 2048}).network.qp_depth == 2048
    with pytest.raises(ConfigError, match="expected an EpConfig, a YAML path or a mapping"):
        as_config(5)


def test_direct_dispatch_and_network_put_keys():
    config = as_config({"dispatch": {"direct_max_blocks": 0, "direct_chunk_tokens": 3},
                        "network": {"force_puts": True}})
    assert (config.dispatch.direct_max_blocks, config.dispatch.direct_chunk_tokens) == (0, 3)
    assert config.network.force_puts is True
    defaults = as_config({})
    assert (defaults.dispatch.direct_max_blocks, defaults.dispatch.direct_chunk_tokens) == (16, 1)
    assert defaults.network.force_puts is False
    assert not hasattr(defaults.combine, "direct_max_blocks")


def test_env_values_are_strings():
    cfg = validate({"env": {"A": True, "B": False, "C": 3, "D": 1.5, "E": "x"}})
    assert cfg.env == {"A": "1", "B": "0", "C": "3", "D": "1.5", "E": "x"}


def test_hca_lists_are_normalized():
    net = validate({"network": {"hca_list": [" mlx5_0:1", "mlx5_0:2 "]}}).network
    assert net.hca_list == "mlx5_0:1,mlx5_0:2"
    assert validate({"network": {"hca_list": "^mlx5_2, mlx5_3"}}).network.hca_list == "^mlx5_2,mlx5_3"
    assert validate({"network": {"hca_pe_mapping": ["mlx5_0:1:2", "mlx5_0:2:2"]}}).network.hca_pe_mapping == \
        "mlx5_0:1:2,mlx5_0:2:2"
    assert validate({"network": NetworkSection(qp_depth=512)}).network.qp_depth == 512


# ---- error paths: one ConfigError naming the file, the dotted key and what is allowed --------------

ERRORS = [
    # unknown keys, top level and nested
    ("nmu_sms: 4", "nmu_sms", "unknown key; allowed"),
    ("low_latency: {use_fp9: true}", "low_latency.use_fp9", "unknown key; allowed"),
    ("network: {hca: mlx5_0}", "network.hca", "unknown key; allowed: force_puts, gid_index, hca_list"),
    ("dispatch: {chunk: 4}", "dispatch.chunk", "unknown key"),
    ("topology: {nodes: 2}", "topology.nodes", "unknown key"),
    # wrong types and impossible values, top level
    ("num_sms: '24'", "num_sms", "expected an integer"),
    ("num_sms: 24.0", "num_sms", "expected an integer"),
    ("num_sms: true", "num_sms", "expected an integer"),
    ("num_sms: 23", "num_sms", "must be even"),
    ("num_sms: 0", "num_sms", "must be >= 2"),
    ("num_sms: 130", "num_sms", "must be <= 128"),
    ("mode: decode", "mode", "expected one of normal, low_latency"),
    ("mode: [normal]", "mode", "expected one of"),
    ("backend: cuda", "backend", "expected one of auto, native, reference"),
    ("transport: infiniband", "transport", "expected one of auto, nvlink, ibgda, ibrc, libfabric, ucx"),
    ("log_level: verbose", "log_level", "expected one of debug"),
    ("timeout_s: 0", "timeout_s", "in (0, 86400]"),
    ("timeout_s: -3", "timeout_s", "in (0, 86400]"),
    ("timeout_s: '10'", "timeout_s", "in (0, 86400]"),
    ("timeout_s: true", "timeout_s", "in (0, 86400]"),
    ("timeout_s: 1.0e6", "timeout_s", "in (0, 86400]"),
    ("check_inputs: 'yes'", "check_inputs", "expected true or false"),
    # sections of the wrong type
    ("buffer: 5", "buffer", "expected a mapping"),
    ("buffer: false", "buffer", "expected a mapping"),
    ("low_latency: [1, 2]", "low_latency", "expected a mapping"),
    ("network: mlx5_0", "network", "expected a mapping"),
    # buffer
    ("buffer: {max_hidden: 4}", "buffer.max_hidden", "must be >= 8"),
    ("buffer: {max_hidden: '7168'}", "buffer.max_hidden", "expected an integer"),
    ("buffer: {num_nvl_bytes: -1}", "buffer.num_nvl_bytes", "must be >= 0"),
    ("buffer: {num_rdma_bytes: -5}", "buffer.num_rdma_bytes", "must be >= 0"),
    ("buffer: {num_rdma_bytes: big}", "buffer.num_rdma_bytes", "expected an integer or 'auto'"),
    ("buffer: {combine_staging_tokens: -1}", "buffer.combine_staging_tokens", "must be >= 0"),
    ("buffer: {combine_staging_tokens: 40000}", "buffer.combine_staging_tokens", "must be <= 32768"),
    ("buffer: {combine_staging_tokens: many}", "buffer.combine_staging_tokens", "expected an integer or 'auto'"),
    # tuning
    ("dispatch: {nvl_chunked_send_tokens: 0}", "dispatch.nvl_chunked_send_tokens", "must be >= 1"),
    ("dispatch: {nvl_chunked_recv_tokens: 1.5}", "dispatch.nvl_chunked_recv_tokens", "expected an integer or null"),
    ("dispatch: {nvl_chunked_send_tokens: 9, nvl_chunked_recv_tokens: 8}", "dispatch.nvl_chunked_send_tokens",
     "must not exceed nvl_chunked_recv_tokens (8)"),
    ("combine: {rdma_chunked_send_tokens: 64, rdma_chunked_recv_tokens: 32}", "combine.rdma_chunked_send_tokens",
     "must not exceed rdma_chunked_recv_tokens (32)"),
    ("dispatch: {direct_max_blocks: -1}", "dispatch.direct_max_blocks", "must be >= 0"),
    ("dispatch: {direct_max_blocks: 129}", "dispatch.direct_max_blocks", "must be <= 128"),
    ("dispatch: {direct_max_blocks: auto}", "dispatch.direct_max_blocks", "expected an integer"),
    ("dispatch: {direct_chunk_tokens: 0}", "dispatch.direct_chunk_tokens", "must be >= 1"),
    ("combine: {direct_chunk_tokens: 2}", "combine.direct_chunk_tokens", "unknown key"),
    ("network: {force_puts: 1}", "network.force_puts", "expected true or false"),
    # low latency
    ("low_latency: {use_ue8m0: true}", "low_latency.use_ue8m0", "needs round_scale: true"),
    ("low_latency: {use_ue8m0: true, round_scale: true, use_fp8: false}", "low_latency.use_ue8m0",
     "only exist with use_fp8: true"),
    ("low_latency: {num_qps_per_rank: 0}", "low_latency.num_qps_per_rank", "must be >= 1"),
    ("low_latency: {num_experts: 0}", "low_latency.num_experts", "must be >= 1"),
    ("low_latency: {expert_sums_partials: fp16}", "low_latency.expert_sums_partials", "expected one of bf16, fp32"),
    ("low_latency: {max_dispatch_tokens_per_rank: -1}", "low_latency.max_dispatch_tokens_per_rank", "must be >= 1"),
    ("low_latency: {allow_nvlink: 'no'}", "low_latency.allow_nvlink", "expected true or false"),
    ("low_latency: {use_fp8: 1}", "low_latency.use_fp8", "expected true or false"),
    # topology
    ("topology: {ranks_per_node: 0}", "topology.ranks_per_node", "must be >= 1"),
    # network
    ("network: {qps_per_connection: 0}", "network.qps_per_connection", "must be >= 1"),
    ("network: {qps_per_connection: '4'}", "network.qps_per_connection", "expected an integer or null"),
    ("network: {qp_depth: 64}", "network.qp_depth", "must be >= 128"),
    ("network: {qp_depth: 65536}", "network.qp_depth", "must be <= 32768"),
    ("network: {hca_list: 'mlx5_0:x'}", "network.hca_list", "not of the form 'name' or 'name:port'"),
    ("network: {hca_list: 'mlx5_0:0'}", "network.hca_list", "not of the form"),
    ("network: {hca_list: 5}", "network.hca_list", "expected a string or a list of strings"),
    ("network: {hca_list: ''}", "network.hca_list", "at least one entry"),
    ("network: {hca_list: [mlx5_0:1, ^mlx5_1]}", "network.hca_list", "'^' may only prefix the first entry"),
    ("network: {hca_list: 'mlx5_0:1,,mlx5_1:1'}", "network.hca_list", "entry '' is not of the form"),
    ("network: {hca_pe_mapping: 'mlx5_0:1'}", "network.hca_pe_mapping", "'name:port:count'"),
    ("network: {hca_list: mlx5_0, hca_pe_mapping: 'mlx5_0:1:2'}", "network.hca_pe_mapping",
     "cannot be combined with network.hca_list"),
    ("network: {nic_pe_mapping: 'yes'}", "network.nic_pe_mapping", "expected true or false or null"),
    ("network: {multi_port: 1}", "network.multi_port", "expected true or false or null"),
    ("network: {ibgda_nic_handler: dpu}", "network.ibgda_nic_handler",
     "expected one of auto, gpu, cpu, cpu_host_memory, or null"),
    ("network: {libfabric_provider: tcp}", "network.libfabric_provider", "expected one of cxi, efa, verbs"),
    ("network: {gid_index: -1}", "network.gid_index", "must be >= 0"),
    ("network: {traffic_class: 256}", "network.traffic_class", "must be <= 255"),
    # contradictions across sections
    ("transport: nvlink\nlow_latency: {allow_nvlink: false}", "low_latency.allow_nvlink",
     "contradicts transport: nvlink"),
    ("transport: nvlink\nnetwork: {hca_list: mlx5_0}", "network.hca_list", "transport: nvlink uses no network"),
    ("transport: ibgda\nnetwork: {libfabric_provider: efa}", "network.libfabric_provider",
     "only used with transport: libfabric"),
    ("transport: ibrc\nnetwork: {multi_port: true}", "network.multi_port", "only used by IBGDA"),
    ("transport: libfabric\nnetwork: {ibgda_nic_handler: gpu}", "network.ibgda_nic_handler", "only used by IBGDA"),
    # env
    ("env: [A]", "env", "expected a mapping of variable names to values"),
    ("env: {1ABC: x}", "env.1ABC", "not a valid environment variable name"),
    ("env: {A-B: x}", "env.A-B", "not a valid environment variable name"),
    ("env: {'A B': x}", "env.A B", "not a valid environment variable name"),
    ("env: {'É': x}", "env.É", "not a valid environment variable name"),
    ("env: {12: x}", "env.12", "not a valid environment variable name"),
    ("env: {A: [1]}", "env.A", "expected a string or number"),
    ("env: {A: null}", "env.A", "expected a string or number"),
    ("env: {NCCL_NVLS_ENABLE: '1'}", "env.NCCL_NVLS_ENABLE", "keeps NVLink multicast off"),
    ("env: {NVSHMEM_DISABLE_NVLS: '0'}", "env.NVSHMEM_DISABLE_NVLS", "the only allowed value is '1'"),
    ("env: {NVSHMEM_DISABLE_NVLS: false}", "env.NVSHMEM_DISABLE_NVLS", "keeps NVLink multicast off"),
    ("env: {TORCH_SYMM_MEM_DISABLE_MULTICAST: 0}", "env.TORCH_SYMM_MEM_DISABLE_MULTICAST", "multicast off"),
]


@pytest.mark.parametrize("text,key,fragment", ERRORS, ids=[e[1] + ":" + e[0][:30] for e in ERRORS])
def test_validation_error(tmp_path, text, key, fragment):
    path = write(tmp_path, text + "\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: key '{key}': "), message
    assert fragment in message, message
    assert "\n" not in message


@pytest.mark.parametrize("text,fragment", [
    ("- a\n- b\n", "the top level must be a mapping, got list"),
    ("just a string\n", "the top level must be a mapping, got str"),
    ("a: [1\n", "not valid YAML"),
    ("num_sms: 4\nnum_sms: 6\n", "duplicate key 'num_sms'"),
    ("low_latency:\n  use_fp8: true\n  use_fp8: false\n", "duplicate key 'use_fp8'"),
])
def test_file_level_errors(tmp_path, text, fragment):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: ") and fragment in str(info.value)


def test_unreadable_paths(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match="cannot read the config file"):
        load_config(str(tmp_path))


def test_errors_from_overrides_name_the_overrides(tmp_path):
    path = write(tmp_path, "num_sms: 24\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(path)} \+ overrides: key 'num_sms': must be even"):
        load_config(path, overrides={"num_sms": 3})
    with pytest.raises(ConfigError, match=r"^<defaults> \+ overrides: key 'low_latency.bogus': unknown key"):
        load_config(overrides={"low_latency.bogus": 1})
    bad = write(tmp_path, "num_sms: 3\n", "bad.yaml")
    with pytest.raises(ConfigError, match=rf"^{re.escape(bad)}: key 'num_sms'"):       # the file's own error first
        load_config(bad, overrides={"num_sms": 4})


@pytest.mark.parametrize("overrides,fragment", [
    ({"num_sms": 4, "num_sms.x": 1}, "conflicts with the value given for 'num_sms'"),
    ({"low_latency.use_fp8": False, "low_latency": 5}, "conflicts with the dotted keys"),
    ({"low_latency..use_fp8": False}, "not a valid dotted key"),
    ({3: 1}, "keys must be strings"),
])
def test_bad_override_keys(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_config(overrides=overrides)


def test_mapping_errors_name_the_mapping():
    with pytest.raises(ConfigError, match=r"^<mapping>: key 'low_latency.bogus': unknown key"):
        as_config({"low_latency": {"bogus": 1}})
    with pytest.raises(ConfigError, match=r"^<mapping>: key 'network.qp_depth': must be >= 128"):
        as_config({"network.qp_depth": 1})
    with pytest.raises(ConfigError, match=r"^<mapping>: the top level"):
        validate([1, 2], source="<mapping>")


def test_to_dict_has_no_source():
    data = load_config(SHIPPED[0]).to_dict()
    assert "source" not in data and set(data) == {f.name for f in dataclasses.fields(EpConfig)} - {"source"}


# ---- the `dispatch:` / `combine:` tuning reaches the calls -------------------------------------------
TUNED = {"backend": "reference", "num_sms": 20,
         "dispatch": {"nvl_chunked_send_tokens": 4, "nvl_chunked_recv_tokens": 128},
         "combine": {"nvl_chunked_send_tokens": 5, "nvl_chunked_recv_tokens": 160}}


def configs_seen_by_the_backend(rank: int, world_size: int, group) -> dict:
    import torch
    from ep_plugin import Buffer

    buffer = Buffer.from_config(group, TUNED, explicitly_destroy=True)
    seen = {}
    for name in ("dispatch", "cached_dispatch", "combine"):
        def recording(*args, _call=getattr(buffer._backend, name), _name=name):
            seen[_name] = args[-1]  # every backend call takes the Config last
            return _call(*args)
        setattr(buffer._backend, name, recording)
    topk_idx = torch.tensor([[0, 1], [1, -1], [0, -1]])
    x = torch.randn(3, 16).to(torch.bfloat16)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, 2)
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                 num_tokens_per_expert=per_expert, topk_idx=topk_idx)
    buffer.dispatch(x, handle=handle)
    buffer.combine(recv_x, handle)
    buffer.destroy()
    return {name: (c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens)
            for name, c in seen.items()}


def test_yaml_tuning_is_what_dispatch_and_combine_use():
    """The buffer is sized from the YAML tuning, so calls without a Config must use that tuning too."""
    from ep_plugin.launch import parallel_launch

    seen = parallel_launch(1, configs_seen_by_the_backend, backend="gloo")[0]
    assert seen == {"dispatch": (20, 4, 128), "cached_dispatch": (20, 4, 128), "combine": (20, 5, 160)}


def test_default_ring_tuning_by_rank_count():
    """Sub-ring sizes of the normal-mode defaults (send / recv tokens): the SM combine takes 9 / 256 at 2-8 ranks
    (measured at 2 and 4, docs/performance.md); dispatch and internode keep theirs."""
    from ep_plugin import Buffer
    from ep_plugin.tuning import default_combine_config, default_dispatch_config

    def rings(config):
        return config.num_max_nvl_chunked_send_tokens, config.num_max_nvl_chunked_recv_tokens

    for ranks, dispatch, combine in ((2, (4, 128), (9, 256)), (3, (6, 128), (9, 256)), (4, (6, 128), (9, 256)),
                                     (8, (6, 128), (9, 256)), (16, (6, 128), (6, 128))):
        assert rings(default_dispatch_config(24, ranks)) == dispatch, ranks
        assert rings(default_combine_config(24, ranks)) == combine, ranks
    # A config section still overrides the default.
    tuned = Buffer._combine_config_for(as_config({"combine": {"nvl_chunked_recv_tokens": 512}}), 4)
    assert rings(tuned) == (9, 512)
