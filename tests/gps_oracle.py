"""What each tp rank should hold of a checkpoint's tensors, from what the tensors mean.

Written from the layouts (whole attention heads, KV heads replicated when tp exceeds them,
GLM-4/Phi-3's [gate; up] and Phi-3's [q; k; v] cut part by part, the vocabulary
ceil-divided), not from GPS's rule code (models/tp_rules.py), so that tests of GPS on
real architectures (tests/unit/test_gps_architectures.py, tests/mpi/gps_arch_worker.py)
check the rules too.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pivot_hpc.gps import ModelSpec, Parallelism


def checkpoint(d: Path) -> dict[str, np.ndarray]:
    """The checkpoint's tensors as raw bit patterns (bf16 as uint16)."""
    import torch
    from safetensors import safe_open

    out = {}
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        for n in f.keys():
            t = f.get_tensor(n)
            out[n] = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
    return out


def _split(a: np.ndarray, axis: int, n: int, tp: int, r: int, kv: bool = False) -> np.ndarray:
    """Rank r's share of n equal units of `a` along `axis` (KV: replicated when tp > n)."""
    size = a.shape[axis] // n
    if n % tp == 0:
        u0, u1 = r * n // tp, (r + 1) * n // tp
    else:
        assert kv and tp % n == 0
        u0 = r // (tp // n)
        u1 = u0 + 1
    return np.take(a, range(u0 * size, u1 * size), axis=axis)


def oracle(name: str, a: np.ndarray, tp: int, r: int, nh: int, nkv: int) -> np.ndarray:
    """What tp rank r should hold of the full tensor `a`, from what the tensor means."""
    if tp == 1:
        return a
    mod = name.split(".")[-2] if name.count(".") else name
    if mod in ("embed_tokens", "lm_head"):
        per = -(-a.shape[0] // tp)
        return a[r * per : (r + 1) * per]
    if "linear_attn" in name or "visual" in name or a.ndim > 2:
        return a  # no rule: whole
    if mod == "q_proj":
        return _split(a, 0, nh, tp, r)
    if mod in ("k_proj", "v_proj"):
        return _split(a, 0, nkv, tp, r, kv=True)
    if mod == "o_proj" and a.ndim == 2:
        return _split(a, 1, nh, tp, r)
    if mod in ("gate_proj", "up_proj"):
        return _split(a, 0, tp, tp, r)
    if mod == "down_proj" and a.ndim == 2:
        return _split(a, 1, tp, tp, r)
    if mod == "gate_up_proj":
        gate, up = np.split(a, 2)
        return np.concatenate([_split(gate, 0, tp, tp, r), _split(up, 0, tp, tp, r)])
    if mod == "qkv_proj":
        d = a.shape[0] // (nh + 2 * nkv)
        q, k, v = np.split(a, [nh * d, (nh + nkv) * d])
        parts = [_split(q, 0, nh, tp, r)] + [_split(x, 0, nkv, tp, r, kv=True) for x in (k, v)]
        return np.concatenate(parts)
    return a  # norms, routers, shared-expert gates: replicated


def expected(spec: ModelSpec, ckpt, par: Parallelism, i: int) -> dict[str, np.ndarray]:
    _, pp, tp = par.coords(i)
    nh, nkv = spec.num_attention_heads, spec.num_key_value_heads
    names = [spec.tensors[ti].name for ti in spec.stage_tensors(par.pp, pp)]
    return {n: oracle(n, ckpt[n], par.tp, tp, nh, nkv) for n in names}
