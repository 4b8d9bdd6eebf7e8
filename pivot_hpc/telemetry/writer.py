"""TelemetryWriter: one HDF5 file per allocation, rows buffered in memory, appended on flush.

Crash safety: the file is created with `libver="latest"` and switched to SWMR-write mode
once its datasets exist. In that mode HDF5 orders its metadata writes so that the file on
disk is consistent after every flush, and a `kill -9` loses only the rows buffered since
the last flush. A file left by a killed writer keeps its "open for writing" flag: open it
with `h5py.File(path, "r", swmr=True)` (what `open_run` does) or clear it with `h5clear -s`.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from pivot_hpc import __version__
from pivot_hpc.telemetry.schema import (
    CHUNK_ROWS,
    DATASETS,
    DTYPES,
    OPTIONAL,
    RESERVED_ATTRS,
    SCHEMA_VERSION,
    SLURM_ENV,
    TIME_FIELDS,
)

_ALLOC_RE = re.compile(r"^alloc-(\d+)\.h5$")

# Per dataset: (field position, max bytes) of each fixed-length string field, checked at
# flush so that an over-long or non-ASCII id fails loudly instead of being truncated.
_STRING_FIELDS: dict[str, list[tuple[int, str, int]]] = {
    name: [
        (i, field, dt[field].itemsize)
        for i, field in enumerate(dt.names or ())
        if dt[field].kind == "S"
    ]
    for name, dt in DTYPES.items()
}


def alloc_files(telemetry_dir: Path) -> list[tuple[int, Path]]:
    """(index, path) of the alloc-NNN.h5 files in `telemetry_dir`, by ascending index."""
    if not telemetry_dir.is_dir():
        return []
    found = []
    for p in telemetry_dir.iterdir():
        m = _ALLOC_RE.match(p.name)
        if m:
            found.append((int(m.group(1)), p))
    return sorted(found)


def encode_meta(meta: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """HDF5-storable attribute values for `meta`, and the keys that were JSON-encoded."""
    out: dict[str, Any] = {}
    json_keys: list[str] = []
    for key, value in meta.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"telemetry meta key {key!r}: keys must be non-empty strings")
        if key in RESERVED_ATTRS:
            if key == "pivot_hpc_version" and value == __version__:
                continue  # the same value the writer sets
            raise ValueError(
                f"telemetry meta[{key!r}] = {value!r}: the writer sets this attribute itself; "
                "rename the key"
            )
        if isinstance(value, np.generic):
            value = value.item()
        if value is None:
            out[key] = ""
        elif isinstance(value, bool | int | float | str):
            out[key] = value
        elif isinstance(value, Path):
            out[key] = str(value)
        elif isinstance(value, dict | list | tuple):
            out[key] = json.dumps(value, sort_keys=True, default=str)
            json_keys.append(key)
        else:
            raise TypeError(
                f"telemetry meta[{key!r}] = {value!r}: type {type(value).__name__} is not "
                "storable; use str/int/float/bool, a dict/list (stored as JSON) or None"
            )
    return out, json_keys


class TelemetryWriter:
    """Writes one allocation's telemetry to run_dir/telemetry/alloc-NNN.h5.

    `time_offset` is added to every time written (t, start, end): a resumed run passes the
    previous allocations' end time (`pivot_hpc.telemetry.last_time(run_dir)`) so that times
    continue across files.
    """

    def __init__(
        self, run_dir: str | Path, *, meta: dict[str, Any], time_offset: float = 0.0
    ) -> None:
        attrs, json_keys = encode_meta(meta)  # before touching the disk: bad meta, no file
        telemetry_dir = Path(run_dir) / "telemetry"
        telemetry_dir.mkdir(parents=True, exist_ok=True)
        existing = alloc_files(telemetry_dir)
        # 1 + the highest index (= 1 + the number of files unless some were removed), so a
        # new allocation never reuses a name; "w-" refuses to clobber a concurrent writer's.
        self.index = (existing[-1][0] if existing else 0) + 1
        self.path: Path = telemetry_dir / f"alloc-{self.index:03d}.h5"
        self._t0 = float(time_offset)
        self._closed = False
        self._buf: dict[str, list[tuple]] = {name: [] for name in DATASETS}
        self._rows: dict[str, int] = dict.fromkeys(DATASETS, 0)

        self._f = h5py.File(self.path, "w-", libver="latest")
        try:
            a = self._f.attrs
            for key, value in attrs.items():
                a[key] = value
            a["schema_version"] = SCHEMA_VERSION
            a["pivot_hpc_version"] = __version__
            a["created_unix"] = time.time()
            a["hostname"] = socket.gethostname()
            a["alloc_index"] = self.index
            a["time_offset_s"] = self._t0
            a["json_keys"] = json.dumps(json_keys)
            for env, attr in SLURM_ENV.items():
                if env in os.environ:
                    a[attr] = os.environ[env]
            self._ds = {
                name: self._f.create_dataset(
                    name,
                    shape=(0,),
                    maxshape=(None,),
                    dtype=DTYPES[name],
                    chunks=(CHUNK_ROWS[name],),
                )
                for name in DATASETS
            }
            # SWMR-write: no new objects or attributes from here on, only appends.
            self._f.swmr_mode = True
            self._f.flush()
        except BaseException:
            self._f.close()
            raise

    # ------------------------------------------------------------------ rows
    # One method per dataset; every field after the first (the time, or the step) by
    # name, as schema.FIELDS names and documents it (the only place the columns are
    # listed). Seconds since run start get this allocation's time offset.
    def throughput(self, t: float, /, **fields: Any) -> None:
        self._append("throughput", t=t, **fields)

    def allocation(self, t: float, /, **fields: Any) -> None:
        self._append("allocation", t=t, **fields)

    def shift(self, t: float, /, **fields: Any) -> None:
        if fields.get("kind") not in ("up", "down"):
            raise ValueError(f"shift kind {fields.get('kind')!r}: use 'up' or 'down'")
        self._append("shifts", t=t, **fields)

    def planner(self, t: float, /, **fields: Any) -> None:
        self._append("planner", t=t, **fields)

    def migration(self, t: float, /, **fields: Any) -> None:
        self._append("migrations", t=t, **fields)

    def step(self, step: int, /, **fields: Any) -> None:
        self._append("steps", step=step, **fields)

    def trained(self, step: int, /, **fields: Any) -> None:
        self._append("trained", step=step, **fields)

    def checkpoint(self, t: float, /, **fields: Any) -> None:
        self._append("checkpoints", t=t, **fields)

    def failure(self, t: float, /, **fields: Any) -> None:
        self._append("failures", t=t, **fields)

    def evaluation(self, t: float, /, **fields: Any) -> None:
        self._append("evals", t=t, **fields)

    def tool_call(self, t: float, /, **fields: Any) -> None:
        self._append("tool_calls", t=t, **fields)

    def turn(self, t: float, /, **fields: Any) -> None:
        self._append("turns", t=t, **fields)

    def _append(self, name: str, **fields: Any) -> None:
        names = DTYPES[name].names
        fields = OPTIONAL.get(name, {}) | fields
        if fields.keys() != set(names):
            missing = [f for f in names if f not in fields]
            unknown = sorted(set(fields) - set(names))
            raise TypeError(
                f"telemetry {name}: missing fields {missing}, unknown fields {unknown} "
                f"(schema: {', '.join(names)})"
            )
        for f in TIME_FIELDS[name]:
            fields[f] = fields[f] + self._t0
        self._buf[name].append(tuple(fields[f] for f in names))

    # ------------------------------------------------------------------ disk
    def rows(self, name: str) -> int:
        """Rows of dataset `name` written to disk so far (buffered rows not counted)."""
        return self._rows[name]

    def flush(self) -> None:
        """Append the buffered rows to their datasets and make the file consistent on disk."""
        if self._closed:
            raise RuntimeError(f"TelemetryWriter({self.path}) is closed; flush() after close()")
        for name, buf in self._buf.items():
            if not buf:
                continue
            _check_strings(name, buf)
            arr = np.array(buf, dtype=DTYPES[name])
            ds = self._ds[name]
            n = self._rows[name]
            ds.resize((n + len(arr),))
            ds[n:] = arr
            self._rows[name] = n + len(arr)
            buf.clear()
        self._f.flush()

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.flush()
        finally:
            self._closed = True
            self._f.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> TelemetryWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_strings(name: str, buf: list[tuple]) -> None:
    for i, field, size in _STRING_FIELDS[name]:
        for value in {row[i] for row in buf}:  # few distinct values: roles, kinds, ids
            s = value.decode() if isinstance(value, bytes) else str(value)
            if not s.isascii() or len(s) > size:
                raise ValueError(
                    f"telemetry {name}.{field} = {s!r}: must be ASCII of at most {size} "
                    "characters (fixed-length HDF5 string)"
                )
