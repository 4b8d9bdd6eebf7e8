"""The planner's config section (`planner`, paper §7 and §8.4) and the shift times its
penalty starts from."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from pivot_hpc.errors import fail


@dataclass(kw_only=True)
class ShiftTimes:
    """τ_shift per role that shifts down (seconds), used in the penalty φ = Σ τ_shift·T_i."""

    rollout: float = 2.0  # seconds a rollout replica takes to shift
    reward: float = 2.0  # seconds a GenRM replica takes to shift
    training: float = 5.0  # seconds training takes to shift

    def validate(self, path: str) -> None:
        for name in ("rollout", "reward", "training"):
            v = getattr(self, name)
            if not math.isfinite(v) or v < 0:
                fail(f"{path}.{name}", v, "shift time must be finite and >= 0 seconds")


@dataclass(kw_only=True)
class PlannerConfig:
    """When and how to shift GPUs between roles (paper §7, §8.4)."""

    # the paper's planner, or an §8.4 ablation
    # pivot+ (ours): pivot, with the re-prefill of the sequences a plan migrates counted
    # in its penalty, no GPUs moved back before the plan that moved them has repaid its
    # penalty (break-even φ / gain), reward's last replica kept while rollouts run, plans
    # at once on a stall (planner/planner.py), and training pre-warmed in its batch's tail
    # (planner/prewarm.py)
    strategy: Literal["pivot", "pivot+", "static", "rule", "vanilla"] = "pivot"
    horizon_s: float = 60.0  # H: how long a shift's throughput gain is expected to last
    interval_s: float = 1.0  # how often the planner looks at a fresh snapshot
    # τ_shift per role: the planner's starting values (until measured, see refit_shift_time)
    shift_time_s: ShiftTimes = field(default_factory=ShiftTimes)
    # Refit τ_shift from the shifts the run makes (request → done, as the coordinator sees
    # it) and use the measured values in the penalty from then on (coordinator/monitor.py)
    refit_shift_time: bool = True
    # Refit each inference role's throughput constants A–D from the engines' own decode
    # step statistics while the job runs (live engines; the simulator's engine is its model)
    refit_throughput: bool = True
    rule_high_util: float = 0.8  # `rule`: shift up a role above this KV utilisation
    rule_low_util: float = 0.1  # `rule`: shift down a role below this KV utilisation
    # Simulate every candidate while there are at most this many (the paper's procedure);
    # past it, a coarse-to-fine search over the shift-up count k (≈ 2·log K simulations).
    max_exact_candidates: int = 64
    # Elastic training (beyond the paper): before each step training may grow its
    # data-parallel size onto GPUs outside its set and give them back between steps, when
    # the step's time saved outweighs the inference lost and the re-shard through GPS
    # (planner/elastic.py). pivot mode only: the static modes keep their allocation.
    elastic_training: bool = False

    def validate(self, path: str) -> None:
        if not math.isfinite(self.horizon_s) or self.horizon_s < 0:
            fail(f"{path}.horizon_s", self.horizon_s, "H must be a finite number of seconds >= 0")
        if self.max_exact_candidates < 1:
            fail(f"{path}.max_exact_candidates", self.max_exact_candidates, "must be >= 1")
        if self.interval_s <= 0:
            fail(f"{path}.interval_s", self.interval_s, "the planning interval must be > 0 s")
        if not 0 <= self.rule_low_util < self.rule_high_util <= 1:
            fail(
                f"{path}.rule_low_util",
                (self.rule_low_util, self.rule_high_util),
                "need 0 <= rule_low_util < rule_high_util <= 1",
            )
