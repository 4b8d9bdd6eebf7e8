"""open_run: all telemetry files of a run directory, concatenated in allocation order."""

from __future__ import annotations

import json
import math
import stat
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from pivot_hpc.telemetry.errors import TelemetryError, printable
from pivot_hpc.telemetry.schema import (
    ADDED_IN,
    CHUNK_ROWS,
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
        """Root attribute `key` of the first file; `default` if absent or empty. Text comes
        without control characters: it is printed, and the file may be someone else's."""
        value = self.meta.get(key, default)
        if value == "":
            return default
        return printable(value) if isinstance(value, str) else value

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
            for f in files:
                _check_inside(f, p)
            return files
    raise TelemetryError(
        f"{p}: no telemetry files (expected {p}/telemetry/alloc-NNN.h5); "
        "is this a pivot_hpc run directory?"
    )


def _check_inside(path: Path, run_dir: Path) -> None:
    """A run's telemetry file must be a regular file inside the run directory: a symbolic
    link (or a linked `telemetry` directory) could make `report` read any file the user
    can, and a FIFO would block the first read forever."""
    try:
        st = path.lstat()
        inside = path.resolve().is_relative_to(run_dir.resolve())
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop (Python < 3.13)
        raise TelemetryError(f"{path}: unreadable ({exc}); move it aside") from None
    if stat.S_ISLNK(st.st_mode) or not inside:
        raise TelemetryError(
            f"{path}: a symbolic link, or inside a linked directory, that leads out of the "
            f"run directory {run_dir}; telemetry is read from the run directory only: copy "
            "the file there"
        )
    if not stat.S_ISREG(st.st_mode):
        raise TelemetryError(f"{path}: unreadable (not a regular file); move it aside")


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


# The child reads the file as the reader does, with the same refusals (a hostile file can
# carry the "open for write" flag to get here). `-P` and sys.path[0] set explicitly: a
# module planted in the current directory (maybe the run directory) is never imported.
_PROBE = """
import sys
sys.path.insert(0, sys.argv[2])
from pivot_hpc.telemetry.reader import probe_read
probe_read(sys.argv[1])
"""


def _probe_swmr(path: Path, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Read a killed writer's file once in a child process first: on damaged metadata HDF5's
    SWMR reader retries for minutes, and a child can be stopped. None if it reads."""
    try:
        r = subprocess.run(
            [sys.executable, "-P", "-c", _PROBE, str(path), str(_PACKAGE_PARENT)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return f"HDF5 still retrying its metadata reads after {timeout_s:.0f} s"
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["unreadable"])[-1]
        if last.startswith(_REFUSED):
            raise TelemetryError(last.removeprefix(_REFUSED))
        return last[:300]
    return None


_REFUSED = "pivot-hpc telemetry refusal: "


_PACKAGE_PARENT = Path(__file__).resolve().parents[2]


def probe_read(path: str) -> None:
    """The SWMR probe's child: read `path` as `open_run` does (exit status 1 on failure)."""
    p = Path(path)
    try:
        with h5py.File(p, "r", swmr=True) as f:
            _read_contents(f, p)
    except TelemetryError as exc:  # a refusal, not damage: the parent shows it as it is
        raise SystemExit(_REFUSED + str(exc)) from None


# What a telemetry file may declare, checked before anything is read: a hostile file (a
# colleague's run directory, a download) can declare far more data than it holds, or data
# held in other files. The writer stores rows uncompressed in chunks, so the rows a
# dataset declares must fit in the bytes it stores, bar the few chunks a killed writer
# may have sized but not written; a file compressed afterwards (h5repack) can still not
# beat deflate's limit of about 1032:1.
MAX_COMPRESSION = 1032
UNFINISHED_CHUNKS = 2
# Root attributes the summary computes with, and the types they must have (a value of
# "" stands for None). Checked here so that a hostile file fails in one line, not with a
# TypeError deep in a metric.
_INT_ATTRS = ("gpus", "staleness")
_NUMBER_ATTRS = (
    "horizon_s",
    "bound_rollout_per_gpu",
    "bound_reward_per_gpu",
    "bound_train_gpu_s_per_token",
    "bound_critical_path",
)
_TEXT_ATTRS = ("mode", "strategy", "label")


def _attr_value(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def _check_attr(f: h5py.File, key: str, path: Path, file_size: int) -> None:
    """An attribute's declared size must be held by the file, and variable-length values
    (each may point at the same stored object, so they are not) come one at a time."""
    aid = f.attrs.get_id(key)
    dt, count = aid.dtype, math.prod(aid.shape or ())
    if dt.hasobject:
        if aid.shape not in ((), (1,)) or h5py.check_string_dtype(dt) is None:
            raise TelemetryError(
                f"{path}: attribute {key!r} holds variable-length data of shape {aid.shape} "
                "(the writer stores single values); move the file aside"
            )
    elif count * dt.itemsize > file_size:
        raise TelemetryError(
            f"{path}: attribute {key!r} declares {count * dt.itemsize} bytes, more than the "
            f"file's {file_size}; move the file aside"
        )


def read_attrs(f: h5py.File, path: Path | None = None) -> dict[str, Any]:
    path = Path(f.filename) if path is None else path
    file_size = path.stat().st_size
    attrs = {}
    for key in f.attrs:  # names only: nothing is read before its size is checked
        _check_attr(f, key, path, file_size)
        attrs[key] = _attr_value(f.attrs[key])
    for key in json.loads(attrs.get("json_keys", "[]") or "[]"):
        if isinstance(attrs.get(key), str):
            attrs[key] = json.loads(attrs[key])
    return attrs


def _check_meta(attrs: dict[str, Any], path: Path) -> None:
    """The root attributes the metrics use have the types the writer gives them."""
    for key in (*_INT_ATTRS, *_NUMBER_ATTRS, *_TEXT_ATTRS):
        value = attrs.get(key, "")
        if value == "" or value is None:
            continue
        if key in _TEXT_ATTRS:
            ok = isinstance(value, str)
        elif key in _INT_ATTRS:
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
        else:
            ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not ok:
            raise TelemetryError(
                f"{path}: root attribute {key!r} = {value!r:.80} is not "
                f"{_KIND[key]}; move the file aside"
            )


_KIND = (
    dict.fromkeys(_INT_ATTRS, "a count (an integer >= 0)")
    | dict.fromkeys(_NUMBER_ATTRS, "a number")
    | dict.fromkeys(_TEXT_ATTRS, "text")
)


def _link_kind(f: h5py.File, name: str) -> str | None:
    """How `name` is linked in the root group, read without following the link: "hard",
    another kind, or None when absent. (`name in f` would follow an external link, i.e.
    open another file.)"""
    key = name.encode()
    if not f.id.links.exists(key):
        return None
    kind = f.id.links.get_info(key).type
    return {
        h5py.h5l.TYPE_HARD: "hard",
        h5py.h5l.TYPE_SOFT: "a soft link",
        h5py.h5l.TYPE_EXTERNAL: "an external link (to another file)",
    }.get(kind, "a user-defined link")


def _dataset(f: h5py.File, name: str, path: Path) -> h5py.Dataset | None:
    """Dataset `name`, refused unless it is what the writer makes: a 1-D table of fixed-size
    fields whose rows are stored in this file. None if there is no such link. The checks
    run in this order because a virtual dataset opens its source files as soon as its
    shape is asked for."""
    kind = _link_kind(f, name)
    if kind is None:
        return None

    def refuse(why: str) -> TelemetryError:
        return TelemetryError(
            f"{path}: {name!r} {why}; telemetry files hold their own rows: move the file aside"
        )

    if kind != "hard":
        raise refuse(f"is {kind}, not a dataset")
    ds = f[name]
    if not isinstance(ds, h5py.Dataset):
        raise refuse(f"is a {type(ds).__name__.lower()}, not a dataset")
    if ds.is_virtual:
        raise refuse("is a virtual dataset (its rows are read from other files)")
    if ds.external:
        raise refuse("keeps its rows in external files")
    dt = ds.dtype
    if dt.names is None:
        raise refuse(f"has type {str(dt)[:40]}, not a table of fields")
    if dt.hasobject:
        raise refuse("has variable-length fields")
    if ds.ndim != 1:
        raise refuse(f"has shape {ds.shape}, not one row per entry")
    _check_fields(dt, name, path)
    _check_rows(ds, name, path)
    return ds


def _check_fields(dt: np.dtype, name: str, path: Path) -> None:
    """The schema's fields are there (bar optional ones) with the writer's kind of type:
    text where text belongs, plain numbers elsewhere."""
    want = DTYPES[name]
    have = set(dt.names or ())
    missing = set(want.names or ()) - have - set(OPTIONAL.get(name, {}))
    if missing:
        raise TelemetryError(f"{path}: dataset {name!r} lacks fields {sorted(missing)}")
    for col in sorted(have & set(want.names or ())):
        got = dt[col]
        text = want[col].kind == "S"
        if got.shape != () or (got.kind == "S") != text or got.kind not in "biufS":
            raise TelemetryError(
                f"{path}: dataset {name!r} field {col!r} has type {got}, not {want[col]}; "
                "move the file aside"
            )


def _check_rows(ds: h5py.Dataset, name: str, path: Path) -> None:
    """The rows a dataset declares must be stored in the file (see MAX_COMPRESSION)."""
    declared = ds.shape[0] * ds.dtype.itemsize
    stored = ds.id.get_storage_size()
    file_size = path.stat().st_size  # after `stored`: a live writer only adds bytes
    filtered = ds.id.get_create_plist().get_nfilters() > 0
    slack = UNFINISHED_CHUNKS * CHUNK_ROWS[name] * DTYPES[name].itemsize
    held = stored * (MAX_COMPRESSION if filtered else 1) + slack
    if stored > file_size or declared > held:
        raise TelemetryError(
            f"{path}: dataset {name!r} declares {ds.shape[0]} rows ({declared} bytes) but "
            f"stores {stored} bytes in a file of {file_size}: it cannot hold them; move the "
            "file aside"
        )


def _decode(raw: np.ndarray, name: str) -> np.ndarray:
    """Rows in the reader's dtype (text as str); fields an older file lacks get defaults."""
    names = DTYPES[name].names or ()
    have = set(raw.dtype.names or ())
    optional = OPTIONAL.get(name, {})
    present = [n for n in names if n in have]
    decoded = raw[present].astype(DECODED[name][present])
    out = np.empty(len(raw), dtype=DECODED[name])
    for n in names:  # optional fields an older file lacks read as their default
        out[n] = decoded[n] if n in have else optional[n]
    return out


def _read_contents(f: h5py.File, path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Attributes and datasets of an open telemetry file, each checked before it is read."""
    try:
        attrs = read_attrs(f, path)
    # KeyError: h5py's answer to an attribute it cannot open in a damaged file
    except (OSError, RuntimeError, ValueError, TypeError, KeyError) as exc:
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
    _check_meta(attrs, path)
    data = {}
    for name in DATASETS:
        try:
            ds = _dataset(f, name, path)
            if ds is None and version < ADDED_IN.get(name, 1):
                data[name] = np.empty(0, dtype=DECODED[name])
                continue
            if ds is None:
                raise TelemetryError(f"{path}: dataset {name!r} is missing")
            data[name] = _decode(ds[...], name)
        except (OSError, RuntimeError, ValueError, UnicodeDecodeError) as exc:
            raise TelemetryError(
                f"{path}: dataset {name!r} is damaged ({str(exc).splitlines()[0][:200]}); "
                "move the file aside"
            ) from None
        except KeyError as exc:  # h5py: an object its link names cannot be opened
            raise TelemetryError(
                f"{path}: dataset {name!r} cannot be opened ({exc}); move the file aside"
            ) from None
        except MemoryError:  # compressed rows (bounded by MAX_COMPRESSION) past this machine's
            raise TelemetryError(
                f"{path}: dataset {name!r} does not fit in memory; move the file aside"
            ) from None
    return attrs, data


def _read_file(path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    with _open(path) as f:
        return _read_contents(f, path)


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
