"""`gps:` section of the run config: Global Parameter Storage (paper §5.1, App. B)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Literal

from pivot_hpc.errors import fail

LINK_KEY = re.compile(r"^\s*(\d+)\s*->\s*(\d+)\s*$")


@dataclass(kw_only=True)
class GPSConfig:
    """Where parameters live in host memory and how Read/Write move them.

    Bandwidths and overheads feed the planner's latency estimate (bytes / bandwidth +
    overhead per transfer); measure them with `pivot-hpc bench gps --profile-links`.
    """

    # Remote transport: "rma" (MPI one-sided, passive target), "nixl" (NIXL READ/WRITE over
    # UCX; DRAM or VRAM), "auto" = nixl when a CUDA device and nixl are present, else rma.
    # Node-local transfers always copy straight from the shared window.
    transport: Literal["auto", "rma", "nixl"] = "auto"
    # Host memory GPS may use on each node, GiB; 0 = half the node's RAM (shared among
    # the pseudo-nodes of one host). Writable models count twice (double buffer).
    host_budget_gib: float = 0.0
    # Replication group size k (App. B.1); 0 = the smallest k that fits the budget.
    group_size: int = 0
    # Split COMM_WORLD into pseudo-nodes of this many consecutive ranks (tests of multi-node
    # layouts on one host); 0 = real nodes (MPI COMM_TYPE_SHARED).
    pseudo_node_size: int = 0
    local_bandwidth_gbps: float = 24.0  # GB/s, node-local host memory -> receiver
    remote_bandwidth_gbps: float = 12.0  # GB/s, another node's host memory -> receiver
    local_overhead_us: float = 5.0  # fixed cost per node-local transfer
    remote_overhead_us: float = 20.0  # fixed cost per remote transfer
    # Per node-pair overrides, "src->dst": GB/s (e.g. a slow or fast link; profiling output).
    link_bandwidth_gbps: dict[str, float] = field(default_factory=dict)
    # What a transfer waits behind in the planner (greedy.py): "endpoints" = the GPU's own
    # host link when node-local, the two nodes' NICs when remote; "sender" = the paper's
    # literal one accumulated latency per sender.
    cost_model: Literal["endpoints", "sender"] = "endpoints"
    read_retries: int = 16  # attempts when a Write recycles the slot a Read is copying
    max_transfer_mib: int = 512  # one MPI RMA call moves at most this much (int32 counts)
    # Concurrent lanes of one remote RMA transfer, each a thread through a different rank
    # of the holder node (transport_rma.py: shared-memory CMA copies from one process are
    # serialised by the kernel). 1 = one thread; more need MPI_THREAD_MULTIPLE.
    remote_lanes: int = 2
    # NIXL agents run passive (no progress thread, UCX error handling "none"): a READ or
    # WRITE needs one-sided RDMA or CMA. true: NIXL's progress thread on every rank (spins
    # one core each), for fabrics where the target must take part (TCP only).
    nixl_progress_thread: bool = False
    transfer_timeout_s: float = 300.0  # a NIXL transfer still running after this fails

    def validate(self, path: str) -> None:
        if not math.isfinite(self.host_budget_gib) or self.host_budget_gib < 0:
            fail(f"{path}.host_budget_gib", self.host_budget_gib, "must be >= 0 (0 = auto)")
        for name in ("group_size", "pseudo_node_size"):
            if getattr(self, name) < 0:
                fail(f"{path}.{name}", getattr(self, name), "must be >= 0 (0 = auto)")
        for name in ("local_bandwidth_gbps", "remote_bandwidth_gbps"):
            v = getattr(self, name)
            if not math.isfinite(v) or v <= 0:
                fail(f"{path}.{name}", v, "a bandwidth must be a finite number of GB/s > 0")
        for name in ("local_overhead_us", "remote_overhead_us"):
            v = getattr(self, name)
            if not math.isfinite(v) or v < 0:
                fail(f"{path}.{name}", v, "an overhead must be finite and >= 0 microseconds")
        for key, v in self.link_bandwidth_gbps.items():
            if not LINK_KEY.match(str(key)):
                fail(f"{path}.link_bandwidth_gbps", key, "keys are node pairs like '1->0'")
            if not math.isfinite(v) or v <= 0:
                fail(f"{path}.link_bandwidth_gbps.{key}", v, "bandwidth must be > 0 GB/s")
        if self.read_retries < 1:
            fail(f"{path}.read_retries", self.read_retries, "need at least 1 attempt")
        if not 1 <= self.max_transfer_mib <= 1024:
            fail(f"{path}.max_transfer_mib", self.max_transfer_mib, "must be in 1..1024")
        if not math.isfinite(self.transfer_timeout_s) or self.transfer_timeout_s <= 0:
            fail(f"{path}.transfer_timeout_s", self.transfer_timeout_s, "must be > 0 seconds")
        if not 1 <= self.remote_lanes <= 64:
            fail(f"{path}.remote_lanes", self.remote_lanes, "must be in 1..64 (1 = no threads)")
