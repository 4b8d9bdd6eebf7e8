"""Create-or-load the tiny policy and GenRM: deterministic per seed, cached on disk.

A model is created (random init), warmed up by SFT on the tiny task (`recipes/sft.py`,
Megatron), saved into a temporary directory and renamed into the cache
(`models/zoo.model_dir`), so a cache entry is complete or absent.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from pivot_hpc import private_dirs
from pivot_hpc.models import cache_trust
from pivot_hpc.models.config import ModelsConfig, TinyModelSpec
from pivot_hpc.models.qwen2 import create_model
from pivot_hpc.models.tokenizer import build_tokenizer
from pivot_hpc.models.zoo import _quiet_transformers, model_dir


def build_model(cfg: ModelsConfig, kind: str, out: Path, progress: bool = True) -> dict:
    """Create, warm up (SFT) and save one model into `out` (which must not exist)."""
    from pivot_hpc.recipes.sft import run_sft

    _quiet_transformers()
    spec: TinyModelSpec = getattr(cfg, kind)
    seed = cfg.seed + (0 if kind == "policy" else 1000)
    tok = build_tokenizer()
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    model = create_model(spec.arch, seed=seed)
    losses = run_sft(
        model,
        tok,
        kind,
        spec.arch,
        spec.sft,
        seed=seed,
        max_digits=cfg.max_digits,
        operands=cfg.operands,
        calculator=cfg.calculator,
        progress=progress,
    )
    meta = {
        "kind": kind,
        "seed": seed,
        "sft_steps": spec.sft.steps,
        "final_nll": losses[-1] if losses else None,
        "build_s": time.perf_counter() - t0,
    }
    out.mkdir(parents=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


def ensure_model(cfg: ModelsConfig, kind: str, progress: bool = True) -> Path:
    """The cached directory of `kind` ("policy" or "genrm"), building it if absent; the
    configured real model's directory (`models.policy_path` / `genrm_path`) if one is set."""
    real = getattr(cfg, f"{kind}_path", None)
    if real is not None:
        return Path(real)
    final = model_dir(cfg, kind)
    root = cache_trust.check_root(cfg.cache_dir)  # someone else's cache: refused, one line
    cache_trust.check_entry(final)
    if (final / "meta.json").is_file():
        return final
    private_dirs.ensure(final.parent, "the model cache", cache_trust.FIX, up_to=root)
    if progress:
        steps = getattr(cfg, kind).sft.steps
        print(
            f"pivot-hpc: creating the tiny {kind} ({steps} SFT steps), once: cached in {final}",
            file=sys.stderr,
            flush=True,
        )
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        build_model(cfg, kind, tmp / "m", progress=progress)
        try:
            os.rename(tmp / "m", final)
        except OSError:
            if not (final / "meta.json").is_file():  # lost a race to a complete copy? fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def ensure_models(cfg: ModelsConfig | None = None, progress: bool = True) -> tuple[Path, Path]:
    cfg = cfg or ModelsConfig()
    return ensure_model(cfg, "policy", progress), ensure_model(cfg, "genrm", progress)
