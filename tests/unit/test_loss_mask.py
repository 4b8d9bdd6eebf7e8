"""The loss mask of multi-turn trajectories (issue 37): tool-observation tokens sit in the
response but carry no loss, no token count and no gradient; an all-ones mask is no mask.

The model is a tiny Qwen2 (HF); its per-token logprobs go through the GRPO loss the way
the trainers use it (`rl/grpo.ppo_clip_loss`, token counts from `TrainBatch.loss_tokens`).
The Megatron trainer is checked against the same reference in tests/engines.
"""

from __future__ import annotations

import pytest
import torch

from pivot_hpc.models.qwen2 import create_model
from pivot_hpc.rl.batch import TrainBatch, Trajectory, assemble
from pivot_hpc.rl.config import GRPOConfig
from pivot_hpc.rl.grpo import ppo_clip_loss, sft_loss
from tests.tiny_arch import tiny_arch

PROMPTS = [[1, 10, 11, 12], [1, 20, 21]]
# sequence 0: 3 generated, 4 observation, 2 generated; sequence 1: single turn
RESPONSES = [[30, 31, 32, 40, 41, 42, 43, 33, 2], [50, 51, 52, 2]]
MASK = [[1, 1, 1, 0, 0, 0, 0, 1, 1], [1, 1, 1, 1]]


def _traj(i: int, mask: list[int] | None, reward: float = 1.0) -> Trajectory:
    return Trajectory(
        i, reward, PROMPTS[i], RESPONSES[i], [0.0] * len(RESPONSES[i]), 0, False, mask
    )


def test_assemble_carries_the_mask_and_fills_single_turn_rows() -> None:
    plain = assemble([_traj(0, None), _traj(1, None)], GRPOConfig())
    assert plain.loss_mask is None  # a single-turn batch is what it was
    mixed = assemble([_traj(0, MASK[0]), _traj(1, None)], GRPOConfig())
    assert mixed.loss_mask == MASK
    assert mixed.loss_tokens(0) == MASK[0] and mixed.loss_tokens(1) == [1] * 4
    trunc = TrainBatch(PROMPTS, RESPONSES, truncated=[True, False], loss_mask=MASK)
    assert trunc.loss_tokens(0) == [0] * 9  # a masked truncated sequence: nothing


def test_a_mask_that_does_not_line_up_is_refused_and_rows_keep_it_aligned() -> None:
    with pytest.raises(ValueError, match="loss_mask"):
        TrainBatch(PROMPTS, RESPONSES, loss_mask=[MASK[0]])
    with pytest.raises(ValueError, match="loss_mask\\[1\\]"):
        TrainBatch(PROMPTS, RESPONSES, loss_mask=[MASK[0], [1, 1]])
    b = TrainBatch(PROMPTS, RESPONSES, advantages=[0.5, -0.5], loss_mask=MASK)
    one = b.rows([1])
    assert one.response_ids == [RESPONSES[1]] and one.loss_mask == [MASK[1]]
    assert one.advantages == [-0.5]
    assert TrainBatch(PROMPTS, RESPONSES).rows([0]).advantages == []  # SFT: none


def _grads(
    batch: TrainBatch, *, kl: bool = False, loss: str = "grpo"
) -> tuple[float, list[torch.Tensor]]:
    """The GRPO (or SFT) loss of `batch` under a fixed tiny model, and its gradient."""
    torch.manual_seed(0)
    model = create_model(tiny_arch(), seed=3)
    model.zero_grad()
    n_tok = sum(sum(batch.loss_tokens(i)) for i in range(len(batch)))
    total = torch.zeros(())
    for i in range(len(batch)):
        p, r = batch.prompt_ids[i], batch.response_ids[i]
        logits = model(torch.tensor([p + r])).logits[0].float()
        lp = torch.log_softmax(logits, -1)[len(p) - 1 : len(p) + len(r) - 1]
        lp = lp.gather(1, torch.tensor(r)[:, None])[:, 0][None]
        mask = torch.tensor([batch.loss_tokens(i)], dtype=torch.float32)
        if loss == "sft":
            value = sft_loss(lp, mask, normalizer=n_tok)
        else:
            value, _ = ppo_clip_loss(
                lp,
                torch.tensor([batch.old_logprobs[i]]),
                torch.tensor([batch.advantages[i]]),
                mask,
                kl_coef=0.1 if kl else 0.0,
                ref_logprobs=torch.tensor([batch.ref_logprobs[i]]) if kl else None,
                normalizer=n_tok,
            )
        total = total + value
    total.backward()
    return float(total.detach()), [p.grad.clone() for p in model.parameters()]


