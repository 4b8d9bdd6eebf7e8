"""Converters between canonical (HF) q/k/v, gate/up tensors and fused engine layouts.

GPS stores and moves canonical tensors only; a reader that wants a fused weight builds it
from the canonical TP shards it received, and a writer splits its fused shard back. The
split is per head group, never a naive cut of the fused tensor: rank r of a fused QKV must
hold *its* q heads together with *its* KV heads, which are not a contiguous row range of
the full fused matrix.

Layouts (rows of the weight; biases the same along their only dimension):
- Megatron `linear_qkv`: per KV group g: [q heads of g (nh/nkv·d rows), k_g (d), v_g (d)].
- SGLang `qkv_proj` (per TP rank): cat([q_shard, k_shard, v_shard]).
- Megatron `linear_fc1` / SGLang `gate_up_proj` (per TP rank): cat([gate_shard, up_shard]).
"""

from __future__ import annotations

import numpy as np


def fuse_qkv_megatron(q: np.ndarray, k: np.ndarray, v: np.ndarray, head_dim: int) -> np.ndarray:
    """Interleave q/k/v (full or one TP rank's shards) into Megatron's per-group layout."""
    groups = k.shape[0] // head_dim
    if groups == 0 or q.shape[0] % (groups * head_dim):
        raise ValueError(
            f"q rows {q.shape[0]} are not a whole number of head groups of k rows "
            f"{k.shape[0]} with head_dim={head_dim}"
        )
    qg = q.reshape(groups, -1, *q.shape[1:])
    kg = k.reshape(groups, head_dim, *k.shape[1:])
    vg = v.reshape(groups, head_dim, *v.shape[1:])
    return np.concatenate([qg, kg, vg], axis=1).reshape(-1, *q.shape[1:])


def split_qkv_megatron(
    fused: np.ndarray, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Inverse of `fuse_qkv_megatron` (num_heads / num_kv_heads of this shard)."""
    per = num_heads // num_kv_heads
    g = fused.reshape(num_kv_heads, (per + 2) * head_dim, *fused.shape[1:])
    q = g[:, : per * head_dim].reshape(-1, *fused.shape[1:])
    k = g[:, per * head_dim : (per + 1) * head_dim].reshape(-1, *fused.shape[1:])
    v = g[:, (per + 1) * head_dim :].reshape(-1, *fused.shape[1:])
    return q, k, v


def fuse_rows(*shards: np.ndarray) -> np.ndarray:
    """SGLang-style per-rank fused weight: the rank's shards stacked (qkv, gate_up)."""
    return np.concatenate(shards, axis=0)


def split_rows(fused: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    """Inverse of `fuse_rows` given each part's row count."""
    if sum(sizes) != fused.shape[0]:
        raise ValueError(f"row sizes {sizes} do not add up to the fused rows {fused.shape[0]}")
    return np.split(fused, np.cumsum(sizes)[:-1], axis=0)
