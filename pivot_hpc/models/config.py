"""Config of the tiny models (sizes, SFT warm-up) and where they are cached."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from pivot_hpc.errors import fail


@dataclass(kw_only=True)
class ModelConfig:
    """A dense Llama-family decoder: Qwen2 (the tiny models' default: q/k/v biases),
    Qwen3 (q/k norms, no biases) or Llama 3 (llama3 rope scaling). `vocab_size` is padded
    above the 99 char tokens so it divides any small tensor-parallel size (Megatron shards
    the vocabulary)."""

    hidden_size: int = 128  # model width
    num_layers: int = 2  # decoder layers
    num_heads: int = 4  # attention heads
    num_kv_heads: int = 2  # key/value heads (GQA; divides num_heads)
    intermediate_size: int = 384  # SwiGLU MLP width
    vocab_size: int = 128  # embedding rows (char tokens + padding)
    max_position_embeddings: int = 512  # longest sequence, in tokens
    rope_theta: float = 10000.0  # rotary embedding base
    rms_norm_eps: float = 1e-6  # RMSNorm epsilon
    tie_word_embeddings: bool = False  # output layer shares the embedding
    initializer_range: float = 0.02  # std of the random initial weights
    head_dim: int | None = None  # per-head width; None = hidden_size / num_heads (Qwen3 sets it)
    qkv_bias: bool = True  # q/k/v projections carry a bias (Qwen2; not Qwen3 or Llama)
    qk_norm: bool = False  # RMSNorm on each head's queries and keys before rotary (Qwen3)
    # Llama 3's rope scaling (transformers' rope_type "llama3"); 0 = none
    rope_llama3_factor: float = 0.0
    rope_llama3_low_freq_factor: float = 1.0  # (its low_freq_factor)
    rope_llama3_high_freq_factor: float = 4.0  # (its high_freq_factor)
    rope_llama3_original_max_position: int = 8192  # (its original_max_position_embeddings)

    def head_size(self) -> int:
        """Each attention head's width."""
        return self.head_dim or self.hidden_size // self.num_heads

    def validate(self, path: str) -> None:
        if self.head_dim is None and self.hidden_size % self.num_heads:
            fail(f"{path}.hidden_size", self.hidden_size, "must be a multiple of num_heads")
        if self.num_heads % self.num_kv_heads:
            fail(f"{path}.num_kv_heads", self.num_kv_heads, "must divide num_heads")
        if self.vocab_size < 99:
            fail(f"{path}.vocab_size", self.vocab_size, "the char tokenizer needs >= 99 ids")
        for name in ("num_layers", "intermediate_size", "max_position_embeddings"):
            if getattr(self, name) < 1:
                fail(f"{path}.{name}", getattr(self, name), "must be >= 1")


@dataclass(kw_only=True)
class SFTConfig:
    """The Megatron SFT warm-up that gives a tiny model its starting skill."""

    steps: int = 300  # optimizer steps of the warm-up
    batch_size: int = 64  # examples per step
    lr: float = 3e-3  # peak learning rate
    warmup_steps: int = 20  # linear learning-rate warm-up
    weight_decay: float = 0.0  # AdamW weight decay
    # Policy only: the share of warm-up problems with a carry whose worked solution comes
    # from a teacher who forgets the carry ("7+8=15,4+3=7.Answer: 75"). Above 0.5 the
    # warmed-up policy's greedy answer forgets it too, while sampling still finds the carry
    # sometimes: a systematic habit that the rewards expose and RL removes.
    carry_slip: float = 0.0
    # Policy only, with models.calculator: the share of warm-up problems the teacher answers
    # without the tool, "mentally", forgetting every carry ("Answer: 171" for 47+38+96) —
    # the mistakes RL fixes by calling the calculator instead.
    tool_slip: float = 0.0

    def validate(self, path: str) -> None:
        for name in ("carry_slip", "tool_slip"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                fail(f"{path}.{name}", getattr(self, name), "a share: must be in [0, 1]")
        if self.steps < 0:
            fail(f"{path}.steps", self.steps, "must be >= 0")
        if self.batch_size < 1:
            fail(f"{path}.batch_size", self.batch_size, "must be >= 1")
        if self.lr <= 0:
            fail(f"{path}.lr", self.lr, "learning rate must be > 0")


@dataclass(kw_only=True)
class TinyModelSpec:
    """One cached model: architecture plus the warm-up that made it."""

    arch: ModelConfig = field(default_factory=ModelConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)


def _default_policy() -> TinyModelSpec:
    # A full warm-up from a teacher who forgets the carry in 65% of the problems that have
    # one: the policy learns the column algorithm well but, greedily, forgets carries —
    # about half of the held-out problems right (a third of them carry), while sampling
    # still finds the carry a third of the time. That habit is what the rewards expose and
    # GRPO removes: greedy held-out accuracy 0.53 → 0.86–0.88 in 60 steps of 16×4 on
    # every trainer seed tried (0–4, single process). A plain short warm-up (90 steps, no
    # slip) leaves random mistakes instead, which 60 steps barely move (+0.14 at best).
    return TinyModelSpec(sft=SFTConfig(steps=300, carry_slip=0.65))


def _default_genrm() -> TinyModelSpec:
    # Reference-guided judging (copy the claim, mark the reference against it, score) takes
    # ~300 steps before the comparison "clicks": ~94% agreement with the verifier on
    # held-out judgements (200 steps stayed near 60%).
    return TinyModelSpec(sft=SFTConfig(steps=300, batch_size=32, lr=2e-3))


@dataclass(kw_only=True)
class ModelsConfig:
    """The policy and the GenRM of the embedded default, created deterministically per seed."""

    policy: TinyModelSpec = field(default_factory=_default_policy)
    genrm: TinyModelSpec = field(default_factory=_default_genrm)
    seed: int = 0  # seed of model creation and warm-up data
    cache_dir: Path | None = None  # None = $PIVOT_HPC_CACHE or ~/.cache/pivot_hpc
    max_digits: int = 2  # synthetic task: operands have 1..max_digits digits
    # synthetic task: numbers added per problem; 2 is "47+38=?" (worked column-wise), more
    # is "47+38+96=?", each number max_digits long, answered with no working: "Answer: 181"
    operands: int = 2
    # synthetic task: the policy's teacher calls the calculator first —
    # "<calc>47+38+96</calc>", observation "<result>181</result>", then "Answer: 181"
    # (issue 37; the run needs tools.enabled with the calculator: configs/tiny-tools.yaml)
    calculator: bool = False
    # Real models (Hugging Face directories on a shared file system; nothing is downloaded).
    # When set, they replace the tiny generated policy / GenRM above.
    policy_path: Path | None = None
    genrm_path: Path | None = None  # (the GenRM's directory)
    # The catalog model (`pivot-hpc calibration` lists them) each role is: what `pivot-hpc
    # simulate` costs and `pivot-hpc plan` sizes. None = the one its directory above names
    # (/models/Qwen2.5-7B-Instruct → qwen2.5-7b), so a deployment with model directories
    # names each model once; set it for a directory named otherwise, or with no directory
    # (the simulator then assumes the paper's group 2: qwen2.5-7b and qwen3-30b-a3b). A name
    # outside the catalog needs engines.<role>.throughput_profile with a `model:` section.
    policy_catalog: str | None = None
    genrm_catalog: str | None = None  # (the GenRM's catalog model)

    def catalog(self, role: str) -> str | None:
        """The model name `role` ("policy" or "genrm") is costed as: `<role>_catalog`, else
        its directory's name (the simulator's catalog maps variants such as
        Qwen2.5-7B-Instruct to its own names: sim/catalog.catalog_key), else None."""
        name = getattr(self, f"{role}_catalog")
        if name is not None:
            return name
        d = getattr(self, f"{role}_path")
        return None if d is None else Path(d).name

    def validate(self, path: str) -> None:
        if self.operands < 2:
            fail(f"{path}.operands", self.operands, "a sum needs >= 2 numbers")
        if self.max_digits < 1:
            fail(f"{path}.max_digits", self.max_digits, "must be >= 1")
        for name in ("policy_path", "genrm_path"):
            d = getattr(self, name)
            if d is not None and not (Path(d) / "config.json").is_file():
                fail(
                    f"{path}.{name}",
                    str(d),
                    "not a Hugging Face model directory (no config.json): give the local "
                    "directory of the model's weights, config and tokenizer",
                )


def cache_root(cache_dir: Path | str | None = None) -> Path:
    """Where models, tokenizers and profiles are cached."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("PIVOT_HPC_CACHE")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "pivot_hpc"
