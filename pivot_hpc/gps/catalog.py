"""Model catalog: a model's canonical tensors and how each is cut.

Canonical = HuggingFace names, shapes and row-major layouts (what `transformers` defines
and SGLang loads). A model from a directory (`ModelSpec.from_dir`) holds exactly the
tensors of its safetensors, under their names (models/description.py: headers only, no
weights); the catalog models (`PAPER_MODELS`, sizes for planning and benchmarks) and
`from_hf_config(dict)` build the dense Qwen2/Llama list. Either way each tensor's
tensor-parallel rule comes from its name (models/tp_rules.py): q/k/v rows and o_proj
columns are split by whole attention heads, gate/up rows and down_proj columns by
channels, fused qkv_proj / gate_up_proj part by part (a rank's shard is its parts
stacked), the vocabulary by rows (ceil-divided, so a vocabulary that tp does not divide
still works, the last rank holding fewer rows — the padded layouts of Megatron/SGLang
minus the padding), and a tensor no rule knows is held and read whole. K/V heads follow
Megatron/SGLang: with tp > num_kv_heads each KV head is replicated on tp/num_kv_heads
consecutive ranks.

GPS moves 2-D boxes: a tensor of any rank is seen as `rows x cols` (rows = the product of
the dimensions before its split dimension, or its first dimension), so a tp shard is one
box (row range, or column range), or one box per fused part. Pipeline parallelism gives
each stage a contiguous layer range; the embedding (and any tensor outside the decoder,
e.g. a vision tower) lives on the first stage, the final norm and lm_head on the last
(with tied embeddings and no lm_head tensor the last stage holds `embed_tokens` too, as
its lm_head). Data parallelism replicates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from math import prod
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from pivot_hpc.models.tp_rules import TPKind, TPRule, place

if TYPE_CHECKING:
    from pivot_hpc.models.description import ModelDescription

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# numpy has no bfloat16: its bit patterns travel and are returned as uint16.
NUMPY_DTYPE = {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32}

__all__ = [
    "DTYPE_BYTES",
    "PAPER_MODELS",
    "GPSError",
    "ModelSpec",
    "Parallelism",
    "TPKind",
    "TensorSpec",
]
Part = Literal["embed", "layer", "norm", "head", "other"]


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
    """One canonical tensor, its partition rule and where pipeline parallelism puts it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    rule: TPRule
    layer: int | None  # decoder layer index; None outside the decoder's layers
    part: Part  # embed (first stage), layer, norm / head (last stage), other (first stage)

    @property
    def tp_kind(self) -> TPKind:
        return self.rule.kind

    @property
    def split_dim(self) -> int | None:
        """Dimension cut by tensor parallelism; None = whole on every rank."""
        return self.rule.dim

    @property
    def units(self) -> int:
        return self.rule.units

    @property
    def rows(self) -> int:
        """Rows of the 2-D form GPS moves (see the module docstring)."""
        if not self.shape:
            return 1
        d = self.rule.dim
        return self.shape[0] if not d else prod(self.shape[:d])

    @property
    def cols(self) -> int:
        if not self.shape:
            return 1
        return prod(self.shape[self.rule.dim or 1 :])

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.rows * self.cols * self.itemsize


