"""User-facing errors: the CLI prints these as one clear line instead of a traceback."""

from __future__ import annotations

from typing import NoReturn


class PivotError(Exception):
    """Base of errors caused by input (config, data, snapshot, arguments), not by bugs."""


class UsageError(PivotError, ValueError):
    """A command-line argument is out of range."""


class ConfigError(PivotError, ValueError):
    """A config value is missing, unknown, of the wrong type, or inconsistent."""


class PlacementError(PivotError, RuntimeError):
    """The GPUs a launcher shows a rank do not fit the config (runtime/devices.py)."""


def fail(path: str, value: object, why: str) -> NoReturn:
    """Raise the standard config error: key path, offending value, and what to do instead.
    (Here, on the ground floor, so that every component's config dataclass can use it.)"""
    raise ConfigError(f"config key '{path}' = {value!r}: {why}")
