"""What a live worker reports of its decode steps for the monitor's A–D refit
(runtime/worker.py): the wall time between two steps while the engine has work."""

from __future__ import annotations

import time
from types import SimpleNamespace

from pivot_hpc.runtime.worker import Worker


class CountingEngine:
    """An engine's `stats` after each step (hf semantics: one step per call)."""

    def __init__(self, forward_s: float) -> None:
        self.steps = 0
        self.forward_s = forward_s

    def step(self) -> None:
        self.steps += 1

    def stats(self) -> SimpleNamespace:
        return SimpleNamespace(
            steps=self.steps, last_step_s=self.forward_s, last_step_seqs=4, last_step_tokens=64
        )


def worker() -> Worker:
    w = Worker.__new__(Worker)  # only the step bookkeeping, no MPI world
    w._steps, w._added, w._prev_step_end = [], False, None
    return w


def test_a_step_counts_the_wall_time_since_the_previous_one() -> None:
    w, engine = worker(), CountingEngine(forward_s=1e-4)
    engine.step()
    w._record_step(engine, 0)  # no predecessor: the engine's own forward time
    time.sleep(0.05)  # commands, sends, other ranks on the same cores
    engine.step()
    w._record_step(engine, 1)
    (first, n, tok), (second, _, _) = w._steps
    assert first == 1e-4 and (n, tok) == (4, 64)
    assert second >= 0.05  # what the sequences waited, not the 0.1 ms forward


def test_a_step_after_newcomers_or_idle_is_not_a_decode_sample() -> None:
    w, engine = worker(), CountingEngine(forward_s=1e-4)
    w._added = True  # this step also prefilled: not what the decode model describes
    engine.step()
    w._record_step(engine, 0)
    assert w._steps == []
    w._prev_step_end = None  # the engine went idle; the next step has no predecessor
    time.sleep(0.02)
    engine.step()
    w._record_step(engine, 1)
    assert w._steps == [(1e-4, 4, 64)]
