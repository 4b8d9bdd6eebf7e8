"""Numerical guards of a training step (issue 47): one bad logprob must not poison every
rank. The PPO log-ratio is bounded (±20 nats, as veRL bounds it); a step whose gradient
norm is not finite takes no optimizer step (weights unchanged, `skipped_nonfinite`), and the
next step trains normally; non-finite rollout logprobs are masked where they enter the
batch. The real megatron-core engine, in this process (tp 1, like tests/engines/local_grpo.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from pivot_hpc.engines.base import TrainBatch
from pivot_hpc.models.qwen2 import create_model
from pivot_hpc.rl.batch import Trajectory, assemble
from pivot_hpc.rl.config import GRPOConfig, TrainerConfig
from pivot_hpc.rl.grpo import ppo_clip_loss
from tests.tiny_arch import tiny_arch


def test_a_logprob_far_below_the_policys_gives_finite_gradients() -> None:
    """The reproduced case: one loss token whose old logprob is ~88 nats below."""
    lp = torch.full((2, 4), -2.0, requires_grad=True)
    old = torch.full((2, 4), -2.0)
    old[0, 1] = -90.0
    loss, _ = ppo_clip_loss(lp, old, torch.tensor([-1.0, 1.0]), torch.ones(2, 4))
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(lp.grad).all()
    assert lp.grad[0, 1] == 0  # the clamped token carries no gradient, the others do
    assert (lp.grad[1] != 0).all()


def test_non_finite_rollout_logprobs_are_masked_where_they_enter_the_batch() -> None:
    def traj(i: int, logprobs: list[float]) -> Trajectory:
        return Trajectory(
            prompt_index=0,
            reward=float(i),
            prompt_ids=[3, 4],
            response_ids=[5, 6, 7],
            logprobs=logprobs,
            version=0,
            truncated=False,
        )

    b = assemble([traj(0, [-1.0, math.nan, -2.0]), traj(1, [-1.0, -1.0, -math.inf])], GRPOConfig())
    assert b.loss_mask == [[1, 0, 1], [1, 1, 0]]
    assert b.old_logprobs == [[-1.0, 0.0, -2.0], [-1.0, -1.0, 0.0]]
    clean = assemble([traj(0, [-1.0] * 3), traj(1, [-1.0] * 3)], GRPOConfig())
    assert clean.loss_mask is None


@pytest.fixture(scope="module")
def engine():
    from pivot_hpc.engines.megatron.engine import MegatronTrainEngine

    arch = tiny_arch()
    e = MegatronTrainEngine(arch, TrainerConfig(tp=1, lr=1e-2, seed=0, dtype="fp32"))
    e.load_weights(create_model(arch, seed=3).state_dict())
    return e


def _batch(bad: float | None = None, advantage: float = 0.5) -> TrainBatch:
    old = [[-4.0] * 5 for _ in range(4)]
    if bad is not None:
        old[2][3] = bad
    return TrainBatch(
        prompt_ids=[[3, 4, 5]] * 4,
        response_ids=[[6 + i, 7, 8, 9, 10] for i in range(4)],
        advantages=[1.0, -1.0, advantage, -0.5],
        old_logprobs=old,
    )


def _weights(e) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in e.gpt.named_parameters()}


def test_a_non_finite_gradient_skips_the_step_and_the_next_one_trains(engine) -> None:
    before, steps, version = _weights(engine), engine.steps, engine.version
    m = engine.train_step(_batch(advantage=math.nan))  # (a reward that was NaN)
    assert m["skipped_nonfinite"] == 1.0 and not math.isfinite(m["grad_norm"])
    after = _weights(engine)
    assert all(torch.equal(before[k], after[k]) for k in before)  # no NaN written anywhere
    assert engine.steps == engine.optimizer_step == steps and engine.version == version + 1
    m = engine.train_step(_batch())
    assert m["skipped_nonfinite"] == 0.0 and math.isfinite(m["grad_norm"])
    trained = _weights(engine)
    assert all(torch.isfinite(v).all() for v in trained.values())
    assert any(not torch.equal(after[k], trained[k]) for k in after)
    assert engine.steps == engine.optimizer_step == steps + 1


@pytest.mark.parametrize("bad", [-90.0, -math.inf])
def test_a_far_off_old_logprob_trains_the_step(engine, bad: float) -> None:
    m = engine.train_step(_batch(bad=bad))
    assert m["skipped_nonfinite"] == 0.0 and math.isfinite(m["grad_norm"])
    assert all(torch.isfinite(v).all() for v in _weights(engine).values())
