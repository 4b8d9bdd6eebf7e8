"""Link cost model of the planner: bandwidth and per-transfer overhead per node pair."""

from __future__ import annotations

import numpy as np

from pivot_hpc.gps.catalog import GPSError
from pivot_hpc.gps.config import LINK_KEY, GPSConfig
from pivot_hpc.gps.greedy import MODELS


class LinkModel:
    """bandwidth[src, dst] in bytes/s and overhead[src, dst] in s for N nodes; cost model."""

    def __init__(
        self, bandwidth: np.ndarray, overhead: np.ndarray, cost_model: str = "endpoints"
    ) -> None:
        if cost_model not in MODELS:
            raise GPSError(f"cost model {cost_model!r}: choose one of {sorted(MODELS)}")
        self.cost_model = cost_model
        self.bandwidth = np.ascontiguousarray(bandwidth, dtype=np.float64)
        self.overhead = np.ascontiguousarray(overhead, dtype=np.float64)
        if self.bandwidth.shape != self.overhead.shape or self.bandwidth.ndim != 2:
            raise GPSError("link bandwidth and overhead must be N x N matrices of one shape")

    @classmethod
    def from_config(cls, cfg: GPSConfig, num_nodes: int) -> LinkModel:
        n = num_nodes
        local = np.eye(n, dtype=bool)
        bw = np.where(local, cfg.local_bandwidth_gbps, cfg.remote_bandwidth_gbps) * 1e9
        ovh = np.where(local, cfg.local_overhead_us, cfg.remote_overhead_us) * 1e-6
        for key, gbps in cfg.link_bandwidth_gbps.items():
            m = LINK_KEY.match(str(key))
            if not m:
                raise GPSError(f"gps.link_bandwidth_gbps key {key!r}: expected 'src->dst'")
            src, dst = int(m.group(1)), int(m.group(2))
            if src >= n or dst >= n:
                raise GPSError(
                    f"gps.link_bandwidth_gbps key {key!r}: node outside 0..{n - 1} "
                    f"(this world has {n} nodes)"
                )
            bw[src, dst] = gbps * 1e9
        return cls(bw, ovh, cfg.cost_model)

    @property
    def num_nodes(self) -> int:
        return self.bandwidth.shape[0]

    def cost(self, src: int, dst: int, nbytes: float) -> float:
        return nbytes / self.bandwidth[src, dst] + self.overhead[src, dst]
