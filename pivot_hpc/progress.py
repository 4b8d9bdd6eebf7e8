"""Progress of long single-process work, legible on a terminal and in a batch log alike.

On a terminal: a tqdm bar. Anywhere else (a file under `sbatch`, a pipe through mpirun):
one plain line every PIVOT_HPC_PROGRESS_S seconds (default 30; 0: none) and a final line,
so a batch log holds a handful of lines instead of every redraw of a bar. The ranks of a
world never write to a terminal themselves (mpirun, srun and the local launcher pass
their output on line by line), so inside a world progress is always plain lines.

    with Progress(300, "SFT policy", unit="step") as bar:
        for ...:
            bar.update(1, nll=f"{nll:.3f}")
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import TextIO

from pivot_hpc.errors import ConfigError

PROGRESS_ENV = "PIVOT_HPC_PROGRESS_S"
DEFAULT_INTERVAL_S = 30.0


def interval_s(env: Mapping[str, str] | None = None) -> float:
    """Seconds between two progress lines off a terminal (PIVOT_HPC_PROGRESS_S; 0: only
    the final line)."""
    raw = (os.environ if env is None else env).get(PROGRESS_ENV, "").strip()
    if not raw:
        return DEFAULT_INTERVAL_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):  # also NaN
        raise ConfigError(
            f"{PROGRESS_ENV}={raw!r}: expected seconds between progress lines, a number >= 0 "
            f"(0: only the final line; unset: {DEFAULT_INTERVAL_S:g})"
        )
    return value


def is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


def _duration(seconds: float) -> str:
    s = max(round(seconds), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Progress:
    """A tqdm bar on a terminal, else a line every `interval` seconds and a final line.

    `stream`: where it writes (default stderr, so a command's stdout stays its result);
    `enabled=False`: nothing at all; `leave`: keep the finished bar on a terminal;
    `prefix`: put before every plain line."""

    def __init__(
        self,
        total: int | None,
        desc: str,
        *,
        unit: str = "it",
        enabled: bool = True,
        leave: bool = False,
        stream: TextIO | None = None,
        interval: float | None = None,
        prefix: str = "pivot-hpc: ",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total, self.desc, self.unit, self.prefix = total, desc, unit, prefix
        self.stream = sys.stderr if stream is None else stream
        self.n = 0
        self.postfix: dict[str, object] = {}
        self.enabled = enabled
        self._bar = None
        self._clock = clock
        self._start = self._last = clock()
        self._closed = not enabled
        self.interval = 0.0
        if not enabled:
            return
        if is_terminal(self.stream):
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, leave=leave, file=self.stream)
        else:
            self.interval = interval_s() if interval is None else interval

    def update(self, n: int = 1, **postfix: object) -> None:
        """`n` more done; `postfix` (name=value) is shown after the count from now on."""
        if self._closed:
            return
        self.n += n
        self.postfix.update(postfix)
        if self._bar is not None:
            if postfix:
                self._bar.set_postfix(self.postfix, refresh=False)
            self._bar.update(n)
            return
        now = self._clock()
        if self.interval > 0 and now - self._last >= self.interval:
            self._last = now
            self._write(self._line(now))

    def close(self, failed: bool = False) -> None:
        """The final line (off a terminal): how far it got, in how long."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
            return
        now = self._clock()
        count = f"{self.n}/{self.total}" if self.total is not None else str(self.n)
        what = f"stopped at {count} {self.unit}" if failed else f"{count} {self.unit} done"
        self._write(f"{self.desc}: {what} in {_duration(now - self._start)}{self._post()}")

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(failed=exc_type is not None)

    def _post(self) -> str:
        return "".join(f", {k}={v}" for k, v in self.postfix.items())

    def _line(self, now: float) -> str:
        elapsed = now - self._start
        if self.total:
            left = ""
            if self.n > 0:
                left = f", ~{_duration(elapsed * (self.total - self.n) / self.n)} left"
            pct = f" ({100 * self.n / self.total:.0f}%)"
            return (
                f"{self.desc}: {self.n}/{self.total} {self.unit}{pct}, "
                f"{_duration(elapsed)}{left}{self._post()}"
            )
        return f"{self.desc}: {self.n} {self.unit}, {_duration(elapsed)}{self._post()}"

    def _write(self, line: str) -> None:
        try:
            self.stream.write(f"{self.prefix}{line}\n")
            self.stream.flush()
        except (OSError, ValueError):  # the reader left or the stream closed: not fatal
            pass
