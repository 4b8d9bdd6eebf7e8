"""Telemetry errors a user can act on (a missing run directory, an unreadable file)."""

from __future__ import annotations

from pivot_hpc.errors import PivotError


class TelemetryError(PivotError):
    """A run directory or telemetry file that cannot be read as pivot_hpc telemetry."""
