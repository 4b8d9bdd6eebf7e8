"""Progress of long single-process work: a bar on a terminal, a line every N seconds and a
final line anywhere else (a batch log), nothing when disabled."""

from __future__ import annotations

import io

import pytest

from pivot_hpc.errors import ConfigError
from pivot_hpc.progress import DEFAULT_INTERVAL_S, PROGRESS_ENV, Progress, interval_s


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_off_a_terminal_a_line_every_interval_and_a_final_line() -> None:
    out, clock = io.StringIO(), Clock()
    with Progress(300, "SFT policy", unit="steps", stream=out, interval=30, clock=clock) as bar:
        for i in range(300):
            clock.t += 0.25  # 75 s in all: lines at 30 s and 60 s
            bar.update(1, nll=f"{3 - i / 100:.3f}")
    lines = out.getvalue().splitlines()
    assert lines == [
        "pivot-hpc: SFT policy: 120/300 steps (40%), 30s, ~45s left, nll=1.810",
        "pivot-hpc: SFT policy: 240/300 steps (80%), 1m00s, ~15s left, nll=0.610",
        "pivot-hpc: SFT policy: 300/300 steps done in 1m15s, nll=0.010",
    ]
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


def test_short_work_writes_only_the_final_line_and_close_is_idempotent() -> None:
    out, clock = io.StringIO(), Clock()
    bar = Progress(None, "profile", stream=out, interval=30, clock=clock, prefix="")
    bar.update(3)
    clock.t += 2
    bar.close()
    bar.close()
    bar.update(1)  # after close: ignored
    assert out.getvalue() == "profile: 3 it done in 2s\n"


def test_interval_zero_means_only_the_final_line() -> None:
    out, clock = io.StringIO(), Clock()
    with Progress(10, "x", stream=out, interval=0, clock=clock) as bar:
        for _ in range(10):
            clock.t += 1000
            bar.update()
    assert out.getvalue().splitlines() == ["pivot-hpc: x: 10/10 it done in 2h46m"]


def test_a_failure_says_where_it_stopped() -> None:
    out, clock = io.StringIO(), Clock()
    with pytest.raises(RuntimeError), Progress(50, "SFT genrm", stream=out, clock=clock) as bar:
        bar.update(7)
        raise RuntimeError("boom")
    assert out.getvalue() == "pivot-hpc: SFT genrm: stopped at 7/50 it in 0s\n"


def test_disabled_writes_nothing() -> None:
    out = io.StringIO()
    with Progress(5, "x", stream=out, enabled=False) as bar:
        bar.update(5, nll="1")
    assert out.getvalue() == ""


def test_on_a_terminal_a_tqdm_bar() -> None:
    out, clock = Terminal(), Clock()
    with Progress(4, "SFT policy", stream=out, interval=0.001, clock=clock) as bar:
        assert bar._bar is not None  # tqdm draws; no plain lines
        for _ in range(4):
            clock.t += 10
            bar.update(1, nll="0.5")
    text = out.getvalue()
    assert "SFT policy" in text and "\r" in text  # redrawn in place
    assert "pivot-hpc:" not in text and "done in" not in text


def test_interval_from_the_environment() -> None:
    assert interval_s({}) == DEFAULT_INTERVAL_S == 30
    assert interval_s({PROGRESS_ENV: " 5 "}) == 5
    assert interval_s({PROGRESS_ENV: "0"}) == 0
    for bad in ("soon", "-1", "nan", "inf"):
        with pytest.raises(ConfigError, match=PROGRESS_ENV):
            interval_s({PROGRESS_ENV: bad})


def test_the_default_interval_follows_the_environment(monkeypatch) -> None:
    monkeypatch.setenv(PROGRESS_ENV, "1")
    out, clock = io.StringIO(), Clock()
    bar = Progress(3, "x", stream=out, clock=clock)
    clock.t += 1
    bar.update()
    assert out.getvalue() == "pivot-hpc: x: 1/3 it (33%), 1s, ~2s left\n"
