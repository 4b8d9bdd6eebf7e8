"""The one reader of a model's shape: a Hugging Face directory described without its weights.

`describe(dir)` reads `config.json` (and a nested `text_config` where a multimodal model
keeps its decoder's numbers there, as Qwen3.5-MoE does), `generation_config.json`, and the
safetensors headers (`safetensors_headers.py`): architecture, dtype, sizes, attention and
MoE facts, RoPE, EOS ids, and every tensor's name, shape, dtype and place in its file, in
file order, each with its tensor-parallel rule (`tp_rules.py`). No weight is read, nothing
is unpickled, no process loads a model to learn its shape. `description_of(dir)` is the
same, cached per directory and file stamps: GPS, the planner, the engines' launchers and
the trainer ask it instead of reading configs themselves.

Every problem a user can cause (no config.json, no safetensors, a corrupt header, a
quantised dtype, a config missing a size) is one ModelDirError line naming the file and the
fix.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pivot_hpc.errors import short_repr
from pivot_hpc.models.safetensors_headers import INDEX_NAME, ModelDirError, read_headers, read_json
from pivot_hpc.models.tp_rules import Place, TPRule, place, text_prefix

log = logging.getLogger(__name__)

MAX_CONFIG_BYTES = 16 << 20
# where multimodal configs keep their text decoder's numbers
NESTED_TEXT = ("text_config", "llm_config", "language_config")
# layer types that keep a per-token KV cache (the others hold a recurrent state)
KV_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "attention")
STAMPED = ("config.json", "generation_config.json", INDEX_NAME)

__all__ = ["ModelDescription", "ModelDirError", "TensorInfo", "describe", "description_of"]


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the checkpoint, as its header declares it, with its parallel rule."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # "bfloat16", "float16", "float32"
    file: str  # file name inside the directory
    begin: int  # absolute byte offsets of its data in that file
    end: int
    rule: TPRule
    place: Place  # "embed" | "layer" | "norm" | "head" | "other"
    layer: int | None  # decoder layer index when place == "layer"

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class ModelDescription:
    """What a model directory says about itself (Hugging Face config.json names)."""

    path: Path
    architectures: tuple[str, ...]
    model_type: str  # config.json's (the multimodal wrapper's, for a nested config)
    text_model_type: str  # the text decoder's (== model_type unless nested)
    dtype: str  # config's dtype (torch name), else the weights'
    weights_dtype: str  # the dtype most weight bytes are stored in
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int | None  # dense MLP width (None: pure MoE without one)
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int | None
    eos_token_ids: tuple[int, ...]  # config.json's, then generation_config.json's
    num_experts: int  # 0 for dense models
    num_experts_per_tok: int
    moe_intermediate_size: int | None
    shared_expert_intermediate_size: int | None
    rope_theta: float | None
    rope_scaling: dict[str, Any] | None = field(hash=False)  # rope_type + its parameters
    partial_rotary_factor: float = 1.0
    layer_types: tuple[str, ...] = ()  # hybrid models: "full_attention", "linear_attention"
    text_prefix: str | None = None  # "model.", "model.language_model."; None: not found
    tensors: tuple[TensorInfo, ...] = field(default=(), repr=False)
    config: dict[str, Any] = field(default_factory=dict, repr=False, compare=False, hash=False)

    @functools.cached_property
    def _index(self) -> dict[str, int]:
        return {t.name: i for i, t in enumerate(self.tensors)}

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tensors]

    def tensor(self, name: str) -> TensorInfo:
        i = self._index.get(name)
        if i is None:
            raise ModelDirError(f"{self.path}: no tensor {short_repr(name)} in its safetensors")
        return self.tensors[i]

    def __contains__(self, name: object) -> bool:
        return name in self._index

    @property
    def has_lm_head(self) -> bool:
        """Whether the checkpoint holds an output layer (tied models often do not)."""
        return any(t.place == "head" for t in self.tensors)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def kv_layers(self) -> int:
        """Layers that keep a per-token KV cache (hybrid models have fewer)."""
        if not self.layer_types:
            return self.num_hidden_layers
        return sum(t in KV_LAYER_TYPES for t in self.layer_types)

    @property
    def num_params(self) -> int:
        return sum(t.numel for t in self.tensors)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def whole_tensors(self) -> list[str]:
        """Tensors no parallel rule knows: held and read whole (correct, only slower)."""
        return [t.name for t in self.tensors if not t.rule.known]


def describe(model_dir: str | Path) -> ModelDescription:
    """Describe a Hugging Face model directory from its config and safetensors headers."""
    d = Path(model_dir)
    if not d.is_dir():
        raise ModelDirError(
            f"{d}: not a directory; give a Hugging Face model directory (config.json and "
            "*.safetensors)"
        )
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise ModelDirError(
            f"{d}: no config.json; give a Hugging Face model directory (config.json and "
            "*.safetensors)"
        )
    config = read_json(cfg_path, MAX_CONFIG_BYTES)
    gen_path = d / "generation_config.json"
    gen = read_json(gen_path, MAX_CONFIG_BYTES) if gen_path.is_file() else {}
    c = _Config(cfg_path, config)
    hidden = c.integer("hidden_size", "n_embd", "d_model")
    layers = c.integer("num_hidden_layers", "n_layer", "num_layers")
    heads = c.integer("num_attention_heads", "n_head", "num_heads")
    kv = c.integer("num_key_value_heads", "num_kv_heads", default=heads)
    if heads % kv:
        raise ModelDirError(
            f"{cfg_path}: num_attention_heads={heads} is not a multiple of "
            f"num_key_value_heads={kv}; fix the config"
        )
    headers = read_headers(d)
    names = [t.name for t in headers]
    prefix = text_prefix(names)
    tensors = []
    for h in headers:
        p = place(h.name, h.shape, prefix, heads=heads, kv_heads=kv, layers=layers)
        tensors.append(
            TensorInfo(h.name, h.shape, h.dtype, h.file, h.begin, h.end, p.rule, p.place, p.layer)
        )
    weights: Counter[str] = Counter()
    for t in tensors:
        weights[t.dtype] += t.nbytes
    weights_dtype = weights.most_common(1)[0][0] if weights else "float32"
    has_head = any(t.place == "head" for t in tensors)
    tied = c.get("tie_word_embeddings")
    theta, scaling, partial = _rope(c)
    desc = ModelDescription(
        path=d,
        architectures=tuple(str(a) for a in config.get("architectures") or ()),
        model_type=str(config.get("model_type", "")),
        text_model_type=str(c.text.get("model_type", config.get("model_type", ""))),
        dtype=_dtype(c.get("dtype") or c.get("torch_dtype")) or weights_dtype,
        weights_dtype=weights_dtype,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=c.integer("head_dim", default=hidden // heads),
        intermediate_size=c.integer(
            "intermediate_size", "ffn_hidden_size", "n_inner", default=None
        ),
        vocab_size=c.integer("vocab_size", "padded_vocab_size", "n_vocab"),
        # absent from config.json: what the checkpoint shows (no output layer = tied)
        tie_word_embeddings=bool(tied) if tied is not None else not has_head,
        max_position_embeddings=c.integer("max_position_embeddings", "n_positions", default=None),
        eos_token_ids=_eos(c, gen, d / "generation_config.json"),
        num_experts=c.integer(
            "num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", default=0
        ),
        num_experts_per_tok=c.integer("num_experts_per_tok", "moe_topk", default=0),
        moe_intermediate_size=c.integer("moe_intermediate_size", default=None),
        shared_expert_intermediate_size=c.integer("shared_expert_intermediate_size", default=None),
        rope_theta=theta,
        rope_scaling=scaling,
        partial_rotary_factor=partial,
        layer_types=tuple(str(x) for x in c.get("layer_types") or ()),
        text_prefix=prefix,
        tensors=tuple(tensors),
        config=config,
    )
    whole = desc.whole_tensors
    if whole:
        log.info(
            "%s: %d of %d tensors have no tensor-parallel rule and are held and read whole "
            "(correct, only slower), e.g. %s",
            d,
            len(whole),
            len(tensors),
            ", ".join(whole[:3]),
        )
    return desc


def description_of(model_dir: str | Path) -> ModelDescription:
    """`describe(model_dir)`, cached per directory and the stamps (mtime, size) of its
    config, index and safetensors files: a directory rewritten in place is read again."""
    d = Path(model_dir)
    stamp = []
    try:
        for p in sorted(d.iterdir()):
            if p.suffix == ".safetensors" or p.name in STAMPED:
                st = p.stat()
                stamp.append((p.name, st.st_mtime_ns, st.st_size))
    except OSError:
        return describe(d)  # not a readable directory: describe says so in one line
    return _cached(d.resolve(), tuple(stamp))


@functools.lru_cache(maxsize=64)
def _cached(d: Path, stamp: tuple) -> ModelDescription:
    return describe(d)


class _Config:
    """config.json's values, the nested text decoder's first where there is one."""

    def __init__(self, path: Path, config: dict) -> None:
        self.path = path
        self.top = config
        nested = [config[k] for k in NESTED_TEXT if isinstance(config.get(k), dict)]
        self.text: dict = nested[0] if nested else config
        self.where = next((k for k in NESTED_TEXT if config.get(k) is self.text), None)

    def get(self, key: str) -> Any:
        for src in (self.text, self.top):
            if src.get(key) is not None:
                return src[key]
        return None

    def integer(self, *keys: str, default: Any = ...) -> Any:
        for key in keys:
            v = self.get(key)
            if v is None:
                continue
            if type(v) is not int or v < 1:
                raise ModelDirError(
                    f"{self.path}: {key} = {short_repr(v)} must be an integer >= 1; fix the config"
                )
            return v
        if default is ...:
            inside = f" (nor in its {self.where})" if self.where else ""
            raise ModelDirError(
                f"{self.path}: no {keys[0]}{inside}; is this a Hugging Face causal language "
                "model's config?"
            )
        return default


def generation_limits(model_dir: str | Path) -> tuple[int | None, tuple[int, ...]]:
    """(max_position_embeddings or None, eos ids) from config.json and
    generation_config.json alone: what an engine sizes its sequences and stops by, for a
    directory whose weights it loads itself (no safetensors headers are read)."""
    d = Path(model_dir)
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise ModelDirError(f"{d}: no config.json; give a Hugging Face model directory")
    c = _Config(cfg_path, read_json(cfg_path, MAX_CONFIG_BYTES))
    gen_path = d / "generation_config.json"
    gen = read_json(gen_path, MAX_CONFIG_BYTES) if gen_path.is_file() else {}
    max_pos = c.integer("max_position_embeddings", "n_positions", default=None)
    return max_pos, _eos(c, gen, gen_path)


def _dtype(value: Any) -> str | None:
    return str(value).removeprefix("torch.") if value else None


def _eos(c: _Config, gen: dict, gen_path: Path) -> tuple[int, ...]:
    out: list[int] = []
    for where, src in ((c.path, c.top), (c.path, c.text), (gen_path, gen)):
        value = src.get("eos_token_id")
        for t in value if isinstance(value, list) else [value]:
            if t is None:
                continue
            if type(t) is not int or t < 0:
                raise ModelDirError(
                    f"{where}: eos_token_id {short_repr(value)} must be token ids (integers "
                    ">= 0); fix the file"
                )
            if t not in out:
                out.append(t)
    return tuple(out)


def _rope(c: _Config) -> tuple[float | None, dict | None, float]:
    """(theta, scaling dict or None, partial rotary factor): transformers 5 writes
    `rope_parameters`; older configs `rope_theta` and `rope_scaling`."""
    params = c.get("rope_parameters")
    params = dict(params) if isinstance(params, dict) else {}
    theta = params.pop("rope_theta", None) or c.get("rope_theta") or c.get("rotary_emb_base")
    partial = params.pop("partial_rotary_factor", None) or c.get("partial_rotary_factor") or 1.0
    scaling = c.get("rope_scaling")
    if not isinstance(scaling, dict):
        kind = params.get("rope_type", params.get("type", "default"))
        scaling = params if kind != "default" else None
    try:
        return (float(theta) if theta is not None else None), scaling, float(partial)
    except (TypeError, ValueError):
        raise ModelDirError(
            f"{c.path}: rope_theta {short_repr(theta)} / partial_rotary_factor "
            f"{short_repr(partial)} must be numbers; fix the config"
        ) from None
