"""What a live sample carries beside the coordinator's accounting (`Sample.payload`): its
problem, token ids, the rollout's result, the GenRM's judgement and, with tools, the
multi-turn trajectory. The live sample source makes it, the turn loop's live side extends
it, checkpoints hold it (runtime/checkpoint_records.py checks it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pivot_hpc.agentic.trajectory import Trajectory as ToolTrajectory
from pivot_hpc.data.problem import Problem
from pivot_hpc.engines.base import SeqResult


@dataclass(slots=True)
class LivePayload:
    problem: Problem
    prompt_ids: list[int]
    response: SeqResult | None = None
    judge_ids: list[int] = field(default_factory=list)
    judgement: str = ""
    traj: ToolTrajectory | None = None  # tools.enabled: the multi-turn trajectory
