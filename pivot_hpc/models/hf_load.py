"""A `transformers` model of any architecture from a directory's config, and its weights
filled by Hugging Face checkpoint name.

The model is built the way `transformers` builds it (`AutoConfig` from the directory's
config.json, `AutoModelForCausalLM.from_config`: no hub, no network, no remote code), so no
architecture needs code here. Its weights come from tensors under the names the
checkpoint stores them (what GPS holds, models/description.py), not from
`from_pretrained`: the hf engine is handed its weights by GPS at every shift-up and
weight update, so one path fills a model both from the directory and from GPS.

A checkpoint name is usually a parameter's name. Where `transformers` keeps a parameter
in another layout than the checkpoint (transformers 5 stacks a MoE layer's experts into
one `experts.gate_up_proj` [E, 2I, H] and one `experts.down_proj` [E, H, I], while the
checkpoint has `experts.{e}.gate_proj.weight`...), the library's own conversion mapping
for the model type says how (`get_checkpoint_conversion_mapping`); we apply the two
operations MoE checkpoints use (merge a module list, concatenate). A tied lm_head is not
a parameter of its own (`named_parameters` lists the embedding once): a checkpoint's
`lm_head.weight` beside tied embeddings is accepted and ignored.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from pivot_hpc.errors import PivotError
from pivot_hpc.models.tp_rules import text_prefix


class ModelBuildError(PivotError, ValueError):
    """A model directory whose config `transformers` cannot build, or whose tensors do not
    fill the model it builds."""


class WeightNamesError(ModelBuildError, KeyError):
    """Tensors handed to a model that are not the names it needs (a KeyError, as every
    engine's `load_weights` raises for them)."""

    __str__ = Exception.__str__  # one plain line, not KeyError's quoted repr


def build_model(model_dir: str | Path, *, dtype: torch.dtype = torch.float32):
    """The random-init `transformers` causal LM of `model_dir`'s config.json."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pivot_hpc.models.zoo import _quiet_transformers

    _quiet_transformers()
    path = Path(model_dir)
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelBuildError(
            f"{path / 'config.json'}: transformers cannot read this config ({first}); "
            "point the role at a Hugging Face model directory of an architecture the "
            "installed transformers knows (or upgrade transformers)"
        ) from None
    try:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except ValueError as exc:
        first = str(exc).strip().splitlines()[0]
        raise ModelBuildError(
            f"{path}: model_type {config.model_type!r} has no causal-LM class in "
            f"transformers ({first}); use a text decoder's directory"
        ) from None
    return model.eval()


@dataclass(frozen=True)
class _Source:
    """How one parameter is made from checkpoint tensors: `names[i]` are the tensors of
    source pattern i (one each for a plain parameter), `ops` the conversion steps."""

    names: tuple[tuple[str, ...], ...]
    ops: tuple[tuple[str, int], ...] = ()  # ("merge", dim) | ("concat", dim)


class WeightMap:
    """Which checkpoint tensors fill each parameter of `model` (see the module docstring).

    `expected`: every checkpoint name the model needs; `fill(get)` copies them in, `get`
    being name -> tensor (a TensorReader, or GPS's read dict's `__getitem__`).
    """

    def __init__(self, model, checkpoint_names: Iterable[str] | None = None) -> None:
        self.model = model
        converters = _converters(model.config.model_type)
        names = set(checkpoint_names) if checkpoint_names is not None else None
        prefix = text_prefix(sorted(names)) if names else None
        # the decoder's own names in the model's namespace ("model.…"): a multimodal
        # checkpoint keeps it under "model.language_model." (Qwen3.5-122B-A10B as shipped)
        local = _local_names(names, prefix) if names is not None else None
        local_names = None if local is None else set(local)
        self.sources: dict[str, _Source] = {}
        for pname in _filled(model, local_names):
            src = _source_of(pname, converters, local_names)
            if local is not None:
                src = _Source(tuple(tuple(local[n] for n in g) for g in src.names), src.ops)
            self.sources[pname] = src
        self.expected = frozenset(n for s in self.sources.values() for g in s.names for n in g)
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        # a tied head stored anyway, e.g. by an exporter that writes every state-dict entry
        ignored = {"lm_head.weight"} - self.expected if tied else set()
        # tensors outside the text decoder (a vision tower, multi-token-prediction layers)
        # are the checkpoint's, not this model's: left alone, not refused
        if prefix is not None:
            ignored |= {n for n in names if not n.startswith((prefix, "lm_head."))}
        self.ignored = frozenset(ignored)

    def check(self, names: Iterable[str], where: str) -> None:
        """Raise one line naming the first missing and unknown checkpoint tensors."""
        got = set(names)
        missing = sorted(self.expected - got)
        unknown = sorted(got - self.expected - self.ignored)
        if missing or unknown:
            arch = type(self.model).__name__
            parts = []
            if missing:
                parts.append(f"missing tensors {missing[:4]} ({len(missing)} in all)")
            if unknown:
                parts.append(f"unknown tensors {unknown[:4]} ({len(unknown)} in all)")
            raise WeightNamesError(
                f"{where}: {'; '.join(parts)} for {arch}; its config.json and safetensors "
                "must come from the same model"
            )

    @torch.no_grad()
    def fill(self, get: Callable[[str], torch.Tensor]) -> None:
        params = _filled(self.model, None)
        for pname, src in self.sources.items():
            p = params[pname]
            t = _assemble(src, get)
            if t.shape != p.shape:
                raise ModelBuildError(
                    f"tensor for parameter {pname} has shape {tuple(t.shape)}, "
                    f"{type(self.model).__name__} expects {tuple(p.shape)}; its config.json "
                    "and safetensors must come from the same model"
                )
            p.copy_(t.to(p.dtype))


def _local_names(names: set[str], prefix: str | None) -> dict[str, str]:
    """Model-namespace name -> checkpoint name, the text decoder's `prefix` made "model."."""
    if prefix is None or prefix == "model.":
        return {n: n for n in names}
    return {("model." + n[len(prefix) :] if n.startswith(prefix) else n): n for n in names}


def _filled(model, names: set[str] | None) -> dict[str, torch.Tensor]:
    """What a checkpoint fills: every parameter, and the persistent buffers a checkpoint
    holds (GLM-4.5's and DeepSeek-V3's router `e_score_correction_bias`); a persistent
    buffer the checkpoint lacks keeps the value the model was built with."""
    out = dict(model.named_parameters())
    persistent = set(model.state_dict(keep_vars=True))
    for bname, buf in model.named_buffers():
        if bname in persistent and bname not in out and (names is None or bname in names):
            out[bname] = buf
    return out


def load_weights_from_dir(model, model_dir: str | Path) -> WeightMap:
    """Fill `model` from the safetensors of `model_dir`, tensor by tensor (memory-mapped)."""
    from pivot_hpc.models.description import description_of
    from pivot_hpc.models.weights import TensorReader

    desc = description_of(model_dir)
    wmap = WeightMap(model, desc.names)
    wmap.check(desc.names, str(model_dir))
    with TensorReader(model_dir) as reader:
        wmap.fill(reader)
    return wmap


def load_hf_model(model_dir: str | Path, *, dtype: torch.dtype = torch.float32):
    """(model, WeightMap) of `model_dir`: built from its config, filled from its weights."""
    model = build_model(model_dir, dtype=dtype)
    return model, load_weights_from_dir(model, model_dir)


# ------------------------------------------------------------------ conversion mapping
@dataclass(frozen=True)
class _Converter:
    sources: tuple[str, ...]  # e.g. "mlp.experts.*.gate_proj.weight"
    target: str  # e.g. "mlp.experts.gate_up_proj"
    ops: tuple[tuple[str, int], ...]


def _converters(model_type: str) -> list[_Converter]:
    """transformers' checkpoint -> model conversions for `model_type` that change a
    tensor's layout (renamings of whole prefixes are of multimodal wrappers, not the
    causal LMs built here)."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # transformers < 5 keeps checkpoint layouts as parameters
        return []
    out = []
    for conv in get_checkpoint_conversion_mapping(model_type) or []:
        ops = getattr(conv, "operations", None)
        if not ops:
            continue
        steps = []
        for op in ops:
            kind = {"MergeModulelist": "merge", "Concatenate": "concat"}.get(type(op).__name__)
            if kind is None:
                steps = None
                break
            steps.append((kind, int(op.dim)))
        if steps is None or len(conv.target_patterns) != 1:
            continue  # handled below: its target parameter is reported as unfillable
        out.append(_Converter(tuple(conv.source_patterns), conv.target_patterns[0], tuple(steps)))
    return out


def _source_of(pname: str, converters: list[_Converter], names: set[str] | None) -> _Source:
    for conv in converters:
        if not pname.endswith(conv.target):
            continue
        prefix = pname[: -len(conv.target)]
        groups = []
        for pattern in conv.sources:
            head, _, tail = pattern.partition("*")
            if names is None:
                raise ModelBuildError(
                    f"parameter {pname}: its checkpoint names depend on the checkpoint; "
                    "build the WeightMap with checkpoint_names"
                )
            rx = re.compile(re.escape(prefix + head) + r"(\d+)" + re.escape(tail) + "$")
            found = sorted(
                ((int(m.group(1)), n) for n in names if (m := rx.match(n))), key=lambda x: x[0]
            )
            groups.append(tuple(n for _, n in found))
        if all(groups):
            return _Source(tuple(groups), conv.ops)
    # a plain parameter, or a stacked one whose checkpoint stores it stacked already: the
    # parameter's own name (a checkpoint without it is reported by `check`)
    return _Source(((pname,),))


def _assemble(src: _Source, get: Callable[[str], torch.Tensor]) -> torch.Tensor:
    if not src.ops:
        return get(src.names[0][0])
    parts: list[torch.Tensor] | None = None
    for kind, dim in src.ops:
        if kind == "merge":
            parts = [torch.stack([get(n) for n in group], dim=dim) for group in src.names]
        else:  # concat the (merged) sources
            assert parts is not None
            parts = [torch.cat(parts, dim=dim)]
    assert parts is not None and len(parts) == 1
    return parts[0]
