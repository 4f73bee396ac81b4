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
    assert tuning.NVL_HEADER_BYTES == _C.NVL_HEADER_BYTES


@pytest.mark.parametrize("hidden_bytes,num_ranks", itertools.product([16, 3072, 5760, 14336, 16384], [1, 2, 4, 8, 16]))
def test_nvl_size_hint_matches_the_kernels(hidden_bytes, num_ranks):
    for num_sms, recv_tokens in itertools.product([2, 16, 24, 48, 128], [1, 16, 64, 250, 256]):
        config = Config(num_sms, 1, recv_tokens)
        assert config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks) == \
            _C.nvl_buffer_size_hint(hidden_bytes, num_ranks, num_sms, recv_tokens)


def test_default_buffer_for_deepseek_sizes_stays_small():
    # 7168 bf16 hidden, 24 SMs, two ranks: tens of MB, not a GB.
    size = Config(24, 8, 64).get_nvl_buffer_size_hint(7168 * 2, 2)
    assert size < 32 << 20
