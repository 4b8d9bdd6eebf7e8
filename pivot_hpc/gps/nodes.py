"""Nodes of the MPI world: real ones (COMM_TYPE_SHARED) or pseudo-nodes for tests.

A node is a set of ranks that share host memory; its local rank 0 is the *host rank* that
owns the node's GPS buffer. Nodes are numbered by their host's world rank, so node ids are
the same on every rank. `pseudo_node_size=r` cuts COMM_WORLD into consecutive blocks of r
ranks instead, which lets one machine test multi-node layouts, replication groups and
remote transfers (every pseudo-node still shares memory, so its shared window is real).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from mpi4py import MPI


@dataclass
class Nodes:
    world: MPI.Comm
    local: MPI.Comm  # ranks of my node; local rank 0 is the host rank
    node: int  # my node id
    num_nodes: int
    node_of: np.ndarray  # world rank -> node id
    host_of: np.ndarray  # node id -> world rank of its host rank
    nodes_per_host: int  # nodes sharing my physical machine (pseudo-nodes), for budgets

    @property
    def is_host(self) -> bool:
        return self.local.rank == 0

    def ranks_of(self) -> list[list[int]]:
        """World ranks of each node, host rank first (local rank 0 has the lowest rank)."""
        return [np.flatnonzero(self.node_of == n).tolist() for n in range(self.num_nodes)]


def split_nodes(world: MPI.Comm, pseudo_node_size: int = 0) -> Nodes:
    """Collective over `world`."""
    if pseudo_node_size > 0:
        local = world.Split(world.rank // pseudo_node_size, world.rank)
    else:
        local = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.rank)
    host_rank = local.bcast(world.rank, root=0)
    hosts = np.array(world.allgather(host_rank), dtype=np.int64)  # per world rank
    ids = np.unique(hosts)
    node_of = np.searchsorted(ids, hosts).astype(np.int64)
    names = world.allgather(MPI.Get_processor_name())
    me = names[world.rank]
    per_host = len({int(node_of[r]) for r in range(world.size) if names[r] == me})
    return Nodes(
        world=world,
        local=local,
        node=int(node_of[world.rank]),
        num_nodes=len(ids),
        node_of=node_of,
        host_of=ids.astype(np.int64),
        nodes_per_host=per_host,
    )
