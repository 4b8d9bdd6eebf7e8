"""Telemetry errors a user can act on (a missing run directory, an unreadable file), and
`printable`, which makes text read from a telemetry file safe to show on a terminal."""

from __future__ import annotations

import re

from pivot_hpc.errors import PivotError

# Terminal escape sequences, 7-bit (ESC ...) and 8-bit (C1) forms, removed whole so that
# no parameter text of an OSC 52 (clipboard) or a CSI 2J (clear screen) is left behind:
# string sequences (OSC, DCS, SOS, PM, APC) up to their terminator (BEL or ST) or the end,
# then CSI sequences, then any other two- or three-byte escape.
_ESCAPES = re.compile(
    r"(?:\x1b[\]P^_X]|[\x90\x98\x9d\x9e\x9f]).*?(?:\x07|\x1b\\|\x9c|$)"
    r"|(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]?"
    r"|\x1b[ -/]*[0-~]?",
    re.DOTALL,
)
# Line breaks (Python's splitlines() also splits on \x85, \u2028 and \u2029) become one space:
# a message stays one line.
_BREAKS = re.compile(r"[\t\n\v\f\r\x1c-\x1e\x85\u2028\u2029]+")
# The other C0 and C1 controls, DEL, and the bidirectional overrides that reorder what a
# terminal shows ("Trojan source").
_CONTROLS = re.compile(r"[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """`text` without terminal escape sequences and control characters, on one line."""
    if text.isprintable():  # the common case: nothing to do
        return text
    text = _ESCAPES.sub("", text)
    text = _BREAKS.sub(" ", text)
    return _CONTROLS.sub("", text)


class TelemetryError(PivotError):
    """A run directory or telemetry file that cannot be read as pivot_hpc telemetry.

    Its message is shown as one line: text quoted from a (possibly hostile) file cannot
    break it up or reach the terminal as escape sequences."""

    def __init__(self, message: str) -> None:
        super().__init__(printable(str(message)))
