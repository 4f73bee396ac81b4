"""Topology: ranks per node from the group's hostnames, or the `topology.ranks_per_node` override (CPU, fast)."""
from __future__ import annotations

import pytest

from ep_plugin import topology
from ep_plugin.backends.base import GroupInfo
from ep_plugin.topology import check_ranks_per_node, ranks_per_node_from_hostnames, resolve_ranks_per_node


@pytest.mark.parametrize("hostnames,expected", [
    (["a"], 1),
    (["a", "a"], 2),
    (["a", "b"], 1),
    (["a", "a", "b", "b"], 2),
    (["a"] * 8 + ["b"] * 8 + ["c"] * 8, 8),
])
def test_detected_from_hostnames(hostnames, expected):
    assert ranks_per_node_from_hostnames(hostnames) == expected


@pytest.mark.parametrize("hostnames,message", [
    (["a", "a", "b"], "same number of ranks"),
    (["a", "a", "b", "b", "b", "b"], "contiguous"),
    (["a", "b", "a", "b"], "contiguous"),
    (["a", "a", "b", "c"], "contiguous"),
])
def test_uneven_or_interleaved_hosts_are_rejected(hostnames, message):
    with pytest.raises(ValueError, match=message):
        ranks_per_node_from_hostnames(hostnames)


@pytest.mark.parametrize("num_ranks,ranks_per_node", [(1, 1), (2, 1), (2, 2), (8, 4), (16, 8), (24, 8), (6, 3)])
def test_override_that_divides_the_world(num_ranks, ranks_per_node):
    assert check_ranks_per_node(num_ranks, ranks_per_node) == ranks_per_node


@pytest.mark.parametrize("num_ranks,ranks_per_node,message", [
    (6, 4, "does not divide the 6 ranks.*multiple of the ranks per node.*4 or 8 ranks"),
    (2, 4, "exceeds the 2 ranks"),
    (8, 0, "positive int"),
    (8, -2, "positive int"),
    (8, 2.0, "positive int"),
    (8, True, "positive int"),
    (8, "2", "positive int"),
])
def test_bad_override_says_what_to_fix(num_ranks, ranks_per_node, message):
    with pytest.raises(ValueError, match=message):
        check_ranks_per_node(num_ranks, ranks_per_node)


def test_resolve_prefers_the_override(monkeypatch):
    monkeypatch.setattr(topology.dist, "get_world_size", lambda group: 4)
    monkeypatch.setattr(topology, "gather_hostnames", lambda group: ["a", "a", "a", "a"])
    assert resolve_ranks_per_node(object(), None) == 4          # detected: one host
    assert resolve_ranks_per_node(object(), 1) == 1             # emulate 4 nodes x 1 GPU
    assert resolve_ranks_per_node(object(), 2) == 2             # emulate 2 nodes x 2 GPUs
    with pytest.raises(ValueError, match="does not divide"):
        resolve_ranks_per_node(object(), 3)


@pytest.mark.parametrize("num_ranks,ranks_per_node,nodes", [(2, 1, 2), (2, 2, 1), (16, 8, 2), (12, 4, 3)])
def test_group_info_nodes(num_ranks, ranks_per_node, nodes):
    info = GroupInfo(group=None, rank=0, num_ranks=num_ranks, ranks_per_node=ranks_per_node, device=None)
    assert info.num_nodes == nodes
    assert info.is_intranode == (nodes == 1)
