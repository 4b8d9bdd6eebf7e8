"""The RL side owns the step's batch: group-relative advantages and the truncation mask are
decided in rl/batch.py for every cluster."""

from __future__ import annotations

import pytest

from pivot_hpc.rl.batch import Trajectory, assemble
from pivot_hpc.rl.config import GRPOConfig


def traj(prompt_index: int, reward: float, *, truncated: bool = False) -> Trajectory:
    return Trajectory(
        prompt_index=prompt_index,
        reward=reward,
        prompt_ids=[1, 2],
        response_ids=[3, 4, 5],
        logprobs=[-0.1, -0.2, -0.3],
        version=7,
        truncated=truncated,
    )


def test_advantages_are_relative_to_each_prompts_group() -> None:
    batch = assemble(
        [traj(0, 1.0), traj(0, 0.0), traj(1, 0.5), traj(1, 0.5)],
        GRPOConfig(normalize_std=False),
    )
    assert batch.advantages == pytest.approx([0.5, -0.5, 0.0, 0.0])
    assert batch.versions == [7] * 4 and batch.old_logprobs[0] == [-0.1, -0.2, -0.3]
    assert batch.truncated is None  # no mask unless rl.grpo.mask_truncated


def test_the_truncation_mask_follows_the_config() -> None:
    batch = assemble([traj(0, 1.0, truncated=True), traj(0, 0.0)], GRPOConfig(mask_truncated=True))
    assert batch.truncated == [True, False]
    assert batch.advantages[0] > 0 > batch.advantages[1]
