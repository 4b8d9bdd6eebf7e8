"""The RL step's batch: rewarded trajectories → what the trainer consumes (paper §3, GRPO).

The RL side owns this: group-relative advantages over each prompt's samples and the
truncation mask are decided here, once, for every cluster — the live cluster adapter only
says where each sample's tokens are.

A multi-turn (tool-calling) sample's response is every token after the prompt: generated
segments and the tool observations between them. Its `loss_mask` says which are which
(1 = generated, trained on; 0 = observation, never trained on, issue 37), so one batch
carries single-turn and multi-turn samples alike.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from pivot_hpc.rl.config import GRPOConfig
from pivot_hpc.rl.grpo import group_advantages

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TrainBatch:
    """Trajectories for one optimizer step. Sequence i is `prompt_ids[i] + response_ids[i]`;
    the loss covers response tokens only, and of those only where `loss_tokens(i)` is 1."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    advantages: list[float] = field(default_factory=list)  # GRPO: one per sequence
    old_logprobs: list[list[float]] | None = None  # rollout logprobs (behaviour policy)
    ref_logprobs: list[list[float]] | None = None  # for the optional KL term
    versions: list[int] | None = None  # policy version that generated each sequence
    truncated: list[bool] | None = None  # True: cut at the length limit (no loss if masked)
    # Per response token: 1 = generated (in the loss), 0 = tool observation (no loss, no
    # token count, no gradient); None = every response token is generated (single turn).
    loss_mask: list[list[int]] | None = None

    def __post_init__(self) -> None:
        # A mask that does not line up with its responses would train on the wrong
        # tokens silently (e.g. a batch split by rows that forgot this field): refuse it.
        if self.loss_mask is None:
            return
        if len(self.loss_mask) != len(self.response_ids):
            raise ValueError(
                f"TrainBatch: {len(self.loss_mask)} loss_mask rows for "
                f"{len(self.response_ids)} responses (split batches with TrainBatch.rows)"
            )
        for i, (m, r) in enumerate(zip(self.loss_mask, self.response_ids, strict=True)):
            if len(m) != len(r):
                raise ValueError(
                    f"TrainBatch: loss_mask[{i}] has {len(m)} entries for {len(r)} response tokens"
                )

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def loss_tokens(self, i: int) -> list[int]:
        """Which response tokens of sequence i carry loss: none for a masked truncated
        sequence, else its loss mask (all ones without one)."""
        n = len(self.response_ids[i])
        if self.truncated and self.truncated[i]:
            return [0] * n
        if self.loss_mask is None:
            return [1] * n
        return list(self.loss_mask[i])

    def rows(self, indices: Iterable[int]) -> TrainBatch:
        """The sub-batch of sequences `indices` (a data-parallel shard), every
        per-sequence field picked alike."""
        idx = list(indices)

        def pick(xs):
            return None if xs is None else [xs[i] for i in idx]

        return replace(
            self,
            prompt_ids=pick(self.prompt_ids),
            response_ids=pick(self.response_ids),
            advantages=pick(self.advantages) if self.advantages else [],
            old_logprobs=pick(self.old_logprobs),
            ref_logprobs=pick(self.ref_logprobs),
            versions=pick(self.versions),
            truncated=pick(self.truncated),
            loss_mask=pick(self.loss_mask),
        )


@dataclass(frozen=True, slots=True)
class Trajectory:
    """One rewarded sample as training sees it."""

    prompt_index: int  # samples of one prompt form a GRPO group
    reward: float
    prompt_ids: list[int]
    response_ids: list[int]  # generated and (multi-turn) tool-observation tokens
    logprobs: list[float] | None  # the behaviour policy's, per response token (0.0: masked)
    version: int  # policy version that generated it
    truncated: bool  # stopped at the response length limit
    loss_mask: list[int] | None = None  # 1 = generated, 0 = observation; None = all 1


def assemble(trajectories: Sequence[Trajectory], grpo: GRPOConfig) -> TrainBatch:
    """The batch of one RL step, with group-relative advantages."""
    adv = group_advantages(
        [t.reward for t in trajectories],
        [t.prompt_index for t in trajectories],
        normalize_std=grpo.normalize_std,
        std=grpo.std,
    )
    logprobs, masks = _finite_logprobs(trajectories)
    masked = any(m is not None for m in masks)
    return TrainBatch(
        prompt_ids=[t.prompt_ids for t in trajectories],
        response_ids=[t.response_ids for t in trajectories],
        advantages=adv,
        old_logprobs=logprobs,
        versions=[t.version for t in trajectories],
        truncated=[t.truncated for t in trajectories] if grpo.mask_truncated else None,
        loss_mask=(
            [
                m if m is not None else [1] * len(t.response_ids)
                for t, m in zip(trajectories, masks, strict=True)
            ]
            if masked
            else None
        ),
    )


def _finite_logprobs(
    trajectories: Sequence[Trajectory],
) -> tuple[list[list[float] | None], list[list[int] | None]]:
    """The behaviour logprobs as they enter the batch, checked finite: a token an engine
    gave a NaN or infinite logprob (a numerical fault, or -inf from a sampler that kept a
    token it gives no mass) carries no loss — masked, its placeholder 0.0 — rather than
    poison the ratio of the whole step. Returns (logprobs, loss masks: None = all 1)."""
    logprobs: list[list[float] | None] = []
    masks: list[list[int] | None] = []
    bad = 0
    for t in trajectories:
        mask = list(t.loss_mask) if t.loss_mask is not None else None
        lp = t.logprobs
        if lp is not None and not all(math.isfinite(x) for x in lp):
            lp = list(lp)
            mask = mask or [1] * len(t.response_ids)
            for i, x in enumerate(lp):
                if not math.isfinite(x):
                    bad += mask[i] if i < len(mask) else 0
                    lp[i] = 0.0
                    if i < len(mask):
                        mask[i] = 0
        logprobs.append(lp)
        masks.append(mask)
    if bad:
        log.warning("%d response tokens with non-finite rollout logprobs: not trained on", bad)
    return logprobs, masks
