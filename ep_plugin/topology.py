"""Which ranks share a node: detected from the process group, or set by `topology.ranks_per_node`."""
from __future__ import annotations

import socket
from typing import List, Optional

import torch.distributed as dist


def gather_hostnames(group: dist.ProcessGroup) -> List[str]:
    names: List[Optional[str]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(names, socket.gethostname(), group=group)
    return [str(n) for n in names]


def ranks_per_node_from_hostnames(hostnames: List[str]) -> int:
    """Ranks per node if the group is made of equal, contiguous blocks of ranks per host."""
    num_ranks = len(hostnames)
    first = hostnames[0]
    per_node = 1
    while per_node < num_ranks and hostnames[per_node] == first:
        per_node += 1
    if num_ranks % per_node != 0:
        raise ValueError(f"the process group has {num_ranks} ranks but {per_node} on the first host: "
                         "every host must hold the same number of ranks (or set topology.ranks_per_node)")
    for node in range(num_ranks // per_node):
        block = hostnames[node * per_node:(node + 1) * per_node]
        if len(set(block)) != 1 or (node > 0 and block[0] in hostnames[:node * per_node]):
            raise ValueError("ranks of one host must be contiguous in the process group "
                             f"(hosts by rank: {hostnames}); reorder the group or set topology.ranks_per_node")
    return per_node


def check_ranks_per_node(num_ranks: int, ranks_per_node: object) -> int:
    """`ranks_per_node` if it is a positive int that divides `num_ranks`; a ValueError that says what to fix otherwise."""
    if not isinstance(ranks_per_node, int) or isinstance(ranks_per_node, bool) or ranks_per_node < 1:
        raise ValueError(f"topology.ranks_per_node must be a positive int, got {ranks_per_node!r}")
    if ranks_per_node > num_ranks:
        raise ValueError(f"topology.ranks_per_node = {ranks_per_node} exceeds the {num_ranks} ranks of the group "
                         "(the group must hold whole nodes)")
    if num_ranks % ranks_per_node != 0:
        raise ValueError(f"topology.ranks_per_node = {ranks_per_node} does not divide the {num_ranks} ranks of the "
                         f"group: the world size must be a multiple of the ranks per node (e.g. "
                         f"{num_ranks // ranks_per_node * ranks_per_node or ranks_per_node} or "
                         f"{(num_ranks // ranks_per_node + 1) * ranks_per_node} ranks)")
    return ranks_per_node


def resolve_ranks_per_node(group: dist.ProcessGroup, override: Optional[int]) -> int:
    """The configured override (for emulating several nodes on one host) or the detected value.

    With the override, one host can emulate several nodes (e.g. 2 GPUs as 2 nodes x 1 GPU): ranks
    r and r' share a "node" iff r // ranks_per_node == r' // ranks_per_node.
    """
    num_ranks = dist.get_world_size(group)
    if override is None:
        return ranks_per_node_from_hostnames(gather_hostnames(group))
    return check_ranks_per_node(num_ranks, override)
