"""open_run: all telemetry files of a run directory, concatenated in allocation order."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from pivot_hpc.telemetry.errors import TelemetryError
from pivot_hpc.telemetry.schema import (
    ADDED_IN,
    DATASETS,
    DTYPES,
    OPTIONAL,
    SCHEMA_VERSION,
    TIME_FIELDS,
    decoded_dtype,
)
from pivot_hpc.telemetry.writer import alloc_files

DECODED: dict[str, np.dtype] = {name: decoded_dtype(dt) for name, dt in DTYPES.items()}


@dataclass
class Run:
    """A run's telemetry. `datasets[name]` is a numpy structured array (string fields as str),
    the rows of every file in order; `row_file[name][i]` is the index into `files` of row i."""

    path: Path
    files: list[Path]
    meta: dict[str, Any]  # root attributes of the first file, plus "files": per-file attrs
    file_meta: list[dict[str, Any]]
    datasets: dict[str, np.ndarray]
    row_file: dict[str, np.ndarray] = field(default_factory=dict)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.datasets[name]

    def attr(self, key: str, default: Any = None) -> Any:
        """Root attribute `key` of the first file; `default` if absent or empty."""
        value = self.meta.get(key, default)
        return default if value == "" else value

    @property
    def config(self) -> dict[str, Any]:
        """The run config from the `config` attribute (JSON text or decoded), {} if absent."""
        cfg = self.attr("config")
        if isinstance(cfg, str):
            try:
                cfg = json.loads(cfg)
            except ValueError:
                return {}
        return cfg if isinstance(cfg, dict) else {}

    @property
    def mode(self) -> str:
        return str(self.attr("mode", "unknown"))

    @property
    def label(self) -> str:
        """Display name: the `label` attribute, else mode (+ strategy when it differs)."""
        label = self.attr("label")
        if label:
            return str(label)
        strategy = self.attr("strategy")
        if strategy and str(strategy) != self.mode:
            return f"{self.mode}/{strategy}"
        return self.mode

    @property
    def end_time(self) -> float:
        """Latest time in any dataset (0.0 for an empty run)."""
        ends = [0.0]
        for name, arr in self.datasets.items():
            if len(arr) == 0:
                continue
            ends.extend(float(arr[f].max()) for f in TIME_FIELDS[name])
        return max(ends)

    def role(self, role: str) -> np.ndarray:
        """Throughput rows of one role, sorted by time."""
        tp = self.datasets["throughput"]
        rows = tp[tp["role"] == role]
        return rows[np.argsort(rows["t"], kind="stable")]


def find_files(run_dir: str | Path) -> list[Path]:
    """Telemetry files of a run: DIR/telemetry/alloc-*.h5, DIR/alloc-*.h5, or DIR itself
    when it is one .h5 file. Raises TelemetryError when there are none."""
    p = Path(run_dir)
    if p.is_file():
        return [p]
    if not p.exists():
        raise TelemetryError(f"run directory {p} does not exist")
    for d in (p / "telemetry", p):
        files = [f for _, f in alloc_files(d)]
        if files:
            return files
    raise TelemetryError(
        f"{p}: no telemetry files (expected {p}/telemetry/alloc-NNN.h5); "
        "is this a pivot_hpc run directory?"
    )


PROBE_TIMEOUT_S = 10.0  # a killed writer's file must read within this, or it is damaged


def _torn(path: Path) -> str | None:
    """Why the file cannot be whole, read from its HDF5 superblock (v2/v3, what the writer
    makes): the end-of-file address it records lies beyond the bytes on disk. HDF5's SWMR
    open does not check this and retries its metadata reads for minutes instead."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
        size = path.stat().st_size
    except OSError as exc:
        return f"unreadable ({exc.strerror})"
    if head[:8] != b"\x89HDF\r\n\x1a\n":
        return "not an HDF5 file (no HDF5 signature at its start)"
    if len(head) < 13:
        return "truncated inside its superblock"
    if head[8] not in (2, 3):
        return None  # an older superblock layout: left to HDF5's own checks
    o = head[9]
    if o not in (4, 8) or len(head) < 12 + 4 * o:
        return "damaged HDF5 superblock"
    base = int.from_bytes(head[12 : 12 + o], "little")
    eof = int.from_bytes(head[12 + 2 * o : 12 + 3 * o], "little")
    if base + eof > size:
        return f"truncated: {size} bytes on disk, its superblock records {base + eof}"
    return None


