"""What a live worker reports of its decode steps for the monitor's A–D refit
(runtime/decode_steps.py): the wall time between two steps while the engine has work.

(Not through runtime/worker.py: importing mpi4py here would initialise MPI in the pytest
process, and every `pivot-hpc run` started after it would inherit a world of one rank.)"""

from __future__ import annotations

import time
from types import SimpleNamespace

from pivot_hpc.runtime.decode_steps import DecodeSteps


def stats(steps: int, forward_s: float = 1e-4) -> SimpleNamespace:
    """An hf engine's `stats` after `steps` steps (one step per call)."""
    return SimpleNamespace(
        steps=steps, last_step_s=forward_s, last_step_seqs=4, last_step_tokens=64
    )


def test_a_step_counts_the_wall_time_since_the_previous_one() -> None:
    d = DecodeSteps()
    d.record(stats(1), 0)  # no predecessor: the engine's own forward time
    time.sleep(0.05)  # commands, sends, other ranks on the same cores
    d.record(stats(2), 1)
    (first, n, tok), (second, _, _) = d.take()
    assert first == 1e-4 and (n, tok) == (4, 64)
    assert second >= 0.05  # what the sequences waited, not the 0.1 ms forward
    assert d.take() == []


def test_a_step_after_newcomers_or_idle_is_not_a_wall_sample() -> None:
    d = DecodeSteps()
    d.added = True  # this step also prefilled: not what the decode model describes
    d.record(stats(1), 0)
    assert d.take() == []
    d.idle()  # the engine ran dry; the next step has no predecessor
    time.sleep(0.02)
    d.record(stats(2), 1)
    assert d.take() == [(1e-4, 4, 64)]
    d.record(stats(5, forward_s=0.003), 2)  # several steps at once (SGLang): its mean
    assert d.take() == [(0.003, 4, 64)]
