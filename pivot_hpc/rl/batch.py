"""The RL step's batch: rewarded trajectories → what the trainer consumes (paper §3, GRPO).

The RL side owns this: group-relative advantages over each prompt's samples and the
truncation mask are decided here, once, for every cluster — the live cluster adapter only
says where each sample's tokens are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pivot_hpc.rl.config import GRPOConfig
from pivot_hpc.rl.grpo import group_advantages


@dataclass(slots=True)
class TrainBatch:
    """Trajectories for one optimizer step. Sequence i is `prompt_ids[i] + response_ids[i]`;
    the loss covers response tokens only."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    advantages: list[float] = field(default_factory=list)  # GRPO: one per sequence
    old_logprobs: list[list[float]] | None = None  # rollout logprobs (behaviour policy)
    ref_logprobs: list[list[float]] | None = None  # for the optional KL term
    versions: list[int] | None = None  # policy version that generated each sequence
    truncated: list[bool] | None = None  # True: cut at the length limit (no loss if masked)

    def __len__(self) -> int:
        return len(self.prompt_ids)


@dataclass(frozen=True, slots=True)
class Trajectory:
    """One rewarded sample as training sees it."""

    prompt_index: int  # samples of one prompt form a GRPO group
    reward: float
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float] | None  # the behaviour policy's, per response token
    version: int  # policy version that generated it
    truncated: bool  # stopped at the response length limit


def assemble(trajectories: Sequence[Trajectory], grpo: GRPOConfig) -> TrainBatch:
    """The batch of one RL step, with group-relative advantages."""
    adv = group_advantages(
        [t.reward for t in trajectories],
        [t.prompt_index for t in trajectories],
        normalize_std=grpo.normalize_std,
    )
    return TrainBatch(
        prompt_ids=[t.prompt_ids for t in trajectories],
        response_ids=[t.response_ids for t in trajectories],
        advantages=adv,
        old_logprobs=[t.logprobs for t in trajectories],
        versions=[t.version for t in trajectories],
        truncated=[t.truncated for t in trajectories] if grpo.mask_truncated else None,
    )
