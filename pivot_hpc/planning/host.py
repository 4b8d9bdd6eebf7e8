"""Host memory per node (GPS, pinned buffers, Read staging) and the time of a shift's Read.

GPS (paper App. B.1, pivot_hpc/gps/layout.py): replication first — every node holds every
model; when that exceeds the per-node budget, groups of the smallest k dividing the node
count that fits, each node holding 1/k of every tensor. Writable models (the policy, and
the optimizer state of elastic training) take two slots (double buffer), the GenRM one.
Alignment and headers (64 B each) are left out.

Beside GPS, on each node:
- pinned: the optimizer state training offloads when it shifts down (page-locked copies,
  engines/megatron/engine.py `offload_optimizer`), for every training GPU of the node;
- Read staging: a shift-up Read lands in a host buffer of the whole model on each reader
  (SGLang replica leaders read the full model to host memory and hand it to SGLang in
  buckets; training ranks read the full policy to host memory and keep their TP shard),
  so a node whose readers all shift up at once holds that many copies for a moment.

Read time: one reader's bytes, node-local (1/k) over gps.local_bandwidth_gbps and the
remote rest over gps.remote_bandwidth_gbps, in parallel (the GPS latency model's
constants); a whole node reading at once is bounded by the node's host-read bandwidth of
the simulator's calibration (paper Figure 12).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pivot_hpc.planning.inputs import GIB, PlanInputs
from pivot_hpc.planning.memory import optimizer_bytes


@dataclass
class ReadTime:
    bytes_per_reader: float
    readers_per_node: int
    seconds: float  # one reader alone
    node_seconds: float | None  # every reader of a node at once (None: no calibration)
    staged: bool  # lands in a host buffer first (SGLang, training), not in device memory


@dataclass
class NodeMemory:
    group_size: int  # k of App. B.1 (1 = full replication)
    gps_replicated: float  # bytes per node at k = 1
    gps: float  # bytes per node at the chosen k
    by_group_size: dict[int, float]  # every valid k -> bytes per node
    budget: float | None  # gps.host_budget_gib; None = half the node's RAM at run time
    pinned: float
    staging: float
    reads: dict[str, ReadTime] = field(default_factory=dict)
    problem: str | None = None

    @property
    def total(self) -> float:
        return self.gps + self.pinned + self.staging

    @property
    def fits(self) -> bool | None:
        return None if self.budget is None else self.problem is None


def gps_bytes(p: PlanInputs) -> float:
    """Bytes of one full replica of every GPS model (writable ones twice)."""
    return sum(
        params * nbytes * (2 if writable else 1) for _, params, nbytes, writable in p.gps_models
    )


def node_memory(p: PlanInputs) -> NodeMemory:
    full = gps_bytes(p)
    ks = [k for k in range(1, p.nodes + 1) if p.nodes % k == 0]
    by_k = {k: full / k for k in ks}
    budget = p.gps_budget_gib * GIB if p.gps_budget_gib else None
    problem = None
    if p.gps_group_size:
        k = p.gps_group_size
        if budget is not None and by_k.get(k, full) > budget:
            problem = "gps"
    elif budget is None:
        k = 1  # replication first; the budget is known only on the node
    else:
        fitting = [k for k in ks if by_k[k] <= budget]
        k = fitting[0] if fitting else ks[-1]
        if not fitting:
            problem = "gps"
    t = p.training
    pinned = optimizer_bytes(t) * p.train_gpus_per_node if p.optimizer_offload else 0.0
    reads = read_times(p, k)
    staging = max(
        (r.bytes_per_reader * r.readers_per_node for r in reads.values() if r.staged),
        default=0.0,
    )
    return NodeMemory(
        group_size=k,
        gps_replicated=full,
        gps=by_k.get(k, full / k),
        by_group_size=by_k,
        budget=budget,
        pinned=pinned,
        staging=staging,
        reads=reads,
        problem=problem,
    )


def read_seconds(nbytes: float, k: int, p: PlanInputs) -> float:
    local = nbytes / k
    remote = nbytes - local
    return max(local / (p.local_gb_s * 1e9), remote / (p.remote_gb_s * 1e9))


def read_times(p: PlanInputs, k: int) -> dict[str, ReadTime]:
    """Each role's shift-up Read: every reader takes the whole model (tp = 1 Reads)."""
    out: dict[str, ReadTime] = {}
    for e in (p.rollout, p.reward):
        nbytes = e.model.params * e.bytes_per_param
        readers = max(1, p.gpus_per_node // e.tp)
        out[e.role] = _read(nbytes, readers, k, p, host=e.engine == "sglang")
    t = p.training
    nbytes = t.model.params * dict(bf16=2, fp32=4)[t.dtype]
    out["training"] = _read(nbytes, max(1, p.train_gpus_per_node), k, p, host=True)
    return out


def _read(nbytes: float, readers: int, k: int, p: PlanInputs, *, host: bool) -> ReadTime:
    alone = read_seconds(nbytes, k, p)
    node = None
    if p.host_read_gb_s:
        node = max(alone, nbytes * readers / (p.host_read_gb_s * 1e9))
    # an hf engine on a GPU reads straight into device memory: no host staging
    return ReadTime(nbytes, readers, alone, node, staged=host)
