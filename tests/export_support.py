"""Checkpoints of a "trained" policy for the export tests: the base model's tensors moved
by a seeded step, written as runtime/checkpointing.py writes a checkpoint's `policy/` (one
model.safetensors under Hugging Face names with pivot_hpc's metadata, the base directory's
other files beside it) and sealed by the real checkpoint store (manifest, CRCs, rename)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pivot_hpc.checkpoint import store


def trained_tensors(base: Path, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for f in sorted(base.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return {
        k: (v.float() + 0.05 * torch.randn(v.shape, generator=g)).to(v.dtype)
        for k, v in sorted(tensors.items())
    }


def write_checkpoint(run_dir: Path, base: Path, step: int, seed: int) -> dict[str, torch.Tensor]:
    """A complete checkpoint of RL step `step` in `run_dir`; returns its policy tensors."""
    tensors = trained_tensors(base, seed)
    tmp = store.begin(run_dir)
    (tmp / "policy").mkdir()
    save_file(
        tensors,
        str(tmp / "policy" / "model.safetensors"),
        metadata={"format": "pt", "pivot_hpc_version": str(step)},
    )
    for f in base.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and not f.name.endswith(".index.json"):
            shutil.copyfile(f, tmp / "policy" / f.name)
    store.commit(tmp, {"step": step, "reason": "interval"}, config={}, keep=3)
    return tensors
