"""Where the tiny policy and GenRM live on disk, and loading a model directory.

A model directory (`save_pretrained` layout + tokenizer + meta.json) is keyed by a hash
of everything that determines it (architecture, SFT recipe, seed, task, format version).
Creating one (random init + SFT warm-up) is a recipe: `recipes/tiny_models.py`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path

import torch

from pivot_hpc.models.config import ModelsConfig, TinyModelSpec, cache_root
from pivot_hpc.models.tokenizer import load_tokenizer

FORMAT_VERSION = 6  # bump when the task or judgement text changes


def spec_key(
    kind: str,
    spec: TinyModelSpec,
    seed: int,
    max_digits: int,
    operands: int = 2,
    calculator: bool = False,
) -> str:
    fields = {
        "kind": kind,
        "spec": asdict(spec),
        "seed": seed,
        "max_digits": max_digits,
        "v": FORMAT_VERSION,
    }
    # Options added after a default was cached enter the key only when set: the default
    # models keep their directories (and nobody rebuilds them after an upgrade).
    if fields["spec"]["sft"].get("tool_slip") == 0.0:
        del fields["spec"]["sft"]["tool_slip"]
    if operands != 2:
        fields["operands"] = operands
    if calculator:
        fields["calculator"] = True
    blob = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def model_dir(cfg: ModelsConfig, kind: str) -> Path:
    spec: TinyModelSpec = getattr(cfg, kind)
    key = spec_key(kind, spec, cfg.seed, cfg.max_digits, cfg.operands, cfg.calculator)
    return cache_root(cfg.cache_dir) / "models" / f"{kind}-{key}"


def _quiet_transformers() -> None:
    # transformers draws a progress bar for every tiny save/load; keep logs readable
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def load_model(path: str | Path):
    """(model, tokenizer) from a model directory: the `transformers` class its config
    names, fp32, weights by checkpoint name (models/hf_load.py)."""
    from pivot_hpc.models.hf_load import load_hf_model

    model, _ = load_hf_model(path, dtype=torch.float32)
    return model, load_tokenizer(path)
