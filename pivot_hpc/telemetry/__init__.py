"""HDF5 telemetry: one file per allocation (writer), a run's files read as one (reader),
and the metrics `pivot-hpc report` and `analysis/` compute from them (summary)."""

from __future__ import annotations

from pivot_hpc.telemetry.errors import TelemetryError
from pivot_hpc.telemetry.reader import Run, find_files, last_time, open_run
from pivot_hpc.telemetry.schema import DATASETS, DTYPES, FIELDS, SCHEMA_VERSION
from pivot_hpc.telemetry.writer import TelemetryWriter

__all__ = [
    "DATASETS",
    "DTYPES",
    "FIELDS",
    "SCHEMA_VERSION",
    "Run",
    "TelemetryError",
    "TelemetryWriter",
    "find_files",
    "last_time",
    "open_run",
]
