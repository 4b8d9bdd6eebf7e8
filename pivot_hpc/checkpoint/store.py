"""Checkpoint directories on disk: atomic commit, discovery, verification, pruning.

Layout of `<run dir>/checkpoints/`:
    ckpt-000007/            complete: renamed into place after every file was written
        manifest.json       written last: format, step, files with sizes and CRC32s
        config.yaml         the run config that wrote it (resume compares against it)
        policy/             policy weights in HF layout (model.safetensors + config)
        train/              megatron distributed checkpoint (model + optimizer)
        rl_state.json       RL state (tagged JSON, checkpoint/codec.py: data, never code)
        ranks.json          per-rank RNG states (same)
    .tmp-ckpt-000008-1234/  being written (or left by a killed job: ignored, removed)

The newest complete checkpoint is the one with the highest index. A crash while writing
leaves only a temporary directory, never a torn `ckpt-*`; a `ckpt-*` whose files do not
match its manifest (a damaged disk, a hand edit) is reported, not silently skipped.

Nothing in a checkpoint is unpickled as code: a `ckpt-*` holding a pickle of ours (older
pivot_hpc wrote rl_state.pkl / ranks.pkl) is refused by name, and megatron-core's own
pickled `train/.metadata` is loaded only through an unpickler that admits the few plain
data classes such metadata consists of (safe_pickle.py) — here, before any rank starts,
and again by the training ranks when they load it. The manifest's CRC32s detect damage,
not tampering (anyone can recompute them); the allow-list is what makes a checkpoint
from someone else safe to read.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import zlib
from pathlib import Path
from typing import Any

import yaml

from pivot_hpc.checkpoint.safe_pickle import UnsafePickleError, check_metadata
from pivot_hpc.config.loader import load_yaml_text, read_yaml_file
from pivot_hpc.errors import ConfigError, PivotError
from pivot_hpc.safe_files import UnsafeReadError, open_for_read, open_for_write, special_kind

FORMAT = 2  # 2: JSON state files (1 held pickles and is refused)
MANIFEST = "manifest.json"
NAME_MAX = 255  # bytes in one file name component (Linux); a longer name is no file of ours
_FINAL = re.compile(r"^ckpt-(\d{6})$")
_TMP = re.compile(r"^\.tmp-ckpt-(\d{6})-\d+$")
_DELETING = re.compile(r"^\.del-ckpt-\d{6}$")
# Keys a resumed run may change; any other difference is a resume mismatch.
RESUMABLE_KEYS = (
    "loop.steps",
    "loop.monitor_interval_s",
    "checkpoint.",
    "tracking.",
    "planner.interval_s",
    "models.cache_dir",
    # the allocation: the training state (megatron dist_checkpointing) restores at whatever
    # data parallelism the new one gives training
    "cluster.",
    "training.num_gpus",
    "training.gpus",
    "planner.elastic_training",
    # measured, not chosen: start-up profiling fills these in
    "rollout.throughput.",
    "reward.throughput.",
    "engines.rollout.throughput_profile",
    "engines.reward.throughput_profile",
    # the simulator's section: a live run does not read it (and checkpoints written before
    # its keys moved to the live sections, configs/groups/, still resume)
    "sim.",
    "models.policy_catalog",
    "models.genrm_catalog",
)


class CheckpointError(PivotError):
    """A checkpoint cannot be used: the message names the file or key and the fix."""


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def complete(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of `run_dir`, oldest first."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _FINAL.match(p.name))]
    return [p for _, p in sorted(found)]


def newest(run_dir: str | Path) -> Path | None:
    found = complete(run_dir)
    return found[-1] if found else None


def begin(run_dir: str | Path) -> Path:
    """A fresh temporary directory for the next checkpoint (stale ones are removed)."""
    root = checkpoints_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    for p in root.iterdir():
        if _TMP.match(p.name) or _DELETING.match(p.name):  # left by a killed job
            shutil.rmtree(p, ignore_errors=True)
    last = complete(run_dir)
    index = int(_FINAL.match(last[-1].name).group(1)) + 1 if last else 1
    tmp = root / f".tmp-ckpt-{index:06d}-{os.getpid()}"
    tmp.mkdir()
    return tmp


def _crc32(path: Path) -> int:
    crc = 0
    with open_for_read(path) as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp: Path, info: dict[str, Any], config: dict[str, Any], keep: int) -> Path:
    """Seal `tmp`: config.yaml, checksums in manifest.json (last), fsync, rename; then keep
    only the newest `keep` complete checkpoints. Returns the final path."""
    with open_for_write(tmp / "config.yaml", private=False) as f:
        f.write(yaml.safe_dump(config, sort_keys=True))
    files = {}
    for p in sorted(tmp.rglob("*")):
        if p.is_file():
            _fsync(p)
            files[str(p.relative_to(tmp))] = {"bytes": p.stat().st_size, "crc32": _crc32(p)}
    manifest = {"format": FORMAT, "created_unix": time.time(), **info, "files": files}
    with open_for_write(tmp / MANIFEST, private=False) as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    for d in sorted({p.parent for p in tmp.rglob("*")} | {tmp}):
        _fsync(d)
    index = int(_TMP.match(tmp.name).group(1))
    final = tmp.parent / f"ckpt-{index:06d}"
    os.rename(tmp, final)  # atomic on POSIX file systems: complete or absent
    _fsync(final.parent)
    for old in complete(final.parent.parent)[:-keep]:
        # renamed first, so that a kill while deleting never leaves a torn ckpt-* behind
        doomed = old.parent / f".del-{old.name}"
        os.rename(old, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    return final


def verify(path: Path) -> dict[str, Any]:
    """The manifest of checkpoint `path` after checking every file against it."""
    fix = f"delete {path} to resume from the previous checkpoint, or start a new --run-dir"
    _check_entries(path, fix)  # before anything in it is opened: no FIFO, device or link
    try:
        with open_for_read(path / MANIFEST) as f:
            manifest = json.loads(f.read())
    except (OSError, ValueError, RecursionError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else f"{e!s:.200}"
        raise CheckpointError(f"checkpoint {path}: unreadable {MANIFEST} ({why}); {fix}") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(
            f"checkpoint {path}: {MANIFEST} holds a {type(manifest).__name__}, not an object; {fix}"
        )
    pickles = sorted(
        str(p.relative_to(path))
        for p in path.rglob("*")
        if p.suffix in (".pkl", ".pickle") and p.is_file()
    )
    if pickles or manifest.get("format") == 1:
        raise CheckpointError(
            f"checkpoint {path}: holds pickled state ({', '.join(pickles) or 'format 1'}); "
            "pivot_hpc never unpickles files from a run directory (a pickle can run code). "
            f"Checkpoints of pivot_hpc before format {FORMAT} hold them: {fix}"
        )
    if manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"checkpoint {path}: format {manifest.get('format')!r}, this pivot_hpc reads "
            f"format {FORMAT}; {fix}"
        )
    problem = _manifest_problem(manifest)
    if problem:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} {problem}; {fix}")
    _check_listing(path, manifest, fix)
    for rel, want in manifest["files"].items():
        try:
            _check_file(path, rel, want, fix)
        except UnsafeReadError as exc:
            raise CheckpointError(f"checkpoint {path}: file {rel}: {exc}; {fix}") from None
        except OSError as exc:  # whatever the file system answers a name: one line
            why = exc.strerror or type(exc).__name__
            raise CheckpointError(f"checkpoint {path}: file {rel[:120]!r}: {why}; {fix}") from None
    for meta in sorted(path.rglob("*.metadata")):
        try:
            check_metadata(meta)  # the same unpickler the training ranks load it with
        except UnsafePickleError as exc:
            raise CheckpointError(f"checkpoint {path}: {exc}") from None
    _check_train_config(path, fix)
    return manifest


# What megatron-core's `train/metadata.json` may say: it picks the loaders that read the
# rest, so only the ones pivot_hpc writes (and has hardened) are accepted.
_TRAIN_BACKENDS = {"sharded_backend": "torch_dist", "common_backend": "torch"}


def _check_train_config(path: Path, fix: str) -> None:
    config = path / "train" / "metadata.json"
    if not config.is_file():
        return
    try:
        with open_for_read(config) as f:
            data = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        data = None
    if not isinstance(data, dict) or any(data.get(k) != v for k, v in _TRAIN_BACKENDS.items()):
        raise CheckpointError(
            f"checkpoint {path}: train/metadata.json is not a megatron-core "
            f"distributed checkpoint config with {_TRAIN_BACKENDS} (what pivot_hpc writes "
            f"and reads); {fix}"
        )


def _check_file(path: Path, rel: str, want: dict[str, int], fix: str) -> None:
    p = path / rel
    if not p.is_file():
        raise CheckpointError(f"checkpoint {path}: file {rel} is missing; {fix}")
    size = p.stat().st_size
    if size != want["bytes"]:
        raise CheckpointError(
            f"checkpoint {path}: file {rel} has {size} bytes, the manifest says "
            f"{want['bytes']} (truncated or overwritten); {fix}"
        )
    if _crc32(p) != want["crc32"]:
        raise CheckpointError(f"checkpoint {path}: file {rel} fails its CRC32 check; {fix}")


def _check_entries(path: Path, fix: str) -> None:
    """A checkpoint is a directory of directories and regular files: a FIFO (which would
    block the first read for ever), a socket, a device or a symbolic link anywhere in it,
    the checkpoint itself included, is refused before anything in it is opened."""
    kind = special_kind(path)
    if kind is not None:
        raise CheckpointError(f"checkpoint {path} is {kind}, not a directory; {fix}")
    try:
        for root, dirs, files in os.walk(path, onerror=_raise):
            for name in sorted(dirs + files):
                kind = special_kind(os.path.join(root, name))
                if kind is not None:
                    rel = os.path.relpath(os.path.join(root, name), path)
                    raise CheckpointError(
                        f"checkpoint {path}: {rel[:200]} is {kind} (a checkpoint holds only "
                        f"its own directories and regular files); {fix}"
                    )
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise CheckpointError(f"checkpoint {path}: cannot list it ({why}); {fix}") from None


def _raise(exc: OSError) -> None:
    raise exc


def _check_listing(path: Path, manifest: dict[str, Any], fix: str) -> None:
    """A checkpoint holds the files its manifest lists and nothing else: no file added
    afterwards, no link that would make a check read something outside it."""
    listed = set(manifest["files"]) | {MANIFEST}
    for p in sorted(path.rglob("*")):
        rel = str(p.relative_to(path))
        if p.is_symlink():
            raise CheckpointError(
                f"checkpoint {path}: {rel} is a symbolic link (a checkpoint holds only its own "
                f"files); {fix}"
            )
        if p.is_file() and rel not in listed:
            raise CheckpointError(
                f"checkpoint {path}: file {rel} is not in its {MANIFEST} (added after it was "
                f"written); {fix}"
            )


def _manifest_problem(manifest: dict[str, Any]) -> str | None:
    """What is wrong with the shape of a format-2 manifest (None: nothing)."""
    step = manifest.get("step")
    if type(step) is not int or step < 0:
        return f"has step {step!r}, not a whole number >= 0"
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return "lists no files (key 'files' must map each file to its bytes and crc32)"
    for rel, want in files.items():
        parts = Path(rel).parts
        if Path(rel).is_absolute() or ".." in parts or not parts:
            return f"names {rel[:120]!r}, outside the checkpoint directory"
        if "\0" in rel or any(len(p.encode("utf-8", "surrogatepass")) > NAME_MAX for p in parts):
            return f"names {rel[:120]!r}, not a file name (over {NAME_MAX} bytes, or a NUL)"
        if not isinstance(want, dict) or not all(
            type(want.get(k)) is int for k in ("bytes", "crc32")
        ):
            return f"entry {rel[:120]!r} is {str(want)[:120]}, not {{'bytes': int, 'crc32': int}}"
    return None


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out |= _flatten(v, f"{prefix}.{k}" if prefix else str(k))
    return out


def config_differences(
    saved: dict[str, Any], current: dict[str, Any], defaults: dict[str, Any] | None = None
) -> list[str]:
    """'key: saved → current' for every key that differs and may not change on resume.

    `defaults` (every key at its default): a key the saved config lacks was added to
    pivot_hpc after the checkpoint was written, so that run had its default; it differs
    only if the current value is not the default."""
    a, b = _flatten(saved), _flatten(current)
    for key, value in _flatten(defaults or {}).items():
        a.setdefault(key, value)
    out = []
    for key in sorted(set(a) | set(b)):
        if any(key == k or (k.endswith(".") and key.startswith(k)) for k in RESUMABLE_KEYS):
            continue
        if a.get(key, "<absent>") != b.get(key, "<absent>"):
            out.append(f"{key}: {a.get(key, '<absent>')!r} → {b.get(key, '<absent>')!r}")
    return out


def check_resumable(
    path: Path, current: dict[str, Any], defaults: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Verify checkpoint `path` and that `current` (the new run's config) may resume it
    (`defaults`: see config_differences)."""
    manifest = verify(path)
    source = f"checkpoint {path}: config.yaml"
    try:  # aliases refused, sizes bounded: a 792-byte "billion laughs" must not hang this
        saved = load_yaml_text(read_yaml_file(path / "config.yaml", source), source)
    except ConfigError as e:
        raise CheckpointError(
            f"{str(e).splitlines()[0]} (unreadable config.yaml); delete {path} to resume "
            "from the previous checkpoint, or start a new --run-dir"
        ) from None
    if not isinstance(saved, dict):
        raise CheckpointError(
            f"checkpoint {path}: config.yaml holds a {type(saved).__name__}, not a config "
            f"mapping; delete {path} to resume from the previous checkpoint, or start a new "
            "--run-dir"
        )
    diff = config_differences(saved, current, defaults)
    if diff:
        shown = "; ".join(diff[:8]) + (f"; … {len(diff) - 8} more" if len(diff) > 8 else "")
        raise CheckpointError(
            f"run directory {path.parent.parent} holds checkpoints of a different config "
            f"({shown}). Resume with the config it was written with ({path / 'config.yaml'}) "
            "or use a new --run-dir. Only loop.steps, checkpoint.*, tracking.*, "
            "planner.interval_s, models.cache_dir, the allocation (cluster.*, training.num_gpus, "
            "training.gpus, planner.elastic_training) and throughput constants may change "
            "across a resume."
        )
    return manifest


def find_resume(
    run_dir: str | Path,
    current: dict[str, Any],
    allowed: bool = True,
    defaults: dict[str, Any] | None = None,
):
    """(path, manifest) of the checkpoint to resume from, or None for a fresh run."""
    path = newest(run_dir)
    if path is None:
        return None
    if not allowed:
        raise CheckpointError(
            f"run directory {run_dir} already holds checkpoints (newest {path.name}) and "
            "checkpoint.resume=false: use a new --run-dir, or set checkpoint.resume=true"
        )
    return path, check_resumable(path, current, defaults)
