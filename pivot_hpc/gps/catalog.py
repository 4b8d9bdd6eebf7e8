"""Model catalog: the canonical tensors of a Qwen2/Llama-style model and how each is cut.

Canonical = HuggingFace names, shapes and row-major layouts (what `transformers` defines
and SGLang loads). Every tensor is at most 2-D. A tensor's tensor-parallel rule says along
which dimension it is split and in which *units*: q/k/v rows and o_proj columns are split
by whole attention heads, gate/up rows and down_proj columns by intermediate channels, the
vocabulary by rows (ceil-divided, so a vocabulary that tp does not divide still works, the
last rank holding fewer rows — the padded layouts of Megatron/SGLang minus the padding).
K/V heads follow Megatron/SGLang: with tp > num_kv_heads each KV head is replicated on
tp/num_kv_heads consecutive ranks. Pipeline parallelism gives each stage a contiguous
layer range; the embedding lives on the first stage, the final norm and lm_head on the
last (with tied embeddings the last stage holds `embed_tokens` too, as its lm_head).
Data parallelism replicates.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Literal

import numpy as np

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# numpy has no bfloat16: its bit patterns travel and are returned as uint16.
NUMPY_DTYPE = {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32}

TPKind = Literal["column", "row", "vocab", "replicated"]


class GPSError(ValueError):
    """A GPS request or layout is invalid; raised before any data moves."""


@dataclass(frozen=True)
class Parallelism:
    """How a model is laid out on the ranks G of one Read or Write.

    Rank order inside G (Megatron's default "tp-dp-pp"): tp varies fastest, then dp,
    then pp, i.e. G[i] has tp = i % tp, dp = (i // tp) % dp, pp = i // (tp * dp).
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise GPSError(f"Parallelism.{name} = {v!r}: must be an integer >= 1")

    @property
    def size(self) -> int:
        return self.tp * self.pp * self.dp

    def coords(self, index: int) -> tuple[int, int, int]:
        """(dp, pp, tp) coordinates of the index-th rank of G."""
        if not 0 <= index < self.size:
            raise GPSError(f"rank index {index} is outside G of size {self.size} ({self})")
        return (index // self.tp) % self.dp, index // (self.tp * self.dp), index % self.tp

    def index(self, dp: int, pp: int, tp: int) -> int:
        return tp + self.tp * (dp + self.dp * pp)


@dataclass(frozen=True)
class TensorSpec:
    """One canonical tensor and its partition rules."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    tp_kind: TPKind
    split_dim: int | None  # dimension cut by tensor parallelism; None = replicated
    units: int  # number of indivisible units along split_dim (heads, channels, rows)
    layer: int | None  # decoder layer index; None for embedding / final norm / lm_head
    part: Literal["embed", "layer", "norm", "head"]

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def cols(self) -> int:
        return self.shape[1] if len(self.shape) > 1 else 1

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.rows * self.cols * self.itemsize


@dataclass(frozen=True)
class ModelSpec:
    """Architecture numbers of a Qwen2/Llama-style decoder (HF config.json names)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    head_dim: int | None = None  # default hidden_size // num_attention_heads
    attention_bias: bool = True  # Qwen2: q/k/v have biases; Llama: none
    dtype: str = "bfloat16"
    name: str = "model"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise GPSError(
                f"model {self.name!r}: dtype {self.dtype!r} is not supported; "
                f"use one of {sorted(DTYPE_BYTES)}"
            )
        for f in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            if getattr(self, f) < 1:
                raise GPSError(f"model {self.name!r}: {f} = {getattr(self, f)} must be >= 1")
        if self.num_attention_heads % self.num_key_value_heads:
            raise GPSError(
                f"model {self.name!r}: num_attention_heads={self.num_attention_heads} is not a "
                f"multiple of num_key_value_heads={self.num_key_value_heads}"
            )

    @classmethod
    def from_hf_config(cls, config: dict | str | Path, name: str | None = None) -> ModelSpec:
        """Build from a HuggingFace config.json (a dict, the file, or its directory)."""
        if not isinstance(config, dict):
            p = Path(config)
            config = json.loads((p / "config.json" if p.is_dir() else p).read_text())
        heads = config["num_attention_heads"]
        dtype = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
        return cls(
            hidden_size=config["hidden_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads", heads),
            intermediate_size=config["intermediate_size"],
            vocab_size=config["vocab_size"],
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            head_dim=config.get("head_dim"),
            attention_bias=bool(
                config.get("attention_bias", config.get("model_type", "qwen2") == "qwen2")
            ),
            dtype=str(dtype).replace("torch.", ""),
            name=name or config.get("_name_or_path") or config.get("model_type", "model"),
        )

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @cached_property
    def tensors(self) -> tuple[TensorSpec, ...]:
        return tuple(_build_tensors(self))

    @cached_property
    def index(self) -> dict[str, int]:
        return {t.name: i for i, t in enumerate(self.tensors)}

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def num_params(self) -> int:
        return sum(t.rows * t.cols for t in self.tensors)

    def check(self, par: Parallelism) -> None:
        """Raise GPSError naming the number that `par` does not divide."""
        h, kv, n = self.num_attention_heads, self.num_key_value_heads, self.name
        if h % par.tp:
            raise GPSError(
                f"model {n!r}: num_attention_heads={h} is not divisible by tp={par.tp}; "
                f"choose tp among {_divisors(h)}"
            )
        if kv % par.tp and par.tp % kv:
            raise GPSError(
                f"model {n!r}: tp={par.tp} and num_key_value_heads={kv} must divide one "
                "another (KV heads are split, or replicated when tp > num_key_value_heads)"
            )
        if self.intermediate_size % par.tp:
            raise GPSError(
                f"model {n!r}: intermediate_size={self.intermediate_size} is not divisible "
                f"by tp={par.tp}; choose tp among {_divisors(self.intermediate_size)[:12]}"
            )
        if par.pp > self.num_hidden_layers:
            raise GPSError(
                f"model {n!r}: pp={par.pp} exceeds num_hidden_layers={self.num_hidden_layers}; "
                "each pipeline stage needs at least one layer"
            )

    def stage_layers(self, pp: int, stage: int) -> range:
        """Contiguous layer range of one pipeline stage (earlier stages take the extras)."""
        n = self.num_hidden_layers
        base, extra = divmod(n, pp)
        start = stage * base + min(stage, extra)
        return range(start, start + base + (stage < extra))

    def stages_of(self, t: TensorSpec, pp: int) -> tuple[int, ...]:
        """Pipeline stages that hold tensor `t`."""
        if t.part == "layer":
            assert t.layer is not None
            return (next(s for s in range(pp) if t.layer in self.stage_layers(pp, s)),)
        if t.part == "embed":
            return (0, pp - 1) if self.tie_word_embeddings and pp > 1 else (0,)
        return (pp - 1,)

    def stage_tensors(self, pp: int, stage: int) -> list[int]:
        """Indices (into `tensors`) held by one pipeline stage, in catalog order."""
        return [i for i, t in enumerate(self.tensors) if stage in self.stages_of(t, pp)]

    def tp_range(self, t: TensorSpec, tp: int, rank: int) -> tuple[int, int]:
        """[lo, hi) along t.split_dim held by tensor-parallel rank `rank` (full for replicated)."""
        if t.split_dim is None or tp == 1:
            return 0, t.shape[t.split_dim or 0]
        extent = t.shape[t.split_dim]
        if t.tp_kind == "vocab":
            per = -(-extent // tp)
            return min(extent, rank * per), min(extent, (rank + 1) * per)
        unit = extent // t.units
        if t.units % tp == 0:
            per = t.units // tp
            return rank * per * unit, (rank + 1) * per * unit
        if tp % t.units == 0:  # KV heads replicated over tp // units consecutive ranks
            u = rank // (tp // t.units)
            return u * unit, (u + 1) * unit
        raise GPSError(f"tensor {t.name!r}: {t.units} units cannot be split over tp={tp}")

    def shard_box(self, t: TensorSpec, tp: int, rank: int) -> tuple[int, int, int, int]:
        """The target slice (r0, r1, c0, c1) of a tensor on one TP rank, 2-D coordinates."""
        lo, hi = self.tp_range(t, tp, rank)
        if t.split_dim == 1:
            return 0, t.rows, lo, hi
        if t.split_dim == 0:
            return lo, hi, 0, t.cols
        return 0, t.rows, 0, t.cols

    def shard_shape(self, t: TensorSpec, tp: int, rank: int) -> tuple[int, ...]:
        r0, r1, c0, c1 = self.shard_box(t, tp, rank)
        return (r1 - r0, c1 - c0) if len(t.shape) == 2 else (r1 - r0,)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _build_tensors(m: ModelSpec) -> list[TensorSpec]:
    h, d, nh, nkv = m.hidden_size, m.hd, m.num_attention_heads, m.num_key_value_heads
    inter, dt = m.intermediate_size, m.dtype
    out = [TensorSpec("model.embed_tokens.weight", (m.vocab_size, h), dt, "vocab", 0, m.vocab_size, None, "embed")]  # fmt: skip
    for i in range(m.num_hidden_layers):
        p = f"model.layers.{i}."

        def ts(name, shape, kind, dim, units, i=i, p=p):
            return TensorSpec(p + name, shape, dt, kind, dim, units, i, "layer")

        out.append(ts("input_layernorm.weight", (h,), "replicated", None, 1))
        for proj, heads in (("q", nh), ("k", nkv), ("v", nkv)):
            out.append(ts(f"self_attn.{proj}_proj.weight", (heads * d, h), "column", 0, heads))
            if m.attention_bias:
                out.append(ts(f"self_attn.{proj}_proj.bias", (heads * d,), "column", 0, heads))
        out.append(ts("self_attn.o_proj.weight", (h, nh * d), "row", 1, nh))
        out.append(ts("post_attention_layernorm.weight", (h,), "replicated", None, 1))
        out.append(ts("mlp.gate_proj.weight", (inter, h), "column", 0, inter))
        out.append(ts("mlp.up_proj.weight", (inter, h), "column", 0, inter))
        out.append(ts("mlp.down_proj.weight", (h, inter), "row", 1, inter))
    out.append(TensorSpec("model.norm.weight", (h,), dt, "replicated", None, 1, None, "norm"))
    if not m.tie_word_embeddings:
        out.append(TensorSpec("lm_head.weight", (m.vocab_size, h), dt, "vocab", 0, m.vocab_size, None, "head"))  # fmt: skip
    return out


# The paper's policy models (published HuggingFace config.json values), plus the tiny
# CPU models of the embedded default.
PAPER_MODELS: dict[str, ModelSpec] = {
    "qwen2.5-1.5b": ModelSpec(
        name="qwen2.5-1.5b", hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, intermediate_size=8960, vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen2.5-7b": ModelSpec(
        name="qwen2.5-7b", hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, intermediate_size=18944, vocab_size=152064,
    ),
    "qwen2.5-32b": ModelSpec(
        name="qwen2.5-32b", hidden_size=5120, num_hidden_layers=64, num_attention_heads=40,
        num_key_value_heads=8, intermediate_size=27648, vocab_size=152064,
    ),
    "qwen2.5-72b": ModelSpec(
        name="qwen2.5-72b", hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, intermediate_size=29568, vocab_size=152064,
    ),
    "tiny-qwen2": ModelSpec(
        name="tiny-qwen2", hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
        head_dim=64, num_key_value_heads=2, intermediate_size=512, vocab_size=346,
    ),
    "tiny-llama": ModelSpec(
        name="tiny-llama", hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
        head_dim=64, num_key_value_heads=2, intermediate_size=512, vocab_size=346,
        attention_bias=False,
    ),
}  # fmt: skip
