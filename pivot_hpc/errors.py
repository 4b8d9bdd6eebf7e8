"""User-facing errors: the CLI prints these as one clear line instead of a traceback."""

from __future__ import annotations

import reprlib
from typing import Any, NoReturn


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
    raise ConfigError(f"config key '{path}' = {short_repr(value)}: {why}")


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 200  # a path still shows whole
_REPR.maxlong = 40
_REPR.maxlist = _REPR.maxtuple = _REPR.maxset = 6
_REPR.maxdict = 4
_REPR.maxlevel = 3
MAX_SHOWN_CHARS = 240


def short_repr(value: Any) -> str:
    """`repr` cut to at most MAX_SHOWN_CHARS characters: a user's value in an error line, never in full
    (a multi-megabyte string, or a list a YAML bomb would expand, stays one short line)."""
    try:
        text = _REPR.repr(value)
    except ValueError:  # an int over Python's int-str digit limit cannot even be printed
        return f"<{type(value).__name__} too large to print>"
    if len(text) > MAX_SHOWN_CHARS:
        text = text[: MAX_SHOWN_CHARS - 3] + "..."
    return text
