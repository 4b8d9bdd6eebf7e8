"""Megatron (local spec, tensor-parallel shards) ↔ canonical Hugging Face tensors of the
dense decoders the trainer trains: Qwen2/Qwen2.5, Qwen3 and Llama 3.

Canonical = the names and layouts of `transformers`' Qwen2ForCausalLM, Qwen3ForCausalLM
and LlamaForCausalLM (docs/design.md §4); they differ only in q/k/v biases (Qwen2) and
per-head q/k norms (Qwen3: `self_attn.q_norm` ↔ `self_attention.q_layernorm`, replicated).
Megatron fuses and shards (docs/platform.md):
- `linear_qkv` rows are grouped per KV group: [q (nh/nkv·d rows), k (d), v (d)] × nkv;
  a TP rank holds a contiguous block of nkv/tp groups.
- `linear_fc1` = cat([gate, up]) of this rank's rows (gate and up are split separately).
- column-parallel (qkv, fc1, embedding, output layer) split rows; row-parallel
  (linear_proj, linear_fc2) split columns; norms are replicated.
- Local-spec norm names: input_layernorm ↔ input_layernorm, pre_mlp_layernorm ↔
  post_attention_layernorm (mbridge's maps assume the Transformer Engine spec).
"""

from __future__ import annotations

import torch

from pivot_hpc.models.config import ModelConfig

Tensors = dict[str, torch.Tensor]


# Qwen3's per-head norms: (megatron's name, transformers' name), under the attention
QK_NORMS = (("q_layernorm", "q_norm"), ("k_layernorm", "k_norm"))


def _qkv_kinds(cfg: ModelConfig) -> tuple[str, ...]:
    return ("weight", "bias") if cfg.qkv_bias else ("weight",)


def _chunk(t: torch.Tensor, rank: int, size: int, dim: int = 0) -> torch.Tensor:
    if t.shape[dim] % size:
        raise ValueError(f"cannot split dim {dim} of size {t.shape[dim]} into {size} TP shards")
    return t.chunk(size, dim=dim)[rank].clone()


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """[q; k; v] (HF) → megatron's per-group interleaving, for weights and biases alike."""
    g = cfg.num_kv_heads
    per = cfg.num_heads // g
    tail = q.shape[1:]
    qg = q.reshape(g, per * (q.shape[0] // cfg.num_heads), *tail)
    kg = k.reshape(g, k.shape[0] // g, *tail)
    vg = v.reshape(g, v.shape[0] // g, *tail)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *tail)


def _split_qkv(
    qkv: torch.Tensor, cfg: ModelConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = cfg.num_kv_heads
    d = cfg.head_size()
    per = cfg.num_heads // g
    tail = qkv.shape[1:]
    grouped = qkv.reshape(g, (per + 2) * d, *tail)
    q, k, v = grouped.split([per * d, d, d], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


def hf_to_megatron(hf: Tensors, cfg: ModelConfig, tp_rank: int = 0, tp_size: int = 1) -> Tensors:
    """Canonical tensors → this TP rank's Megatron state dict (no `_extra_state`)."""
    if cfg.num_kv_heads % tp_size:
        raise ValueError(f"num_kv_heads={cfg.num_kv_heads} is not divisible by TP={tp_size}")
    r, t = tp_rank, tp_size
    out: Tensors = {
        "embedding.word_embeddings.weight": _chunk(hf["model.embed_tokens.weight"], r, t),
        "decoder.final_layernorm.weight": hf["model.norm.weight"].clone(),
    }
    if not cfg.tie_word_embeddings:
        out["output_layer.weight"] = _chunk(hf["lm_head.weight"], r, t)
    for i in range(cfg.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        a = h + "self_attn."
        out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"].clone()
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"].clone()
        for kind in _qkv_kinds(cfg):
            qkv = _fuse_qkv(
                hf[f"{a}q_proj.{kind}"], hf[f"{a}k_proj.{kind}"], hf[f"{a}v_proj.{kind}"], cfg
            )
            out[f"{m}self_attention.linear_qkv.{kind}"] = _chunk(qkv, r, t)
        out[m + "self_attention.linear_proj.weight"] = _chunk(hf[a + "o_proj.weight"], r, t, 1)
        if cfg.qk_norm:
            for ours, theirs in QK_NORMS:
                out[f"{m}self_attention.{ours}.weight"] = hf[f"{a}{theirs}.weight"].clone()
        gate = _chunk(hf[h + "mlp.gate_proj.weight"], r, t)
        up = _chunk(hf[h + "mlp.up_proj.weight"], r, t)
        out[m + "mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
        out[m + "mlp.linear_fc2.weight"] = _chunk(hf[h + "mlp.down_proj.weight"], r, t, 1)
    return out


def megatron_to_hf(shards: list[Tensors], cfg: ModelConfig) -> Tensors:
    """The Megatron state dicts of all TP ranks (in rank order) → canonical tensors."""
    t = len(shards)

    def cat(name: str, dim: int = 0) -> torch.Tensor:
        return torch.cat([s[name] for s in shards], dim=dim)

    s0 = shards[0]
    hf: Tensors = {
        "model.embed_tokens.weight": cat("embedding.word_embeddings.weight"),
        "model.norm.weight": s0["decoder.final_layernorm.weight"].clone(),
    }
    hf["lm_head.weight"] = (
        hf["model.embed_tokens.weight"].clone()
        if cfg.tie_word_embeddings
        else cat("output_layer.weight")
    )
    sub = ModelConfig(**{**cfg.__dict__, "num_heads": cfg.num_heads // t})
    sub.num_kv_heads = cfg.num_kv_heads // t
    sub.head_dim = cfg.head_size()  # one TP rank's heads, each as wide
    for i in range(cfg.num_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        a = h + "self_attn."
        hf[h + "input_layernorm.weight"] = s0[m + "input_layernorm.weight"].clone()
        hf[h + "post_attention_layernorm.weight"] = s0[m + "pre_mlp_layernorm.weight"].clone()
        for kind in _qkv_kinds(cfg):
            parts = [_split_qkv(s[f"{m}self_attention.linear_qkv.{kind}"], sub) for s in shards]
            for j, proj in enumerate(("q_proj", "k_proj", "v_proj")):
                hf[f"{a}{proj}.{kind}"] = torch.cat([p[j] for p in parts], dim=0)
        hf[a + "o_proj.weight"] = cat(m + "self_attention.linear_proj.weight", 1)
        if cfg.qk_norm:
            for ours, theirs in QK_NORMS:
                hf[f"{a}{theirs}.weight"] = s0[f"{m}self_attention.{ours}.weight"].clone()
        gates, ups = zip(
            *(s[m + "mlp.linear_fc1.weight"].chunk(2, dim=0) for s in shards), strict=True
        )
        hf[h + "mlp.gate_proj.weight"] = torch.cat(gates, dim=0)
        hf[h + "mlp.up_proj.weight"] = torch.cat(ups, dim=0)
        hf[h + "mlp.down_proj.weight"] = cat(m + "mlp.linear_fc2.weight", 1)
    return hf