def _batch(mask, old=None, ref=None, responses=RESPONSES) -> TrainBatch:
    old = old or [[-2.0 + 0.1 * t for t in range(len(r))] for r in responses]
    ref = ref or [[-2.5 + 0.05 * t for t in range(len(r))] for r in responses]
    return TrainBatch(
        [list(p) for p in PROMPTS],
        [list(r) for r in responses],
        advantages=[1.0, -0.7],
        old_logprobs=old,
        ref_logprobs=ref,
        loss_mask=mask,
    )


def _same(a: list[torch.Tensor], b: list[torch.Tensor], exact: bool) -> bool:
    if exact:
        return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    return all(torch.allclose(x, y, rtol=1e-5, atol=1e-7) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("kl", [False, True])
def test_all_ones_mask_is_no_mask_bit_for_bit(kl: bool) -> None:
    ones = [[1] * len(r) for r in RESPONSES]
    l0, g0 = _grads(_batch(None), kl=kl)
    l1, g1 = _grads(_batch(ones), kl=kl)
    assert l0 == l1 and _same(g0, g1, exact=True)


@pytest.mark.parametrize("kl", [False, True])
def test_placeholder_logprobs_at_observations_change_no_gradient(kl: bool) -> None:
    base = _batch(MASK)
    l0, g0 = _grads(base, kl=kl)
    # the rollout's 0.0 placeholders, and values whose exp overflows (inf · 0 = nan)
    for v in (0.0, 1e4, -1e4):
        old = [
            [v if m == 0 else x for x, m in zip(o, mm, strict=True)]
            for o, mm in zip(base.old_logprobs, MASK, strict=True)
        ]
        ref = [
            [v if m == 0 else x for x, m in zip(o, mm, strict=True)]
            for o, mm in zip(base.ref_logprobs, MASK, strict=True)
        ]
        l1, g1 = _grads(_batch(MASK, old, ref), kl=kl)
        assert l1 == l0 and _same(g0, g1, exact=True), v


def test_observation_tokens_after_the_last_generation_change_no_gradient() -> None:
    # a trailing observation (e.g. cut at the context limit): its ids feed no loss token
    mask = [[1, 1, 1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1]]
    other = [[*RESPONSES[0][:5], 90, 91, 92, 93], RESPONSES[1]]
    l0, g0 = _grads(_batch(mask), kl=True)
    l1, g1 = _grads(_batch(mask, responses=other), kl=True)
    assert l1 == pytest.approx(l0, rel=1e-6) and _same(g0, g1, exact=False)


def test_masked_tokens_are_not_counted_in_the_normalisation() -> None:
    # the masked sequence's loss is the loss over its generated tokens alone: the same
    # as a hand-made mean over exactly those tokens (token-mean over 5 + 4 = 9 tokens)
    b = _batch(MASK)
    assert sum(sum(b.loss_tokens(i)) for i in range(2)) == 9
    l_masked, _ = _grads(b, loss="sft")
    torch.manual_seed(0)
    model = create_model(tiny_arch(), seed=3)
    nll = []
    with torch.no_grad():
        for p, r, m in zip(PROMPTS, RESPONSES, MASK, strict=True):
            lp = torch.log_softmax(model(torch.tensor([p + r])).logits[0].float(), -1)
            lp = lp[len(p) - 1 : len(p) + len(r) - 1].gather(1, torch.tensor(r)[:, None])[:, 0]
            nll += [-float(x) for x, k in zip(lp, m, strict=True) if k]
    assert l_masked == pytest.approx(sum(nll) / len(nll), rel=1e-5)
