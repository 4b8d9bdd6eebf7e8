"""GRPO advantages and the PPO-clip loss."""

from __future__ import annotations

import math

import pytest
import torch

from pivot_hpc.rl.grpo import group_advantages, ppo_clip_loss, sft_loss


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
