"""User-facing errors: the CLI prints these as one clear line instead of a traceback."""

from __future__ import annotations


class PivotError(Exception):
    """Base of errors caused by input (config, data, snapshot, arguments), not by bugs."""


class UsageError(PivotError, ValueError):
    """A command-line argument is out of range."""