def _open(path: Path) -> h5py.File:
    # A cleanly closed file opens plainly; one whose writer was killed still has its
    # "open for write" flag set and opens only in SWMR mode, which must not be tried on a
    # torn file (HDF5 then retries for minutes): the superblock is checked first.
    try:
        return h5py.File(path, "r")
    except (OSError, RuntimeError) as plain_exc:
        why = _torn(path)
        if why is None and "truncated" in str(plain_exc):
            why = "truncated"
        if why is not None:
            raise TelemetryError(
                f"{path}: cannot open telemetry file: {why}; move it aside (the run's other "
                "files still read)"
            ) from None
        damage = _probe_swmr(path)
        if damage is not None:
            raise TelemetryError(
                f"{path}: cannot open telemetry file: damaged ({damage}); move it aside (the "
                "run's other files still read)"
            ) from None
        try:
            return h5py.File(path, "r", swmr=True)
        except (OSError, RuntimeError) as swmr_exc:
            raise TelemetryError(
                f"{path}: cannot open telemetry file ({swmr_exc}); it may be damaged or not HDF5"
            ) from None


_PROBE = """
import sys, h5py
with h5py.File(sys.argv[1], "r", swmr=True) as f:
    dict(f.attrs)
    for name in f:
        f[name][...]
"""


def _probe_swmr(path: Path, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Read a killed writer's file once in a child process first: on damaged metadata HDF5's
    SWMR reader retries for minutes, and a child can be stopped. None if it reads."""
    try:
        r = subprocess.run(
            [sys.executable, "-c", _PROBE, str(path)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return f"HDF5 still retrying its metadata reads after {timeout_s:.0f} s"
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["unreadable"])[-1]
        return last[:300]
    return None


def _attr_value(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def read_attrs(f: h5py.File) -> dict[str, Any]:
    attrs = {k: _attr_value(v) for k, v in f.attrs.items()}
    for key in json.loads(attrs.get("json_keys", "[]") or "[]"):
        if isinstance(attrs.get(key), str):
            attrs[key] = json.loads(attrs[key])
    return attrs


def _read_file(path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    with _open(path) as f:
        try:
            attrs = read_attrs(f)
        except (OSError, RuntimeError, ValueError, TypeError) as exc:
            raise TelemetryError(
                f"{path}: damaged file attributes ({str(exc).splitlines()[0][:200]}); "
                "move the file aside (the run's other files still read)"
            ) from None
        version = attrs.get("schema_version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise TelemetryError(
                f"{path}: not a pivot_hpc telemetry file (schema_version {version!r}); "
                "move it out of the telemetry directory"
            )
        if version > SCHEMA_VERSION:
            raise TelemetryError(
                f"{path}: telemetry schema_version {version!r} is not readable by this "
                f"pivot_hpc (reads <= {SCHEMA_VERSION}); upgrade pivot_hpc"
            )
        data = {}
        for name in DATASETS:
            if name not in f and version < ADDED_IN.get(name, 1):
                data[name] = np.empty(0, dtype=DECODED[name])
                continue
            if name not in f:
                raise TelemetryError(f"{path}: dataset {name!r} is missing")
            try:
                raw = f[name][...]
                names = DTYPES[name].names or ()
                have = set(raw.dtype.names or ())
                optional = OPTIONAL.get(name, {})
                missing = set(names) - have - set(optional)
                if missing:
                    raise TelemetryError(f"{path}: dataset {name!r} lacks fields {sorted(missing)}")
                present = [n for n in names if n in have]
                decoded = raw[present].astype(DECODED[name][present])
                out = np.empty(len(raw), dtype=DECODED[name])
                for n in names:  # optional fields an older file lacks read as their default
                    out[n] = decoded[n] if n in have else optional[n]
                data[name] = out
            except (OSError, RuntimeError, ValueError, UnicodeDecodeError) as exc:
                raise TelemetryError(
                    f"{path}: dataset {name!r} is damaged ({str(exc).splitlines()[0][:200]}); "
                    "move the file aside"
                ) from None
    return attrs, data


def open_run(run_dir: str | Path) -> Run:
    """Read every telemetry file of `run_dir` (see find_files) and concatenate each dataset.

    Times are returned as written (a resumed allocation's writer offsets its own).
    """
    files = find_files(run_dir)
    file_meta: list[dict[str, Any]] = []
    parts: dict[str, list[np.ndarray]] = {name: [] for name in DATASETS}
    for path in files:
        attrs, data = _read_file(path)
        file_meta.append(attrs)
        for name in DATASETS:
            parts[name].append(data[name])
    datasets = {name: np.concatenate(parts[name]) for name in DATASETS}
    row_file = {
        name: np.concatenate(
            [np.full(len(a), i, dtype=np.int32) for i, a in enumerate(parts[name])]
        )
        for name in DATASETS
    }
    meta = dict(file_meta[0])
    meta["files"] = file_meta
    return Run(Path(run_dir), files, meta, file_meta, datasets, row_file)


def last_time(run_dir: str | Path) -> float:
    """Latest time written in `run_dir` so far (0.0 if it has no telemetry yet): the
    `time_offset` a resumed allocation's TelemetryWriter continues from."""
    try:
        find_files(run_dir)
    except TelemetryError:  # no telemetry yet: a fresh run
        return 0.0
    return open_run(run_dir).end_time  # unreadable files raise: never restart times at 0
