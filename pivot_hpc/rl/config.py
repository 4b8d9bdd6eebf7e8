"""Config of the training engine, GRPO, rewards and datasets."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pivot_hpc.errors import fail


@dataclass(kw_only=True)
class GRPOConfig:
    """GRPO with a PPO-clip loss over per-token logprobs (DAPO-style token-level mean)."""

    clip_low: float = 0.2  # ratio clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.28  # DAPO's clip-higher
    dual_clip: float = 3.0  # cap on the ratio's loss for negative advantages (0 = off)
    kl_coef: float = 0.0  # > 0 adds a k3 KL penalty against `ref_logprobs`
    normalize_std: bool = True  # divide by the group's std (GRPO); False = Dr.GRPO
    # which std: "population" (÷ n, the GRPO paper's) or "unbiased" (÷ n − 1, veRL's and
    # TRL's); a group of one sample has std 0 either way (advantage 0)
    std: Literal["population", "unbiased"] = "population"
    temperature: float = 1.0  # rollout temperature; training logprobs use the same
    # How token losses become the batch loss (veRL's names): "token-mean" = sum over every
    # response token / their count (DAPO); "seq-mean-token-mean" = each sequence's token
    # mean, averaged over sequences (GRPO paper); "seq-mean-token-sum" = each sequence's
    # token sum, averaged over sequences; "seq-mean-token-sum-norm" = each sequence's token
    # sum / rl.max_response_tokens, averaged over sequences (Dr.GRPO's constant normaliser).
    loss_agg_mode: Literal[
        "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
    ] = "token-mean"
    # DAPO's overlong filtering: responses cut at rl.max_response_tokens carry no loss
    # (their advantage still counts in their group's statistics)
    mask_truncated: bool = False
    # The trainer recomputes the old policy's logprobs with the weights before the update
    # (one extra forward; veRL's default) and takes the PPO ratio against them. Off: the
    # ratio is taken against the rollout engine's logprobs (no extra forward).
    recompute_old_logprobs: bool = False
    # Rollout/trainer mismatch correction (needs recompute_old_logprobs): per-token weight
    # w = exp(logp_trainer_old − logp_rollout). "truncate": the loss is weighted by
    # min(w, rollout_is_threshold) (TIS); "mask": tokens with w outside
    # [rollout_is_threshold_lower, rollout_is_threshold] carry no loss (masked IS).
    # Every step logs the mismatch (mean |Δlogp|, percentiles of w) when recomputing.
    rollout_is: Literal["none", "truncate", "mask"] = "none"
    # DAPO's dynamic sampling: a prompt whose samples all got the same reward (no signal)
    # leaves the batch and a fresh prompt takes its place, until the batch holds only
    # informative groups or dynamic_sampling_max_batches × loop.batch_prompts replacement
    # prompts were drawn for the step (then the step trains with what it has)
    dynamic_sampling: bool = False
    dynamic_sampling_max_batches: int = 4  # replacement prompts per step, in batches
    rollout_is_threshold: float = 2.0  # TIS cap; masked IS: upper bound
    rollout_is_threshold_lower: float | None = None  # None: 1 / rollout_is_threshold
    # The policy loss, as "package.module:function" (slime's --custom-loss-function-path).
    # It is called like pivot_hpc.rl.grpo.ppo_clip_loss — (logprobs, old_logprobs,
    # advantages, mask, *, clip_low, clip_high, dual_clip, kl_coef, ref_logprobs,
    # normalizer, loss_agg_mode, seq_normalizer, horizon, is_weights) — per micro-batch,
    # tensors [b, s], and returns (loss to backpropagate, {name: detached metric sum});
    # the module must be importable on every training rank.
    loss_fn: str = "pivot_hpc.rl.grpo:ppo_clip_loss"

    def validate(self, path: str) -> None:
        if self.std not in ("population", "unbiased"):
            fail(f"{path}.std", self.std, "valid choices: 'population', 'unbiased'")
        module, _, name = self.loss_fn.partition(":")
        if (
            not module
            or not name.isidentifier()
            or not all(part.isidentifier() for part in module.split("."))
        ):
            fail(f"{path}.loss_fn", self.loss_fn, "give it as 'package.module:function'")
        if self.rollout_is != "none" and not self.recompute_old_logprobs:
            fail(
                f"{path}.rollout_is",
                self.rollout_is,
                f"needs the trainer's old logprobs: set {path}.recompute_old_logprobs=true",
            )
        if self.dynamic_sampling_max_batches < 1:
            fail(
                f"{path}.dynamic_sampling_max_batches",
                self.dynamic_sampling_max_batches,
                "must be >= 1",
            )
        if self.rollout_is_threshold <= 0:
            fail(f"{path}.rollout_is_threshold", self.rollout_is_threshold, "must be > 0")
        low = self.rollout_is_threshold_lower
        if low is not None and not 0 <= low < self.rollout_is_threshold:
            fail(
                f"{path}.rollout_is_threshold_lower",
                low,
                f"must be >= 0 and below rollout_is_threshold={self.rollout_is_threshold}",
            )
        if not 0 <= self.clip_low < 1 or self.clip_high < 0:
            fail(f"{path}.clip_low", (self.clip_low, self.clip_high), "need 0 <= clip_low < 1")
        if self.dual_clip and self.dual_clip <= 1:
            fail(f"{path}.dual_clip", self.dual_clip, "must be > 1 (or 0 to disable)")
        if self.kl_coef < 0:
            fail(f"{path}.kl_coef", self.kl_coef, "must be >= 0")
        if self.temperature <= 0:
            fail(f"{path}.temperature", self.temperature, "training needs a temperature > 0")


@dataclass(kw_only=True)
class TrainerConfig:
    """The Megatron training engine."""

    engine: Literal["megatron"] = "megatron"  # the training engine
    tp: int = 1  # tensor parallelism of training
    lr: float = 1e-4  # Adam learning rate
    betas: tuple[float, float] = (0.9, 0.999)  # Adam betas
    weight_decay: float = 0.0  # AdamW weight decay
    eps: float = 1e-8  # Adam epsilon
    grad_clip: float = 1.0  # 0 = off
    warmup_steps: int = 0  # linear learning-rate warm-up steps
    micro_batch_size: int = 64  # sequences per forward/backward
    seed: int = 0  # initialisation / dropout seed of training
    # Parameter dtype of the Megatron model. "auto" = bf16 when a CUDA device is present
    # (fp32 master weights and Adam moments in the optimizer), fp32 on CPU (bit-exact
    # against the HF model, what the CPU tests compare).
    dtype: Literal["auto", "bf16", "fp32"] = "auto"
    # How long a torch.distributed collective among training ranks waits for the others
    # before failing: a checkpoint's barrier can wait while they finish inference, minutes
    # on a large model (the former fixed 120 s failed such saves)
    collective_timeout_s: float = 1800.0
    # Memory knobs. `pivot-hpc plan` (docs/guide/plan.md) sizes training's GPU memory for the
    # values set here and the launchers refuse a config that does not fit. The Megatron
    # engine runs `attention`, `recompute` and `distributed_optimizer` as set.
    # Attention: "local" = megatron's local layer spec (unfused: materialises the
    # [heads, s, s] scores, ~6 B x heads x s^2 per layer kept for backward); "sdpa" = a fused
    # kernel (flash / scaled_dot_product_attention) that never materialises them.
    attention: Literal["local", "sdpa"] = "local"
    # Shard the optimizer state (fp32 master weights + Adam moments, 12 B/param) over the
    # data-parallel ranks (ZeRO-1, engines/megatron/sharded_adam.py; with elastic training over the
    # training set only: joining replicas own none); false = a full copy per rank.
    distributed_optimizer: bool = False
    # Activation recompute: "none" keeps every layer's activations for backward;
    # "selective" recomputes core attention (drops the local spec's scores); "full" keeps
    # only each layer's input and re-runs the layer in backward (one more forward).
    recompute: Literal["none", "selective", "full"] = "none"
    # Where the training engine runs. in_rank = in the worker rank's own process; child =
    # in a child process of each training rank (engines/process/child.py `ChildTrainer`): a
    # death of one between steps replaces every training child on the same GPUs, refit
    # from GPS (the policy and the optimizer state, published after every step) — a
    # death inside a step still stops the job (docs/guide/vllm.md). Sharded optimizer: each
    # rank keeps its child's range in its own memory (12 B/parameter over the DP size).
    process: Literal["in_rank", "child"] = "in_rank"

    def validate(self, path: str) -> None:
        if self.process not in ("in_rank", "child"):
            fail(f"{path}.process", self.process, "valid choices: 'in_rank', 'child'")
        if self.dtype not in ("auto", "bf16", "fp32"):
            fail(f"{path}.dtype", self.dtype, "valid choices: 'auto', 'bf16', 'fp32'")
        if self.attention not in ("local", "sdpa"):
            fail(f"{path}.attention", self.attention, "valid choices: 'local', 'sdpa'")
        if self.recompute not in ("none", "selective", "full"):
            fail(f"{path}.recompute", self.recompute, "valid choices: 'none', 'selective', 'full'")
        if self.tp < 1:
            fail(f"{path}.tp", self.tp, "must be >= 1")
        if not math.isfinite(self.collective_timeout_s) or self.collective_timeout_s <= 0:
            fail(f"{path}.collective_timeout_s", self.collective_timeout_s, "must be > 0 seconds")
        if not math.isfinite(self.lr) or self.lr <= 0:
            fail(f"{path}.lr", self.lr, "learning rate must be > 0")
        if self.micro_batch_size < 1:
            fail(f"{path}.micro_batch_size", self.micro_batch_size, "must be >= 1")
        if self.grad_clip < 0:
            fail(f"{path}.grad_clip", self.grad_clip, "must be >= 0 (0 = off)")

    def resolved_dtype(self, cuda: bool) -> Literal["bf16", "fp32"]:
        """The dtype "auto" stands for on this machine (`cuda`: a CUDA device is used)."""
        if self.dtype == "auto":
            return "bf16" if cuda else "fp32"
        return self.dtype


@dataclass(kw_only=True)
class RewardConfig:
    """R = w_verifiable·R_verifiable + w_genrm·R_GenRM (paper §8.1: both weights 1)."""

    verifiable_weight: float = 1.0  # weight of the verifiable reward
    genrm_weight: float = 1.0  # weight of the GenRM reward
    correct_score: float = 1.0  # DAPO: +1 correct
    wrong_score: float = -1.0  # DAPO: -1 wrong or no answer
    genrm_max_score: float = 10.0  # GenRM scores are 0..max, mapped to [0, 1]
    genrm_max_tokens: int = 96  # judgements are ~60 chars on the synthetic task
    genrm_temperature: float = 0.0  # greedy judgements
    genrm_reference: bool = True  # show the GenRM the reference answer (reference-guided)
    # the GenRM's prompt goes through the GenRM's own chat template (its tokenizer's, not
    # the policy's) as one user message, when its tokenizer has one; false: its BOS + text
    genrm_chat_template: bool = True
    # DAPO's soft overlong punishment, added to the verifiable reward: 0 up to
    # rl.max_response_tokens − overlong_buffer_len tokens, then falling linearly to
    # −overlong_penalty_factor at rl.max_response_tokens (0 = off)
    overlong_buffer_len: int = 0
    overlong_penalty_factor: float = 1.0  # penalty at the limit

    def validate(self, path: str) -> None:
        if self.overlong_buffer_len < 0:
            fail(f"{path}.overlong_buffer_len", self.overlong_buffer_len, "must be >= 0 (0 = off)")
        if self.overlong_penalty_factor < 0:
            fail(f"{path}.overlong_penalty_factor", self.overlong_penalty_factor, "must be >= 0")
        for name in ("verifiable_weight", "genrm_weight"):
            v = getattr(self, name)
            if not math.isfinite(v) or v < 0:
                fail(f"{path}.{name}", v, "reward weights must be finite and >= 0")
        if self.genrm_max_score <= 0:
            fail(f"{path}.genrm_max_score", self.genrm_max_score, "must be > 0")


@dataclass(kw_only=True)
class DataConfig:
    """Training / validation prompts: the synthetic task, or local DAPO/AIME-style files."""

    train: Literal["synthetic"] | Path = "synthetic"  # training prompts (file or 'synthetic')
    validation: Literal["synthetic"] | Path | None = "synthetic"  # held-out prompts
    max_prompt_tokens: int = 2048  # longer prompts are counted as malformed and skipped
    # Columns of the files (a dotted key reaches into a nested column); when a row lacks
    # them, the known layouts are tried (DAPO-Math-17k, AIME-style problem/answer)
    prompt_key: str = "prompt"
    answer_key: str = "reward_model.ground_truth"  # (the ground truth's column)
    synthetic_seed: int = 0  # seed of the synthetic task
    # a prompt given as text goes to the policy as one user message through its chat
    # template, when its tokenizer has one (false: its BOS + the text, e.g. for a base model
    # trained on plain prompts); a prompt given as messages always goes through it
    apply_chat_template: bool = True

    def validate(self, path: str) -> None:
        for name in ("train", "validation"):
            value = getattr(self, name)
            if isinstance(value, Path) and not value.exists():
                fail(
                    f"{path}.{name}",
                    str(value),
                    "dataset file not found (nothing is downloaded at run time): give a local "
                    "JSONL/Parquet file, or 'synthetic' for the built-in arithmetic task",
                )


@dataclass(kw_only=True)
class RLConfig:
    """Prompts × samples per step live in the coordinator's `loop` section."""

    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    max_response_tokens: int = 64  # policy response limit (the paper: 15K)

    def validate(self, path: str) -> None:
        if self.max_response_tokens < 1:
            fail(f"{path}.max_response_tokens", self.max_response_tokens, "must be >= 1")
        if self.reward.overlong_buffer_len >= self.max_response_tokens:
            fail(
                f"{path}.reward.overlong_buffer_len",
                self.reward.overlong_buffer_len,
                f"must be below {path}.max_response_tokens={self.max_response_tokens}",
            )
