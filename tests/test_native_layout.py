"""The Python size hints mirror csrc/kernels/buffer_layout.cuh (runs wherever ep_plugin._C imports, CI included)."""
import itertools

import pytest

from ep_plugin import tuning
from ep_plugin.tuning import Config

_C = pytest.importorskip("ep_plugin._C", reason="the native extension is not built here")


def test_limits_match_the_extension():
    assert tuning.NUM_MAX_NVL_PEERS == _C.MAX_NVL_PEERS
    assert tuning.MAX_CHANNELS == _C.MAX_CHANNELS
    assert tuning.MAX_TOPK == _C.MAX_TOPK
    assert tuning.MAX_LOCAL_EXPERTS == _C.MAX_LOCAL_EXPERTS
    assert tuning.WARPS_PER_CHANNEL == _C.WARPS_PER_CHANNEL
    assert tuning.SLOT_META_BYTES == _C.SLOT_META_BYTES
    assert tuning.SLOT_PAYLOAD_OFFSET == _C.SLOT_PAYLOAD_OFFSET
    assert tuning.NVL_HEADER_BYTES == _C.NVL_HEADER_BYTES
    assert tuning.STAGING_ROWS_PER_PIECE == _C.STAGING_ROWS_PER_PIECE
    assert tuning.MAX_STAGING_SLOTS == _C.MAX_STAGING_SLOTS


@pytest.mark.parametrize("num_ranks", [1, 2, 4, 8])
def test_staging_rows_match_the_kernels(num_ranks):
    for size, hidden in itertools.product([0, 1 << 20, 15 << 20, 59 << 20, 1 << 32], [8, 2048, 7168, 8192]):
        assert tuning.staging_rows(size, num_ranks, hidden) == _C.staging_rows(num_ranks, size, hidden)


@pytest.mark.parametrize("tokens,max_hidden", [(4096, 7168), (1000, 2048), (100, 7168), (40000, 4096)])
def test_staging_area_holds_the_configured_rows(tokens, max_hidden):
    from ep_plugin.config import BufferSection
    section = BufferSection(max_hidden=max_hidden, combine_staging_tokens=tokens)
    rows = tuning.staging_rows(tuning.staging_bytes(section, 2), 2, max_hidden)
    assert rows == min(tuning.MAX_STAGING_SLOTS, max(2, -(-tokens // 512))) * 512
    assert tuning.staging_bytes(section, 1) == 0
    assert tuning.staging_bytes(BufferSection(combine_staging_tokens=0), 2) == 0


def test_staging_area_at_two_to_four_ranks():
    """The copy-engine combine runs at 2 ranks (rows copied into the owner) and at 3-4 (rows pulled by the
    owner); at more ranks the SM combine does, whatever the setting."""
    from ep_plugin.config import BufferSection
    auto = BufferSection()
    assert auto.combine_staging_tokens == "auto"
    explicit = BufferSection(combine_staging_tokens=1024)
    for num_ranks in (2, 3, 4):
        assert tuning.staging_rows(tuning.staging_bytes(auto, num_ranks), num_ranks, auto.max_hidden) == 4096
        assert tuning.staging_rows(tuning.staging_bytes(explicit, num_ranks), num_ranks, explicit.max_hidden) == 1024
        assert tuning.pulls_rows(num_ranks) == (num_ranks > 2)
    for num_ranks in (1, 5, 8):
        assert tuning.staging_bytes(auto, num_ranks) == 0
        assert tuning.staging_bytes(explicit, num_ranks) == 0


@pytest.mark.parametrize("hidden_bytes,num_ranks",
                         list(itertools.product([16, 3072, 5760, 14336, 16384], [1, 2, 4, 8, 16])))
def test_nvl_size_hint_matches_the_kernels(hidden_bytes, num_ranks):
    for num_sms, recv_tokens in itertools.product([2, 16, 24, 48, 128], [1, 16, 64, 250, 256]):
        config = Config(num_sms, 1, recv_tokens)
        assert config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks) == \
            _C.nvl_buffer_size_hint(hidden_bytes, num_ranks, num_sms, recv_tokens)


def test_default_buffer_for_deepseek_sizes_stays_small():
    # 7168 bf16 hidden, 24 SMs, two ranks: tens of MB, not a GB.
    size = Config(24, 8, 64).get_nvl_buffer_size_hint(7168 * 2, 2)
    assert size < 32 << 20


ARGS_STRUCTS = [("_C", name) for name in ("NotifyArgs", "DispatchArgs", "CombineArgs", "StagedReduceArgs")] + \
    [("_C_nvshmem", name) for name in ("DispatchArgs", "CombineArgs", "InternodeNotifyArgs", "InternodeDispatchArgs",
                                       "InternodeCombineArgs")]


@pytest.mark.parametrize("module,name", ARGS_STRUCTS, ids=[f"{m}.{n}" for m, n in ARGS_STRUCTS])
def test_args_structs_start_empty_and_keep_what_python_sets(module, name):
    """Python fills the kernels' Args structs field by field: integers as they are, tensors as addresses."""
    extension = pytest.importorskip(f"ep_plugin.{module}", reason=f"ep_plugin.{module} is not built here")
    args = getattr(extension, name)()
    fields = [f for f in dir(args) if not f.startswith("_")]
    assert fields and all(getattr(args, f) == 0 for f in fields), "a new Args struct must be all zeros"
    # Flags take True; every other field a distinct multiple of 256 (an aligned address or a count).
    wanted = {f: True if isinstance(getattr(args, f), bool) else 256 * i for i, f in enumerate(fields, start=1)}
    for field, value in wanted.items():
        setattr(args, field, value)
    assert {f: getattr(args, f) for f in fields} == wanted


def test_row_layout_packs_what_notify_compares():
    word = _C.pack_row_layout(14336, 56, 8, True)
    assert word >> 32 == 14336 and (word >> 8) & 0xFFFFFF == 56 and (word >> 1) & 0x7F == 8 and word & 1 == 1
    assert _C.pack_row_layout(14336, 56, 8, False) == word - 1
