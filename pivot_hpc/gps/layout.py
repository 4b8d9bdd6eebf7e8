"""Host layout (paper App. B.1): replication-first, grouped sharding under memory pressure.

Nodes 0..N-1 form replication groups of k consecutive nodes (k = 1: every node holds a
full copy). Inside a group, node position m ("member") holds rows [R·m/k, R·(m+1)/k) of
every tensor (dim 0, so each member shard is one contiguous block); groups are replicas
of each other. k is the smallest divisor of N whose per-node bytes fit the budget.

A node's storage is one flat byte buffer (the MPI shared window of its host rank):

    [header: 64 B per model][model 0: slot 0 tensors | slot 1 tensors][model 1 ...]

Each header is three int64: the published version, then the version stamped on each
slot (-1 while a slot is being rewritten). Writable models have two slots (double
buffer: a Write fills the slot readers are not using, then publishes it), so they cost
2x their shard bytes; read-only models (GenRM) have one slot.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from pivot_hpc.gps.catalog import GPSError, ModelSpec

ALIGN = 64  # bytes; every tensor shard starts on a cache line
HEADER_BYTES = 64  # per model: published version, stamp of slot 0, stamp of slot 1
GIB = 1 << 30


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def node_bytes(models: Mapping[str, ModelSpec], writable: set[str], k: int, member: int) -> int:
    """Bytes one node of member position `member` needs with group size k."""
    total = HEADER_BYTES * len(models)
    for name, spec in models.items():
        slots = 2 if name in writable else 1
        per_slot = sum(
            _align(((t.rows * (member + 1)) // k - (t.rows * member) // k) * t.cols * t.itemsize)
            for t in spec.tensors
        )
        total += slots * per_slot
    return total


def max_node_bytes(models: Mapping[str, ModelSpec], writable: set[str], k: int) -> int:
    """Worst member's bytes (members differ by at most a row per tensor)."""
    return max(node_bytes(models, writable, k, m) for m in {0, k - 1})


def choose_group_size(
    models: Mapping[str, ModelSpec],
    writable: set[str],
    num_nodes: int,
    budget_bytes: int,
    forced: int = 0,
) -> int:
    """Smallest k dividing num_nodes whose per-node footprint fits; GPSError if none."""
    if forced:
        if forced < 1 or num_nodes % forced:
            raise GPSError(
                f"gps.group_size = {forced}: must divide the number of nodes ({num_nodes}); "
                f"valid sizes: {[k for k in range(1, num_nodes + 1) if num_nodes % k == 0]}"
            )
        need = max_node_bytes(models, writable, forced)
        if need > budget_bytes:
            raise GPSError(
                f"gps.group_size = {forced}: each node would hold {fmt_bytes(need)}, over the "
                f"host budget of {fmt_bytes(budget_bytes)} (gps.host_budget_gib); raise the "
                "budget or the group size"
            )
        return forced
    for k in range(1, num_nodes + 1):
        if num_nodes % k == 0 and max_node_bytes(models, writable, k) <= budget_bytes:
            return k
    need = max_node_bytes(models, writable, num_nodes)
    raise GPSError(
        f"GPS does not fit: models {sorted(models)} need {fmt_bytes(need)} per node even "
        f"sharded over all {num_nodes} nodes, over the host budget of {fmt_bytes(budget_bytes)} "
        "per node (gps.host_budget_gib); raise the budget, add nodes, or mark read-only "
        "models (one buffer instead of two)"
    )


class HostLayout:
    """Where every member shard of every tensor lives in a node's buffer."""

    def __init__(
        self,
        models: Mapping[str, ModelSpec],
        writable: set[str],
        num_nodes: int,
        k: int,
    ) -> None:
        if num_nodes % k:
            raise GPSError(f"group size {k} does not divide the number of nodes {num_nodes}")
        self.models = dict(models)
        self.writable = set(writable)
        self.num_nodes = num_nodes
        self.k = k
        self.num_groups = num_nodes // k
        self.model_ids = {name: i for i, name in enumerate(self.models)}
        # bounds[model]: int64 [T, k+1] row bounds of each member shard of each tensor
        self.bounds: dict[str, np.ndarray] = {}
        # offsets[model]: int64 [k, slots, T] byte offset of member shard in a node buffer
        self.offsets: dict[str, np.ndarray] = {}
        self.node_bytes = np.zeros(k, dtype=np.int64)
        for m in range(k):
            pos = HEADER_BYTES * len(self.models)
            for name, spec in self.models.items():
                rows = np.array([t.rows for t in spec.tensors], dtype=np.int64)
                cols = np.array([t.cols * t.itemsize for t in spec.tensors], dtype=np.int64)
                if m == 0:
                    b = (rows[:, None] * np.arange(k + 1, dtype=np.int64)[None, :]) // k
                    self.bounds[name] = b
                    self.offsets[name] = np.zeros((k, self.slots(name), len(rows)), np.int64)
                b = self.bounds[name]
                sizes = (b[:, m + 1] - b[:, m]) * cols
                aligned = -(-sizes // ALIGN) * ALIGN
                for s in range(self.slots(name)):
                    starts = pos + np.concatenate([[0], np.cumsum(aligned)[:-1]])
                    self.offsets[name][m, s] = starts
                    pos += int(aligned.sum())
            self.node_bytes[m] = pos

    def slots(self, model: str) -> int:
        return 2 if model in self.writable else 1

    def member_of(self, node: int) -> int:
        return node % self.k

    def holders(self, member: int) -> list[int]:
        """Nodes that hold member shard `member` (one per replication group)."""
        return [g * self.k + member for g in range(self.num_groups)]

    def header_offset(self, model: str) -> int:
        return HEADER_BYTES * self.model_ids[model]
