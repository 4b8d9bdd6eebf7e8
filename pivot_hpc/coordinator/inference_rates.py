"""Tokens per GPU-second each inference role makes while it has work, as measured.

Elastic training (planner/elastic.py) asks how long the released inference work takes on
the GPUs training leaves. Today's replicas do not say: when a batch is released pivot+
has just moved every replica to the role that had the work, so the role that has the new
work holds none. What the run measured does: a role's finished tokens over the
GPU-seconds its replicas were up while it had sequences (running or queued). Tails with
few sequences and re-prefills after migrations are in the measurement, as they will be
in the work it estimates.
"""

from __future__ import annotations

from collections.abc import Mapping

from pivot_hpc.planner import Topology
from pivot_hpc.planner.snapshot import INFERENCE_ROLES
from pivot_hpc.scheduler import Scheduler


class InferenceRates:
    def __init__(self) -> None:
        self.gpu_s = dict.fromkeys(INFERENCE_ROLES, 0.0)
        self.tokens = dict.fromkeys(INFERENCE_ROLES, 0)
        self._t: float | None = None

    def advance(self, now: float, schedulers: Mapping[str, Scheduler], topo: Topology) -> None:
        """Account the GPU-seconds since the last call to the roles that had work (call
        before anything changes the replicas or the sequences)."""
        if self._t is not None and now > self._t:
            dt = now - self._t
            for role in INFERENCE_ROLES:
                sched = schedulers[role]
                if sched.n_seq and sched.replicas:
                    self.gpu_s[role] += dt * len(sched.replicas) * topo.roles[role].tp
        self._t = now if self._t is None else max(self._t, now)

    def finished(self, role: str, generated: int) -> None:
        self.tokens[role] += generated

    def per_gpu_s(self, role: str) -> float | None:
        """Tokens per GPU-second (None before the role has finished a sequence)."""
        if not self.tokens[role] or self.gpu_s[role] <= 0:
            return None
        return self.tokens[role] / self.gpu_s[role]

    def gpu_seconds(self, work: Mapping[str, float]) -> float | None:
        """GPU-seconds `work` (tokens per role) needs at the measured rates (None where a
        role with work has no measurement yet)."""
        total = 0.0
        for role, tokens in work.items():
            if tokens <= 0:
                continue
            rate = self.per_gpu_s(role)
            if rate is None:
                return None
            total += tokens / rate
        return total
