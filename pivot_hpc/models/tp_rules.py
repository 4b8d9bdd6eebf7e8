"""Tensor-parallel rules from tensor names: how each tensor of a decoder is cut over tp ranks.

No code per architecture: the rules read a Hugging Face name (and the attention head counts
of the config) the way Megatron, vLLM and SGLang cut the common layouts:

- `q_proj` / `k_proj` / `v_proj` (weight and bias): column-split (dim 0) by whole heads;
  K/V by KV heads, replicated over tp / kv consecutive ranks when tp > kv heads.
- `o_proj`: row-split (dim 1) by heads; `gate_proj`, `up_proj` (dense, experts', shared
  expert's; Mixtral's `w1`/`w3`): column-split by channels; `down_proj` (`w2`): row-split.
  The bias of a row-split layer is added after the reduction: whole on every rank.
- fused `qkv_proj` ([q; k; v] rows, Phi-3 and vLLM) and `gate_up_proj` ([gate; up] rows,
  GLM-4's MLP: `Glm4MLP.forward` chunks the output in two, gate first): each part is cut on
  its own and a rank's shard is its parts stacked — [q_r; k_r; v_r], [gate_r; up_r], the
  per-rank layout of vLLM's QKVParallelLinear / MergedColumnParallelLinear.
- `embed_tokens` and `lm_head`: vocab-split by rows, ceil-divided (the last rank may hold
  fewer rows).
- norms, q/k norms, routers (`mlp.gate`), shared-expert gates: replicated.
- anything else — 3-D fused experts (their layouts differ between architectures: [E, 2I, H],
  Llama 4's transposed [E, H, 2I], gpt-oss's interleaved gate/up), `query_key_value`
  (per-head interleaved in GPT-NeoX and Bloom, [q; k; v] in ChatGLM), linear-attention
  projections, vision towers, MTP layers: held and read whole. Correct, only slower; the
  description logs which tensors once per model.

Head rules apply only inside the text decoder's layers (`<prefix>layers.N.`, prefix = where
`embed_tokens.weight` lives): a vision tower's `q_proj` has its own head count.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

TPKind = Literal["column", "row", "vocab", "replicated"]
Place = Literal["embed", "layer", "norm", "head", "other"]


@dataclass(frozen=True)
class Part:
    """A run of indivisible units along the split dimension (heads, channels, rows)."""

    units: int
    what: str  # for messages: "num_attention_heads=32", "size 768 of dim 0"
    replicable: bool = False  # KV heads: replicated over tp // units ranks when tp > units


@dataclass(frozen=True)
class TPRule:
    """How one tensor is cut: along `dim`, its `parts` each split over tp on their own (a
    rank's shard is its range of every part, in order); `dim` None = whole on every rank.
    `known` False: no rule knows the tensor (whole, and worth a log line)."""

    kind: TPKind
    dim: int | None = None
    parts: tuple[Part, ...] = ()
    known: bool = True

    @property
    def units(self) -> int:
        return sum(p.units for p in self.parts) if self.parts else 1

    @property
    def fused(self) -> bool:
        return len(self.parts) > 1

    def problem(self, tp: int) -> str | None:
        """Why tensor parallelism `tp` cannot cut this tensor, or None."""
        if self.dim is None or self.kind == "vocab" or tp == 1:
            return None
        for p in self.parts:
            if p.units % tp == 0 or (p.replicable and tp % p.units == 0):
                continue
            if p.replicable:
                name = p.what.split("=", 1)[0]
                return (
                    f"tp={tp} and {p.what} must divide one another (KV heads are split, or "
                    f"replicated when tp > {name})"
                )
            return f"{p.what} is not divisible by tp={tp}"
        return None

    def ranges(self, extent: int, tp: int, rank: int) -> list[tuple[int, int]]:
        """[lo, hi) along `dim` of each part that tp rank `rank` holds (absolute indices)."""
        if self.dim is None or tp == 1:
            return [(0, extent)]
        if self.kind == "vocab":
            per = -(-extent // tp)
            return [(min(extent, rank * per), min(extent, (rank + 1) * per))]
        unit = extent // self.units
        out, start = [], 0
        for p in self.parts:
            if p.units % tp == 0:
                per = p.units // tp
                lo, hi = rank * per, (rank + 1) * per
            elif p.replicable and tp % p.units == 0:  # consecutive ranks share a KV head
                u = rank // (tp // p.units)
                lo, hi = u, u + 1
            else:
                raise ValueError(f"{p.what}: cannot be split over tp={tp}")
            out.append((start + lo * unit, start + hi * unit))
            start += p.units * unit
        return out


WHOLE = TPRule("replicated", known=False)
REPLICATED = TPRule("replicated")

_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_COLUMN = {"gate_proj", "up_proj", "w1", "w3"}  # channels
_ROW = {"down_proj", "w2"}
_ROUTER = {"gate", "router", "shared_expert_gate"}


@dataclass(frozen=True)
class Placement:
    rule: TPRule
    place: Place  # embedding (first pipeline stage), layer, final norm / head (last), other
    layer: int | None


def text_prefix(names: list[str]) -> str | None:
    """Where the text decoder lives ("model.", "model.language_model."), or None."""
    found = [n[: -len("embed_tokens.weight")] for n in names if n.endswith("embed_tokens.weight")]
    # the decoder's embedding is the one with layers beside it (not an encoder's)
    with_layers = [p for p in found if any(n.startswith(p + "layers.") for n in names)]
    best = with_layers or found
    return min(best, key=len) if best else None


def place(
    name: str,
    shape: tuple[int, ...],
    prefix: str | None,
    *,
    heads: int,
    kv_heads: int,
    layers: int,
) -> Placement:
    """The rule and pipeline placement of one tensor."""
    last = name.rsplit(".", 2)[-2:]
    if len(shape) == 2 and last == ["lm_head", "weight"]:
        return Placement(_vocab(shape[0]), "head", None)
    local = name[len(prefix) :] if prefix is not None and name.startswith(prefix) else None
    if local == "embed_tokens.weight" and len(shape) == 2:
        return Placement(_vocab(shape[0]), "embed", None)
    if local is not None and local.startswith("norm."):
        return Placement(REPLICATED, "norm", None)
    m = _LAYER.fullmatch(local) if local is not None else None
    if m is None or int(m.group(1)) >= layers:  # not a decoder layer (a tower, an MTP layer)
        return Placement(REPLICATED if _is_norm(name, shape) else WHOLE, "other", None)
    return Placement(_layer_rule(m.group(2), shape, heads, kv_heads), "layer", int(m.group(1)))


def _layer_rule(sub: str, shape: tuple[int, ...], heads: int, kv_heads: int) -> TPRule:
    parts = sub.split(".")
    if len(parts) < 2 or parts[-1] not in ("weight", "bias"):
        return WHOLE
    module, param, nd = parts[-2], parts[-1], len(shape)
    if _is_norm(sub, shape):
        return REPLICATED
    if module in _ROUTER:
        return REPLICATED
    weight2d = param == "weight" and nd == 2
    bias1d = param == "bias" and nd == 1
    if not (weight2d or bias1d):
        return WHOLE  # 3-D fused experts and the like
    rows = shape[0]
    q = Part(heads, f"num_attention_heads={heads}")
    kv = Part(kv_heads, f"num_key_value_heads={kv_heads}", replicable=True)
    if module == "q_proj" and rows % heads == 0:
        return TPRule("column", 0, (q,))
    if module in ("k_proj", "v_proj") and rows % kv_heads == 0:
        return TPRule("column", 0, (kv,))
    if module == "qkv_proj" and rows % (heads + 2 * kv_heads) == 0:
        return TPRule("column", 0, (q, kv, kv))
    if module == "o_proj":
        if bias1d:
            return REPLICATED
        if shape[1] % heads == 0:
            return TPRule("row", 1, (q,))
        return WHOLE
    if module in _COLUMN:
        return TPRule("column", 0, (Part(rows, f"size {rows} of dim 0"),))
    if module == "gate_up_proj" and rows % 2 == 0:
        half = Part(rows // 2, f"size {rows // 2} of each half of dim 0")
        return TPRule("column", 0, (half, half))
    if module in _ROW:
        if bias1d:
            return REPLICATED
        return TPRule("row", 1, (Part(shape[1], f"size {shape[1]} of dim 1"),))
    return WHOLE


def _vocab(rows: int) -> TPRule:
    return TPRule("vocab", 0, (Part(rows, f"vocab_size={rows}"),))


def _is_norm(name: str, shape: tuple[int, ...]) -> bool:
    module = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else name
    return len(shape) <= 1 and ("norm" in module or module.startswith("ln"))
