"""`pivot-hpc export RUN_DIR --out DIR [--step N]`: a checkpoint's policy as a Hugging Face
directory that `transformers` (`AutoModelForCausalLM.from_pretrained(DIR)`) and vLLM
(`vllm serve DIR`) load.

A checkpoint's `policy/` already is one (runtime/checkpointing.py: the whole policy read
from GPS under its Hugging Face names, the base model's config, tokenizer and generation
config beside it), so exporting is checking and copying: the checkpoint is verified
against its manifest first (sizes, CRCs, no special files or links: checkpoint/store.py),
the copy lands in a temporary sibling of DIR and is renamed into place, so DIR is either
complete or absent. The exported directory is described by the model layer
(models/description.py) before the rename, so what it announces is what a loader sees.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

from pivot_hpc.errors import UsageError
from pivot_hpc.safe_files import UnsafeReadError, open_for_read


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="run directory (holds checkpoints/)")
    parser.add_argument(
        "--out", required=True, metavar="DIR", help="new (or empty) directory to write"
    )
    parser.add_argument(
        "--step",
        type=int,
        default=None,
        metavar="N",
        help="the checkpoint of RL step N (default: the newest complete checkpoint)",
    )


def run(args: argparse.Namespace) -> int:
    from pivot_hpc.checkpoint import store
    from pivot_hpc.models.description import describe

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise UsageError(f"RUN_DIR {run_dir}: no such directory (the --run-dir of a run)")
    ckpt, step = _checkpoint(store, run_dir, args.step)
    out = Path(args.out)
    _check_out(out)
    src = ckpt / "policy"
    files = sorted(p for p in src.iterdir() if p.is_file()) if src.is_dir() else []
    if not any(p.suffix == ".safetensors" for p in files):
        raise UsageError(
            f"checkpoint {ckpt}: no policy/*.safetensors (not a checkpoint pivot_hpc wrote); "
            "export another --step"
        )
    tmp = out.parent / f".{out.name}.export-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        for f in files:  # copyfile: the umask's mode, not the checkpoint's
            shutil.copyfile(f, tmp / f.name)
        desc = describe(tmp)
        if out.exists():
            out.rmdir()  # empty (checked above); rename needs it gone
        os.rename(tmp, out)
    except OSError as exc:
        raise UsageError(
            f"--out {out}: cannot be written ({exc.strerror or exc}): choose a directory "
            "on a file system you can write to"
        ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    arch = desc.architectures[0] if desc.architectures else desc.model_type
    tied = ", tied embeddings" if desc.tie_word_embeddings else ""
    print(
        f"pivot-hpc: exported step {step} ({ckpt}) to {out}: {arch}{tied}, "
        f"{desc.num_params / 1e6:.2f} M parameters in {desc.weights_dtype}; "
        f"load it with AutoModelForCausalLM.from_pretrained('{out}') or `vllm serve {out}`"
    )
    return 0


def _checkpoint(store, run_dir: Path, step: int | None) -> tuple[Path, int]:
    """(checkpoint, its step): the newest, or the one of RL step `step`; verified against
    its manifest (only that one: an older or newer damaged one does not stop the export)."""
    found = store.complete(run_dir)
    if not found:
        raise UsageError(
            f"RUN_DIR {run_dir}: no complete checkpoint in {store.checkpoints_dir(run_dir)} "
            "(a run writes one every checkpoint.interval_steps steps and when it stops)"
        )
    steps = {ckpt: _step_of(store, ckpt) for ckpt in found}
    known = sorted(s for s in steps.values() if s is not None)
    if step is None:
        ckpt = found[-1]
    else:
        matches = [c for c, s in steps.items() if s == step]
        if not matches:
            raise UsageError(
                f"--step {step}: {run_dir} holds no checkpoint of that step; it holds steps "
                f"{known} (checkpoint.keep: how many a run keeps)"
            )
        ckpt = matches[-1]
    try:
        return ckpt, store.verify(ckpt)["step"]
    except store.CheckpointError as exc:
        others = [s for c, s in steps.items() if c != ckpt and s is not None]
        hint = f"; --step exports another one (steps {sorted(others)})" if others else ""
        raise UsageError(f"{exc}{hint}") from None


def _step_of(store, ckpt: Path) -> int | None:
    """The step a checkpoint's manifest names, read without verifying the rest."""
    try:
        with open_for_read(ckpt / store.MANIFEST) as f:
            step = json.loads(f.read()).get("step")
    except (OSError, UnsafeReadError, ValueError, RecursionError, AttributeError):
        return None
    return step if type(step) is int else None


def _check_out(out: Path) -> None:
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise UsageError(f"--out {out}: exists and is not a directory: choose a new directory")
    if out.is_dir() and any(out.iterdir()):
        raise UsageError(
            f"--out {out}: exists and is not empty (export never overwrites): choose a new "
            "directory, or remove this one"
        )
    if not out.parent.is_dir():
        raise UsageError(f"--out {out}: its parent {out.parent} does not exist: create it first")
