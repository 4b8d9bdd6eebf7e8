"""GRPO: group-normalised advantages and the PPO-clip loss on per-token logprobs.

The importance ratio is taken against the *rollout* logprobs (the behaviour policy that
actually generated the tokens, possibly several versions stale in asynchronous modes),
so stale samples are corrected and clipped rather than trusted.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def group_advantages(
    rewards: Sequence[float],
    group_ids: Sequence[int],
    *,
    normalize_std: bool = True,
    std: str = "population",
) -> list[float]:
    """A_i = (r_i − mean_g) / (std_g + ε) within each group g of samples of one prompt.

    `std`: "population" divides the squared deviations by n (the GRPO paper's formula,
    ours by default), "unbiased" by n − 1 (what veRL and TRL compute: torch.std's
    default); with the group sizes GRPO uses (8–16) the two differ by 3–7 %. A group whose
    rewards are all equal carries no signal: its advantages are 0.
    """
    if std not in ("population", "unbiased"):
        raise ValueError(f"group_advantages: std={std!r}; valid: 'population', 'unbiased'")
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
            spread = x.std(unbiased=std == "unbiased") if x.numel() > 1 else torch.tensor(0.0)
            centred = centred / (spread + 1e-6)
        adv[idx] = centred
    return adv.tolist()


LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)


def aggregate(
    loss_tok: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    tokens: float | None = None,
    sequences: float | None = None,
    horizon: int | None = None,
) -> torch.Tensor:
    """The batch loss from token losses [b, s] under `mode` (see GRPOConfig.loss_agg_mode).

    `tokens` / `sequences` are the global counts of loss tokens / sequences the sum is
    divided by (default: this batch's), so micro-batches and data-parallel ranks add up to
    the loss of the whole batch. `horizon` is the constant length of
    "seq-mean-token-sum-norm" (rl.max_response_tokens).
    """
    masked = loss_tok * mask
    if mode == "token-mean":
        n = float(mask.sum().item()) if tokens is None else float(tokens)
        return masked.sum() / max(n, 1.0)
    per_seq = masked.sum(-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / mask.sum(-1).clamp(min=1.0)
    elif mode == "seq-mean-token-sum-norm":
        if not horizon:
            raise ValueError("aggregate: seq-mean-token-sum-norm needs the horizon")
        per_seq = per_seq / float(horizon)
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"aggregate: loss_agg_mode={mode!r}; valid: {', '.join(LOSS_AGG_MODES)}")
    n = float((mask.sum(-1) > 0).sum().item()) if sequences is None else float(sequences)
    return per_seq.sum() / max(n, 1.0)


def rollout_correction(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    upper: float,
    lower: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Importance weights for the rollout/trainer mismatch: w = exp(old − rollout) per
    token, where `old` is the trainer's logprob before the update and `rollout` the
    engine's. Returns (weights to multiply the token losses by, the mask to use, metrics).

    mode "truncate" (TIS): weights min(w, upper), mask unchanged; "mask": weights 1, and
    tokens with w outside [lower, upper] (lower defaults to 1/upper) leave the mask;
    "none": weights 1, mask unchanged (metrics only).
    """
    mask = mask.to(old_logprobs.dtype)
    on = mask > 0
    # off the mask (padding, tool observations) the rollout logprob is a placeholder: a
    # weight of exactly 1 there keeps an overflowing exp out of the loss (inf · 0 = nan)
    delta = torch.where(on, old_logprobs - rollout_logprobs, 0.0).detach()
    w = torch.exp(delta)
    seen = w[on]
    metrics: dict[str, float] = {
        "mismatch_abs_logp": float(delta[on].abs().mean()) if on.any() else 0.0
    }
    if seen.numel():
        q = torch.quantile(seen.double(), torch.tensor([0.05, 0.5, 0.95], dtype=torch.float64))
        metrics.update(is_ratio_p05=float(q[0]), is_ratio_p50=float(q[1]), is_ratio_p95=float(q[2]))
    ones = torch.ones_like(w)
    if mode == "truncate":
        metrics["is_truncated_frac"] = (
            float((seen > upper).double().mean()) if seen.numel() else 0.0
        )
        return w.clamp(max=upper), mask, metrics
    if mode == "mask":
        lo = 1.0 / upper if lower is None else lower
        keep = (w >= lo) & (w <= upper)
        metrics["is_masked_frac"] = float((~keep[on]).double().mean()) if seen.numel() else 0.0
        return ones, mask * keep.to(mask.dtype), metrics
    if mode != "none":
        raise ValueError(f"rollout_correction: mode={mode!r}; valid: 'none', 'truncate', 'mask'")
    return ones, mask, metrics


LOG_RATIO_BOUND = 20.0  # nats (veRL's bound of the PPO log-ratio)


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
    loss_agg_mode: str = "token-mean",
    seq_normalizer: float | None = None,
    horizon: int | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip loss. Shapes: [b, s] (advantages [b] or [b, s]); mask is 1 on response
    tokens that carry loss. Returns (the loss aggregated by `loss_agg_mode`, detached
    metrics sums).

    normalizer / seq_normalizer: the global token / sequence count the sums are divided by
    (default: this batch's); pass them when a batch is split into micro-batches.
    is_weights multiply the policy-gradient term per token (rollout mismatch correction).
    """
    mask = mask.to(logprobs.dtype)
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logprobs)
    # Off the mask (padding, tool-observation tokens) the old/ref logprobs are placeholders
    # (0.0 from the rollout): compare the policy with itself there, so the token's ratio is
    # 1 and its KL 0. Multiplying by the mask alone is not enough: an exp that overflows
    # at a masked token gives inf · 0 = nan, in the loss and in every gradient.
    on = mask > 0
    old_logprobs = torch.where(on, old_logprobs, logprobs.detach())
    if ref_logprobs is not None:
        ref_logprobs = torch.where(on, ref_logprobs, logprobs.detach())
    # bounded as veRL bounds it (±20 nats): one token whose old logprob is far below the
    # policy's (a rollout engine's -inf or -88) would overflow exp and put NaN into every
    # gradient; clamped, its gradient is zero and the rest of the batch trains
    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg = torch.maximum(unclipped, clipped)
    if dual_clip:
        # Dual clip (Ye et al. 2020): for A < 0 the loss is bounded by -A·c.
        pg = torch.where(advantages < 0, torch.minimum(pg, -advantages * dual_clip), pg)
    if is_weights is not None:
        pg = pg * is_weights.detach()
    loss_tok = pg
    kl = torch.zeros_like(pg)
    if kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("ppo_clip_loss: kl_coef > 0 needs ref_logprobs")
        d = (ref_logprobs - logprobs).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        kl = torch.exp(d) - d - 1.0  # k3 estimator, >= 0
        loss_tok = loss_tok + kl_coef * kl
    loss = aggregate(
        loss_tok,
        mask,
        loss_agg_mode,
        tokens=normalizer,
        sequences=seq_normalizer,
        horizon=horizon,
    )
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


def resolve_loss(spec: str, key: str = "rl.grpo.loss_fn"):
    """The loss function named "package.module:function" (see GRPOConfig.loss_fn)."""
    import importlib

    from pivot_hpc.errors import ConfigError

    module, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except ImportError as exc:
        raise ConfigError(
            f"config key '{key}' = {spec!r}: cannot import {module!r} ({exc}); put the module "
            "on PYTHONPATH of every rank, or use the default pivot_hpc.rl.grpo:ppo_clip_loss"
        ) from None
    except AttributeError:
        raise ConfigError(f"config key '{key}' = {spec!r}: {module!r} has no {name!r}") from None
    if not callable(fn):
        raise ConfigError(f"config key '{key}' = {spec!r}: {name!r} is not a function")
    return fn