@dataclass(frozen=True)
class ModelSpec:
    """A model GPS holds: its architecture numbers (HF config.json names) and its tensors.

    `tensor_list` None: the dense Qwen2/Llama list these numbers give (catalog models);
    else a directory's own tensors (`from_dir`). `dataclasses.replace(spec, dtype=...)`
    gives the same tensors in another dtype (the optimizer state elastic training keeps).
    """

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
    tensor_list: tuple[TensorSpec, ...] | None = field(default=None, repr=False)
    described_dtype: str | None = None  # the dtype tensor_list was described in
    source: str | None = None  # the directory it was described from

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
        """A dense Qwen2/Llama model from config.json values (a dict); given a directory
        (or its config.json), that directory's own tensors (`from_dir`)."""
        if not isinstance(config, dict):
            p = Path(config)
            return cls.from_dir(p if p.is_dir() else p.parent, name=name)
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

    @classmethod
    def from_dir(cls, model_dir: str | Path, name: str | None = None) -> ModelSpec:
        """The model of a Hugging Face directory: its safetensors' tensors, names, shapes
        and dtypes, read from the headers (models/description.py, cached)."""
        from pivot_hpc.models.description import description_of

        return cls.from_description(description_of(model_dir), name=name)

    @classmethod
    def from_description(cls, desc: ModelDescription, name: str | None = None) -> ModelSpec:
        tensors = tuple(
            TensorSpec(t.name, t.shape, t.dtype, t.rule, t.layer, t.place) for t in desc.tensors
        )
        return cls(
            hidden_size=desc.hidden_size,
            num_hidden_layers=desc.num_hidden_layers,
            num_attention_heads=desc.num_attention_heads,
            num_key_value_heads=desc.num_key_value_heads,
            intermediate_size=desc.intermediate_size or 0,
            vocab_size=desc.vocab_size,
            tie_word_embeddings=desc.tie_word_embeddings,
            head_dim=desc.head_dim,
            attention_bias=any(t.name.endswith("q_proj.bias") for t in tensors),
            dtype=desc.weights_dtype,
            name=name or desc.path.name,
            tensor_list=tensors,
            described_dtype=desc.weights_dtype,
            source=str(desc.path),
        )

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @cached_property
    def tensors(self) -> tuple[TensorSpec, ...]:
        if self.tensor_list is None:
            return tuple(_build_tensors(self))
        if self.dtype == self.described_dtype:
            return self.tensor_list
        # another dtype for the same tensors (replace(spec, dtype=...)): all of them in it
        return tuple(dataclasses.replace(t, dtype=self.dtype) for t in self.tensor_list)

    @cached_property
    def index(self) -> dict[str, int]:
        return {t.name: i for i, t in enumerate(self.tensors)}

    @property
    def has_lm_head(self) -> bool:
        return any(t.part == "head" for t in self.tensors)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def num_params(self) -> int:
        return sum(t.rows * t.cols for t in self.tensors)

    def as_stored(self, weights: Mapping[str, Any]) -> dict[str, Any]:
        """A trainer's full export (torch tensors under HF names) as a Write of this
        model takes it: each tensor in its storage dtype (a bf16 trainer publishes into
        an fp32 policy). A trainer exports an `lm_head.weight` for tied embeddings too
        (transformers' state dicts list the tied head); here it is no tensor of its own,
        the embedding is (engines tie it on load), so it is left out. Any other name this
        model lacks is a GPSError naming it."""
        import torch

        stored = {t.name: t for t in self.tensors}
        tied_head = "lm_head.weight" if self.tie_word_embeddings and not self.has_lm_head else None
        unknown = sorted(k for k in weights if k not in stored and k != tied_head)
        if unknown:
            raise GPSError(
                f"model {self.name!r} ({self.source or 'catalog'}) has no tensors {unknown[:4]}"
                f"{' ...' if len(unknown) > 4 else ''}: the trainer's architecture is not "
                "the directory's"
            )
        return {
            k: v.detach().to(getattr(torch, stored[k].dtype)).contiguous()
            for k, v in weights.items()
            if k in stored
        }

    def check(self, par: Parallelism) -> None:
        """Raise GPSError naming the first tensor whose split `par.tp` cannot make, the
        number it does not divide and the tp values this model takes."""
        n = self.name
        for t in self._split_kinds():
            why = t.rule.problem(par.tp)
            if why is not None:
                raise GPSError(
                    f"model {n!r}: {why} (tensor {t.name!r}); choose tp among {self.valid_tp()}"
                )
        if par.pp > self.num_hidden_layers:
            raise GPSError(
                f"model {n!r}: pp={par.pp} exceeds num_hidden_layers={self.num_hidden_layers}; "
                "each pipeline stage needs at least one layer"
            )

    def valid_tp(self, limit: int = 128) -> list[int]:
        """The tensor-parallel sizes up to `limit` that every split tensor allows."""
        kinds = self._split_kinds()
        return [tp for tp in range(1, limit + 1) if all(t.rule.problem(tp) is None for t in kinds)]

    def _split_kinds(self) -> list[TensorSpec]:
        """One tensor per distinct rule, in tensor order (a 128-expert model has thousands
        of tensors and a handful of rules)."""
        seen: dict[TPRule, TensorSpec] = {}
        for t in self.tensors:
            if t.rule.dim is not None:
                seen.setdefault(t.rule, t)
        return list(seen.values())

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
            tied = self.tie_word_embeddings and not self.has_lm_head
            return (0, pp - 1) if tied and pp > 1 else (0,)
        if t.part == "other":
            return (0,)
        return (pp - 1,)

    def stage_tensors(self, pp: int, stage: int) -> list[int]:
        """Indices (into `tensors`) held by one pipeline stage, in catalog order."""
        return [i for i, t in enumerate(self.tensors) if stage in self.stages_of(t, pp)]

    def tp_ranges(self, t: TensorSpec, tp: int, rank: int) -> list[tuple[int, int]]:
        """[lo, hi) along t.split_dim of each part tp rank `rank` holds (one range unless
        the tensor is fused; the full extent for a whole tensor)."""
        if t.split_dim is None or tp == 1:
            return [(0, t.shape[t.split_dim or 0] if t.shape else 1)]
        try:
            return t.rule.ranges(t.shape[t.split_dim], tp, rank)
        except ValueError as exc:
            raise GPSError(f"tensor {t.name!r}: {exc}") from None

    def tp_range(self, t: TensorSpec, tp: int, rank: int) -> tuple[int, int]:
        """The one range of an unfused tensor (`tp_ranges`)."""
        ranges = self.tp_ranges(t, tp, rank)
        if len(ranges) != 1:
            raise GPSError(f"tensor {t.name!r} is fused ({len(ranges)} parts): use tp_ranges")
        return ranges[0]

    def shard_boxes(self, t: TensorSpec, tp: int, rank: int) -> list[tuple[int, int, int, int]]:
        """The target slices (r0, r1, c0, c1) in 2-D coordinates of a tensor on one TP
        rank; the shard is these boxes back to back (one box unless the tensor is fused,
        whose parts are split along dim 0)."""
        d = t.split_dim
        if d is None or tp == 1:
            return [(0, t.rows, 0, t.cols)]
        ranges = self.tp_ranges(t, tp, rank)
        if d == 0:
            return [(lo, hi, 0, t.cols) for lo, hi in ranges]
        inner = prod(t.shape[d + 1 :])
        return [(0, t.rows, lo * inner, hi * inner) for lo, hi in ranges]

    def shard_box(self, t: TensorSpec, tp: int, rank: int) -> tuple[int, int, int, int]:
        """The one target slice of an unfused tensor on one TP rank (`shard_boxes`)."""
        boxes = self.shard_boxes(t, tp, rank)
        if len(boxes) != 1:
            raise GPSError(f"tensor {t.name!r} is fused ({len(boxes)} boxes): use shard_boxes")
        return boxes[0]

    def shard_shape(self, t: TensorSpec, tp: int, rank: int) -> tuple[int, ...]:
        d = t.split_dim
        if d is None or tp == 1:
            return t.shape
        extent = sum(hi - lo for lo, hi in self.tp_ranges(t, tp, rank))
        return (*t.shape[:d], extent, *t.shape[d + 1 :])


