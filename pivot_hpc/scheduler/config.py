"""The throughput model's constants as a config section (`rollout.throughput`,
`reward.throughput`), and what a `pivot-hpc profile` file holds."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pivot_hpc.errors import fail


@dataclass(kw_only=True)
class ThroughputConfig:
    """Constants of T = N_seq / (A·N_tok + max(B, C·N_seq) + D), seconds per decode step."""

    A: float = 1.0e-8  # seconds per KV-cache token read each step (attention)
    B: float = 5.0e-3  # seconds to stream the weights once (memory-bound FFN floor)
    C: float = 1.0e-4  # seconds per running sequence (compute-bound FFN)
    D: float = 1.0e-3  # fixed per-step overhead
    # seconds to prefill one prompt token (the planner's re-prefill and lost-prefix costs);
    # `pivot-hpc profile` measures it; None: not measured, prefills cost nothing to plan
    prefill_s_per_token: float | None = None

    def validate(self, path: str) -> None:
        for name in ("A", "B", "C", "D"):
            v = getattr(self, name)
            if not math.isfinite(v) or v < 0:
                fail(f"{path}.{name}", v, "throughput constants must be finite and >= 0")
        p = self.prefill_s_per_token
        if p is not None and (not math.isfinite(p) or p < 0):
            fail(f"{path}.prefill_s_per_token", p, "must be finite and >= 0 (or null)")
        if self.B + self.D <= 0:
            fail(f"{path}.B", self.B, "B + D must be > 0 (a decode step cannot take zero time)")
