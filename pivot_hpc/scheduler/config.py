"""The scheduler's config section (`scheduler`, paper §6), and the throughput model's
constants as a config section (`rollout.throughput`, `reward.throughput`: what a
`pivot-hpc profile` file holds)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

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


@dataclass(kw_only=True)
class SchedulerConfig:
    """Shift-aware scheduler (paper §6)."""

    priority: Literal["seq_id", "longest_first", "shortest_first"] = "seq_id"  # queue order
    migration: bool = True  # shift-up migration (Alg. 4); off = the `vanilla` ablation
    # How many of a role's sequences run at once (beyond the paper). `all`: every queued
    # sequence that fits (KV capacity, the engines' running-request cap), as in §6.
    # `pipeline`: at most the concurrency the staleness pipeline can use, (staleness+1) ×
    # batch × mean/longest generated length (measured), the rest waits in priority order
    # so older batches finish first (scheduler/admission.py). Every mode uses the same.
    admission: Literal["all", "pipeline"] = "all"
    # Beyond the paper: at every monitor tick, a role with an idle replica, another running
    # two or more sequences and nothing queued moves sequences onto the idle ones by Alg.
    # 4's migration (shortest first, while the role's throughput rises). §6 moves them only
    # on shifts, so a batch's long tail can crowd one replica while the others idle. Off
    # where migration is (`migration: false`, the `vanilla` ablation).
    rebalance: bool = False
    # Soft affinity of a tool-calling trajectory's next turn to the replica its last turn
    # ran on, which still caches its prefix (beyond the paper, issue 37): Dispatch places
    # the turn there instead of the max-ΔT replica when that replica has room and its ΔT
    # is at least (1 − affinity_slack) × the best ΔT. The returning turn then prefills only
    # its tool observation instead of its whole context (vLLM's automatic prefix caching;
    # the simulator models it; the hf engine has no prefix cache). 0 = off; 0.1 gives up
    # at most 10 % of the best replica's marginal throughput for the saved prefill.
    affinity_slack: float = 0.1
    # Bounded wait for that replica (issue 37): a returning turn whose preferred replica is
    # still up (the incarnation that ran its last turn) but at its running cap or without
    # KV room stays queued up to this many seconds from its submit instead of going to
    # another replica. It goes there as soon as a slot frees, to the max-ΔT replica once
    # the wait is over (dispatched then even if nothing frees); sequences behind it are
    # dispatched past it meanwhile. A replica that shifted down is never waited for.
    # 0 = never wait (soft affinity only); no effect at affinity_slack 0, nor live on the
    # hf engine (no prefix cache: a wait would only delay the turn). 2 s: measured on group 2 with
    # two calls per trajectory (docs/guide/agentic.md), +4 % steady tokens/s and −40 % rollout
    # prefill at 2 s calls, +1 % (within the seeds' spread) and −13 % at 30 s.
    affinity_wait_s: float = 2.0

    def validate(self, path: str) -> None:
        if not 0.0 <= self.affinity_slack <= 1.0:
            fail(f"{path}.affinity_slack", self.affinity_slack, "must be in [0, 1]")
        w = self.affinity_wait_s
        if not math.isfinite(w) or w < 0:
            fail(f"{path}.affinity_wait_s", w, "must be a finite number of seconds >= 0")
