"""GRPO advantages and the PPO-clip loss."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from pivot_hpc.rl.config import RewardConfig
from pivot_hpc.rl.grpo import (
    LOSS_AGG_MODES,
    aggregate,
    group_advantages,
    ppo_clip_loss,
    rollout_correction,
    sft_loss,
)
from pivot_hpc.rl.rewards import overlong_penalty

TINY = str(Path(__file__).parents[2] / "configs" / "tiny.yaml")


def test_group_advantages_normalised_per_group():
    r = [1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0]
    g = [0, 0, 0, 0, 1, 1, 1, 1]
    a = group_advantages(r, g)
    assert a[4:] == [0.0] * 4  # equal rewards carry no signal
    assert sum(a[:4]) == pytest.approx(0.0, abs=1e-9)
    assert a[0] == pytest.approx(1.0, rel=1e-4) and a[1] == pytest.approx(-1.0, rel=1e-4)
    a2 = group_advantages(r, g, normalize_std=False)
    assert a2[:4] == pytest.approx([0.5, -0.5, -0.5, 0.5])


def test_group_advantages_interleaved_groups():
    a = group_advantages([1, 5, 0, 5], [0, 1, 0, 1])
    assert a[1] == a[3] == 0.0
    assert a[0] > 0 > a[2]


def _loss(lp, old, adv, **kw):
    mask = torch.ones_like(lp)
    return ppo_clip_loss(lp, old, torch.tensor(adv), mask, **kw)


def test_ppo_on_policy_gradient_is_advantage_weighted_logprob():
    lp = torch.zeros(2, 3, requires_grad=True)
    loss, m = _loss(lp, torch.zeros(2, 3), [1.0, -2.0])
    loss.backward()
    # d/dlp of -A·exp(lp - old) at ratio 1 is -A, divided by the token count (6)
    assert torch.allclose(lp.grad, torch.tensor([[-1.0] * 3, [2.0] * 3]) / 6)
    assert float(m["ratio_sum"]) == 6.0 and float(m["clip_sum"]) == 0.0


def test_ppo_clip_stops_gradient_outside_trust_region():
    old = torch.zeros(1, 1)
    lp = torch.full((1, 1), math.log(1.5), requires_grad=True)  # ratio 1.5 > 1.28
    loss, m = _loss(lp, old, [1.0], clip_low=0.2, clip_high=0.28)
    loss.backward()
    assert lp.grad.abs().item() == 0.0 and float(m["clip_sum"]) == 1.0
    assert loss.item() == pytest.approx(-1.28)


def test_dual_clip_bounds_negative_advantage_loss():
    lp = torch.full((1, 1), math.log(10.0), requires_grad=True)
    loss, _ = _loss(lp, torch.zeros(1, 1), [-1.0], dual_clip=3.0)
    assert loss.item() == pytest.approx(3.0)
    loss, _ = _loss(lp.detach(), torch.zeros(1, 1), [-1.0], dual_clip=0.0)
    assert loss.item() == pytest.approx(10.0)


def test_kl_term_is_nonnegative_and_needs_reference():
    lp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    loss0, _ = _loss(lp, lp, [0.0])
    loss1, m = _loss(lp, lp, [0.0], kl_coef=0.1, ref_logprobs=ref)
    assert loss0.item() == 0.0 and loss1.item() > 0 and float(m["kl_sum"]) > 0
    with pytest.raises(ValueError):
        _loss(lp, lp, [0.0], kl_coef=0.1)


def test_masked_tokens_do_not_count():
    lp = torch.zeros(1, 4, requires_grad=True)
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    loss, m = ppo_clip_loss(lp, torch.zeros(1, 4), torch.tensor([1.0]), mask)
    loss.backward()
    assert lp.grad[0, 0] == 0 and lp.grad[0, 3] == 0 and float(m["tokens"]) == 2
    assert sft_loss(torch.tensor([[-1.0, -3.0]]), torch.tensor([[0.0, 1.0]])).item() == 3.0


# ---------------------------------------------------------------- loss aggregation modes
# two sequences: 1 loss token and 3 loss tokens, token losses 6 | 1, 2, 3
LOSS = torch.tensor([[6.0, 0.0, 0.0], [1.0, 2.0, 3.0]])
MASK = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])


@pytest.mark.parametrize(
    ("mode", "want"),
    [
        ("token-mean", (6 + 1 + 2 + 3) / 4),  # every token weighs the same (DAPO)
        ("seq-mean-token-mean", (6 / 1 + 6 / 3) / 2),  # every sequence weighs the same
        ("seq-mean-token-sum", (6 + 6) / 2),
        ("seq-mean-token-sum-norm", (6 / 8 + 6 / 8) / 2),  # Dr.GRPO: / a constant horizon
    ],
)
def test_loss_aggregation_modes_on_a_constructed_batch(mode: str, want: float) -> None:
    assert aggregate(LOSS, MASK, mode, horizon=8).item() == pytest.approx(want)


def test_aggregation_over_micro_batches_adds_up_to_the_whole_batch() -> None:
    for mode in LOSS_AGG_MODES:
        whole = aggregate(LOSS, MASK, mode, horizon=8)
        parts = sum(
            aggregate(LOSS[i : i + 1], MASK[i : i + 1], mode, tokens=4, sequences=2, horizon=8)
            for i in range(2)
        )
        assert parts.item() == pytest.approx(whole.item()), mode


def test_a_masked_truncated_sequence_carries_no_loss_or_gradient() -> None:
    lp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])  # row 1 truncated, masked
    loss, m = ppo_clip_loss(lp, torch.zeros(2, 3), torch.tensor([1.0, 5.0]), mask)
    loss.backward()
    assert m["tokens"].item() == 3 and (lp.grad[1] == 0).all()
    assert torch.allclose(lp.grad[0], torch.full((3,), -1.0 / 3))


# ------------------------------------------------------- rollout/trainer mismatch (TIS, MIS)
def test_truncated_importance_sampling_caps_the_weights() -> None:
    old = torch.log(torch.tensor([[1.0, 3.0, 0.25]]))  # trainer: w = 1, 3, 0.25 vs rollout 0
    w, mask, m = rollout_correction(old, torch.zeros(1, 3), torch.ones(1, 3), "truncate", 2.0)
    assert torch.allclose(w, torch.tensor([[1.0, 2.0, 0.25]]))
    assert (mask == 1).all() and m["is_truncated_frac"] == pytest.approx(1 / 3)
    assert m["mismatch_abs_logp"] == pytest.approx((0 + math.log(3) + math.log(4)) / 3)
    assert m["is_ratio_p50"] == pytest.approx(1.0)


def test_masked_importance_sampling_drops_tokens_outside_the_band() -> None:
    old = torch.log(torch.tensor([[1.0, 3.0, 0.25, 0.6]]))
    w, mask, m = rollout_correction(old, torch.zeros(1, 4), torch.ones(1, 4), "mask", 2.0)
    assert (w == 1).all()
    assert mask.tolist() == [[1.0, 0.0, 0.0, 1.0]]  # band [1/2, 2]
    assert m["is_masked_frac"] == pytest.approx(0.5)
    _, mask2, _ = rollout_correction(old, torch.zeros(1, 4), torch.ones(1, 4), "mask", 2.0, 0.2)
    assert mask2.tolist() == [[1.0, 0.0, 1.0, 1.0]]


def test_importance_weights_scale_the_policy_gradient() -> None:
    lp = torch.zeros(1, 2, requires_grad=True)
    w = torch.tensor([[2.0, 0.5]])
    loss, _ = ppo_clip_loss(
        lp, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2), is_weights=w
    )
    loss.backward()
    assert torch.allclose(lp.grad, torch.tensor([[-2.0, -0.5]]) / 2)


# ----------------------------------------------------------------- DAPO overlong shaping
@pytest.mark.parametrize(
    ("length", "want"), [(10, 0.0), (12, 0.0), (14, -0.125), (16, -0.25), (20, -0.5), (99, -0.5)]
)
def test_overlong_penalty_is_dapos_soft_punishment(length: int, want: float) -> None:
    cfg = RewardConfig(overlong_buffer_len=8, overlong_penalty_factor=0.5)
    assert overlong_penalty(length, 20, cfg) == pytest.approx(want)  # free up to 12 tokens
    assert overlong_penalty(length, 20, RewardConfig()) == 0.0  # off by default


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("rl.grpo.rollout_is=truncate", "set rl.grpo.recompute_old_logprobs=true"),
        ("rl.grpo.loss_agg_mode=mean", "'token-mean'"),
        ("rl.reward.overlong_buffer_len=9999", "below rl.max_response_tokens"),
        ("rl.grpo.rollout_is_threshold=inf", "not a finite number"),
    ],
)
def test_rl_feature_keys_are_validated_by_name(override: str, says: str) -> None:
    from pivot_hpc.config import ConfigError
    from pivot_hpc.job.config import load_config

    with pytest.raises(ConfigError, match=override.split("=")[0].replace(".", r"\.")) as e:
        load_config(TINY, [override])
    assert says in str(e.value)


def test_loss_fn_is_checked_before_launch() -> None:
    from pivot_hpc.errors import ConfigError
    from pivot_hpc.job.config import load_config
    from pivot_hpc.rl.grpo import ppo_clip_loss, resolve_loss
    from pivot_hpc.runtime.world import check_live_config

    assert resolve_loss("pivot_hpc.rl.grpo:ppo_clip_loss") is ppo_clip_loss
    with pytest.raises(ConfigError, match="give it as 'package.module:function'"):
        load_config(None, ["rl.grpo.loss_fn=pivot_hpc.rl.grpo.ppo_clip_loss"])
    for spec, why in (
        ("no_such_pkg.x:f", "cannot import"),
        ("pivot_hpc.rl.grpo:nope", "no 'nope'"),
    ):
        cfg = load_config(None, [f"rl.grpo.loss_fn={spec}"])
        with pytest.raises(ConfigError, match=why):
            check_live_config(cfg)


def test_the_group_std_is_the_population_one_or_the_unbiased_one():
    r, g = [1.0, 0.0, 1.0, 0.0], [0, 0, 0, 0]
    pop = group_advantages(r, g)
    unb = group_advantages(r, g, std="unbiased")
    assert pop[0] == pytest.approx(1.0, abs=1e-5)  # ±0.5 / 0.5
    assert unb[0] == pytest.approx(0.5 / math.sqrt(1.0 / 3.0), abs=1e-5)  # ÷ n − 1
    with pytest.raises(ValueError, match="std='sample'"):
        group_advantages(r, g, std="sample")
