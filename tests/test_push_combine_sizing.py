"""The push combine's host-side sizing (ep_plugin/tuning.py) mirrors PushStagingLayout (buffer_layout.cuh),
and `combine.algorithm` picks it only where it applies (CPU; the layout checks need ep_plugin._C)."""
import itertools

import pytest

from ep_plugin import tuning
from ep_plugin.config import BufferSection, ConfigError, as_config

_C = pytest.importorskip("ep_plugin._C", reason="the native extension is not built here")


def test_chunk_matches_the_kernels():
    assert tuning.PUSH_CHUNK_TOKENS == _C.PUSH_CHUNK_TOKENS


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4, 8])
def test_push_staging_tokens_match_the_kernels(num_ranks):
    for size, hidden in itertools.product([0, 1 << 20, 15 << 20, 176 << 20, 1 << 32], [8, 2048, 7168, 8192]):
        assert tuning.push_staging_tokens(size, num_ranks, hidden) == _C.push_staging_tokens(num_ranks, size, hidden)


@pytest.mark.parametrize("tokens,max_hidden", [(4096, 7168), (1000, 2048), (1, 8), (32768, 4096)])
def test_push_staging_area_holds_the_configured_tokens(tokens, max_hidden):
    section = BufferSection(max_hidden=max_hidden, combine_staging_tokens=tokens)
    for num_ranks in (3, 4, 8):
        size = tuning.push_staging_bytes(section, num_ranks)
        held = _C.push_staging_tokens(num_ranks, size, max_hidden)
        assert tokens <= held <= tokens + 1, (num_ranks, size, held)
        # A smaller hidden size holds at least as many tokens.
        assert _C.push_staging_tokens(num_ranks, size, max(8, max_hidden // 2)) >= held


def test_auto_push_staging_is_4096_tokens_of_max_hidden():
    auto = BufferSection()
    size = tuning.push_staging_bytes(auto, 4)
    assert tuning.push_staging_tokens(size, 4, auto.max_hidden) == 4096
    # EP4, 4096 x 7168 bf16: three regions of 4096 rows with their weights (about 176 MB).
    assert 175e6 < size < 178e6
    assert tuning.push_staging_bytes(BufferSection(combine_staging_tokens=0), 4) == 0
    assert tuning.push_staging_bytes(auto, 1) == 0


def test_combine_algorithm_selection():
    for num_ranks in range(1, 9):
        assert tuning.combine_algorithm("auto", num_ranks) == "rings"
        assert tuning.combine_algorithm("rings", num_ranks) == "rings"
        assert tuning.combine_algorithm("push", num_ranks) == ("push" if num_ranks >= 3 else "rings")
    assert tuning.combine_algorithm("push", 16) == "rings"  # more than one NVLink domain: not intranode


def test_combine_algorithm_key():
    assert as_config({}).combine.algorithm == "auto"
    config = as_config({"combine": {"algorithm": "push", "nvl_chunked_send_tokens": 4}})
    assert config.combine.algorithm == "push" and config.combine.nvl_chunked_send_tokens == 4
    with pytest.raises(ConfigError, match=r"combine\.algorithm.*auto, rings, push"):
        as_config({"combine": {"algorithm": "copy"}})
    with pytest.raises(ConfigError, match=r"dispatch\.algorithm.*unknown key"):
        as_config({"dispatch": {"algorithm": "push"}})