def _build_tensors(m: ModelSpec) -> list[TensorSpec]:
    """The dense Qwen2/Llama list of a catalog model, each tensor with its name's rule."""
    h, d, nh, nkv = m.hidden_size, m.hd, m.num_attention_heads, m.num_key_value_heads
    inter = m.intermediate_size
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (m.vocab_size, h))]
    for i in range(m.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.append((p + "input_layernorm.weight", (h,)))
        for proj, heads in (("q", nh), ("k", nkv), ("v", nkv)):
            shapes.append((p + f"self_attn.{proj}_proj.weight", (heads * d, h)))
            if m.attention_bias:
                shapes.append((p + f"self_attn.{proj}_proj.bias", (heads * d,)))
        shapes.append((p + "self_attn.o_proj.weight", (h, nh * d)))
        shapes.append((p + "post_attention_layernorm.weight", (h,)))
        shapes.append((p + "mlp.gate_proj.weight", (inter, h)))
        shapes.append((p + "mlp.up_proj.weight", (inter, h)))
        shapes.append((p + "mlp.down_proj.weight", (h, inter)))
    shapes.append(("model.norm.weight", (h,)))
    if not m.tie_word_embeddings:
        shapes.append(("lm_head.weight", (m.vocab_size, h)))
    out = []
    for name, shape in shapes:
        pl = place(name, shape, "model.", heads=nh, kv_heads=nkv, layers=m.num_hidden_layers)
        out.append(TensorSpec(name, shape, m.dtype, pl.rule, pl.layer, pl.place))
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
