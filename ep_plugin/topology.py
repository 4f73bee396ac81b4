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


def resolve_ranks_per_node(group: dist.ProcessGroup, override: Optional[int]) -> int:
    """The configured override (for emulating several nodes on one host) or the detected value."""
    num_ranks = dist.get_world_size(group)
    if override is None:
        return ranks_per_node_from_hostnames(gather_hostnames(group))
    if num_ranks % override != 0:
        raise ValueError(f"topology.ranks_per_node = {override} does not divide the {num_ranks} ranks of the group")
    return override
