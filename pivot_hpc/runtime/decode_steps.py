"""What a live worker reports of its engine's decode steps for the monitor's A–D refit
(coordinator/monitor.py): (seconds, N_seq, N_tok) per step.

Only a step that decoded and did not also prefill newcomers counts (a prefill is not what
the decode model describes). The seconds are what the role's sequences waited for that
token: the wall time since the previous step ended while the engine had work — command
handling, sends and a CPU shared with other ranks included, not only the forward (on 2
cores the forward was a tenth of it, and the planner's A–D ten times too fast). An engine
that decodes on its own (SGLang's scheduler) reports the mean step over the steps since
the last `stats`; several steps in one call keep that figure.
"""

from __future__ import annotations

import time


class DecodeSteps:
    def __init__(self) -> None:
        self.added = False  # a sequence arrived since the engine's last step
        self._samples: list[tuple[float, int, int]] = []
        self._prev_end: float | None = None  # the engine's last step, while it has work

    def record(self, stats, before: int) -> None:
        """After an engine step: `stats` the engine's now, `before` its step count before."""
        now = time.monotonic()
        prev, self._prev_end = self._prev_end, now
        added, self.added = self.added, False
        if added or not (stats.steps > before and stats.last_step_seqs > 0):
            return
        seconds = stats.last_step_s
        if stats.steps == before + 1 and prev is not None:
            seconds = max(seconds, now - prev)
        self._samples.append((seconds, stats.last_step_seqs, stats.last_step_tokens))

    def idle(self) -> None:
        """The engine has no work: the next step's time has no predecessor."""
        self._prev_end = None

    def reset(self) -> None:
        """A new role: the previous role's steps are not this one's."""
        self._samples = []
        self._prev_end = None

    def take(self) -> list[tuple[float, int, int]]:
        out, self._samples = self._samples, []
        return out
