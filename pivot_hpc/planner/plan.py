"""What a planning round returns: the shift plan, its expected benefit, and its timings."""

from __future__ import annotations

from dataclasses import dataclass, field


def overall_throughput(n_rollout: int, t_rollout: float, n_reward: int, t_reward: float) -> float:
    """Eq. 1: the N_seq-weighted harmonic mean of rollout and reward throughput.

    N counts running plus waiting sequences. A role with work but no throughput makes the
    system throughput 0 (its latency N/T is unbounded); a role with no work contributes 0
    latency. With no work at all the throughput is 0.
    """
    total = n_rollout + n_reward
    if total <= 0:
        return 0.0
    latency = 0.0
    for n, t in ((n_rollout, t_rollout), (n_reward, t_reward)):
        if n <= 0:
            continue
        if t <= 0:
            return 0.0
        latency += n / t
    return total / latency


@dataclass
class PlannerTimings:
    """Table 2's columns, in seconds."""

    preprocess_s: float = 0.0
    construct_s: float = 0.0
    simulate_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.preprocess_s + self.construct_s + self.simulate_s


@dataclass
class CandidateEval:
    k: int
    up: list[str]
    down: list[str]
    penalty: float
    throughput: float
    benefit: float


@dataclass
class ShiftPlan:
    """Replicas to shift down, then up. Empty lists = leave the allocation as it is.

    `mandatory` marks a training shift-up: training is needed to make RL progress, so it
    runs even though Eq. 1 (which counts only rollout and reward) sees a loss.
    """

    strategy: str
    up_role: str | None = None
    up: list[str] = field(default_factory=list)
    down: list[str] = field(default_factory=list)
    penalty: float = 0.0
    benefit: float = 0.0
    throughput_current: float = 0.0
    throughput_expected: float = 0.0
    mandatory: bool = False
    reason: str = ""
    timings: PlannerTimings = field(default_factory=PlannerTimings)
    candidates: list[CandidateEval] = field(default_factory=list)

    @property
    def is_noop(self) -> bool:
        return not self.up and not self.down
