"""GRPO: group-normalised advantages and the PPO-clip loss on per-token logprobs.

The importance ratio is taken against the *rollout* logprobs (the behaviour policy that
actually generated the tokens, possibly several versions stale in asynchronous modes),
so stale samples are corrected and clipped rather than trusted.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def group_advantages(
    rewards: Sequence[float], group_ids: Sequence[int], *, normalize_std: bool = True
) -> list[float]:
    """A_i = (r_i − mean_g) / (std_g + ε) within each group g of samples of one prompt.

    A group whose rewards are all equal carries no signal: its advantages are 0.
    """
    r = torch.as_tensor(list(rewards), dtype=torch.float64)
    g = torch.as_tensor(list(group_ids), dtype=torch.long)
    if r.shape != g.shape:
        raise ValueError("group_advantages: rewards and group_ids differ in length")
    adv = torch.zeros_like(r)
    for gid in torch.unique(g):
        idx = g == gid
        x = r[idx]
        centred = x - x.mean()
        if normalize_std:
            std = x.std(unbiased=False) if x.numel() > 1 else torch.tensor(0.0)
            centred = centred / (std + 1e-6)
        adv[idx] = centred
    return adv.tolist()


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float = 3.0,
    kl_coef: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    normalizer: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level PPO-clip loss. Shapes: [b, s] (advantages [b] or [b, s]); mask is 1 on
    response tokens. Returns (sum of token losses / normalizer, detached metrics sums).

    normalizer defaults to the number of masked tokens (DAPO's token-level mean); pass the
    global token count when a batch is split into micro-batches.
    """
    mask = mask.to(logprobs.dtype)
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logprobs)
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg = torch.maximum(unclipped, clipped)
    if dual_clip:
        # Dual clip (Ye et al. 2020): for A < 0 the loss is bounded by -A·c.
        pg = torch.where(advantages < 0, torch.minimum(pg, -advantages * dual_clip), pg)
    loss_tok = pg
    kl = torch.zeros_like(pg)
    if kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("ppo_clip_loss: kl_coef > 0 needs ref_logprobs")
        d = ref_logprobs - logprobs
        kl = torch.exp(d) - d - 1.0  # k3 estimator, >= 0
        loss_tok = loss_tok + kl_coef * kl
    n = float(mask.sum().item()) if normalizer is None else float(normalizer)
    n = max(n, 1.0)
    loss = (loss_tok * mask).sum() / n
    with torch.no_grad():
        clipped_frac = ((clipped > unclipped).to(mask.dtype) * mask).sum()
        metrics = {
            "pg_loss_sum": (pg * mask).sum(),
            "kl_sum": (kl * mask).sum(),
            "clip_sum": clipped_frac,
            "ratio_sum": (ratio * mask).sum(),
            "approx_kl_sum": (0.5 * log_ratio**2 * mask).sum(),
            "tokens": mask.sum(),
        }
    return loss, metrics


def sft_loss(
    logprobs: torch.Tensor, mask: torch.Tensor, normalizer: float | None = None
) -> torch.Tensor:
    """Mean negative log-likelihood of the masked (response) tokens."""
    mask = mask.to(logprobs.dtype)
    n = float(mask.sum().item()) if normalizer is None else float(normalizer)
    return -(logprobs * mask).sum() / max(n, 1.0)


@torch.no_grad()
def reference_logprobs(
    model, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], temperature: float
) -> list[list[float]]:
    """Per-token logprobs of each response under a frozen HF reference model (the KL term)."""
    out = []
    for p, r in zip(prompts, responses, strict=True):
        logits = model(torch.tensor([list(p) + list(r)])).logits[0].float() / temperature
        lp = torch.log_softmax(logits, -1)[len(p) - 1 : len(p) + len(r) - 1]
        out.append(lp.gather(1, torch.tensor(list(r))[:, None])[:, 0].tolist())
    return out
