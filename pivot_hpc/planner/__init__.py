"""The planner (paper §7): snapshot → shift pairs → DP candidates → simulated benefit → plan."""

from __future__ import annotations

from pivot_hpc.planner.candidates import Candidate, ShiftPair, build_candidates
from pivot_hpc.planner.plan import CandidateEval, PlannerTimings, ShiftPlan, overall_throughput
from pivot_hpc.planner.planner import (
    PivotStrategy,
    RuleStrategy,
    StaticStrategy,
    Strategy,
    make_strategy,
)
from pivot_hpc.planner.snapshot import (
    RoleSpec,
    Snapshot,
    SnapshotError,
    Topology,
    TrainingState,
    replica_id,
    role_of,
)

__all__ = [
    "Candidate",
    "CandidateEval",
    "PivotStrategy",
    "PlannerTimings",
    "RoleSpec",
    "RuleStrategy",
    "ShiftPair",
    "ShiftPlan",
    "Snapshot",
    "SnapshotError",
    "StaticStrategy",
    "Strategy",
    "Topology",
    "TrainingState",
    "build_candidates",
    "make_strategy",
    "overall_throughput",
    "replica_id",
    "role_of",
]
