"""The monitor's refits (paper §7: the planner works from what the cluster measures, not
from what it was told at start-up).

- `ShiftClock`: τ_shift per role from the shifts the coordinator has seen, measured from
  the request to the completion event — what a shift really costs a GPU (messages, a
  worker finishing its current step, the phases themselves), not the phases alone.
- `OnlineFit`: a role's throughput constants A–D refitted from the engines' own decode
  step statistics (latency, N_seq, N_tok) over a sliding window.
- `MeasuredTrainingTime`: a training step's seconds as a function of its tokens and GPUs,
  fitted from the steps the run has trained (elastic training sizes steps with it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np

from pivot_hpc.planner.config import ShiftTimes
from pivot_hpc.scheduler import ThroughputModel
from pivot_hpc.scheduler.throughput import fit_throughput_model

ROLES = ("rollout", "reward", "training")


class ShiftClock:
    """Measured shift durations → τ_shift (seconds) per role that shifts down.

    A GPU taken from role R is lost for R's shift down plus the shift up of whatever takes
    it, so τ(R) = mean down time of R + mean up time over the roles that shifted up. Means
    are exponential (weight `alpha` for the newest); until a role has been measured its
    configured value stands in for it."""

    def __init__(self, configured: ShiftTimes, alpha: float = 0.3) -> None:
        self.configured = configured
        self.alpha = alpha
        self.down: dict[str, float] = {}
        self.up: float | None = None
        self.measured = 0

    def observe(self, role: str, kind: str, seconds: float) -> None:
        self.measured += 1
        if kind == "up":
            self.up = seconds if self.up is None else self._mix(self.up, seconds)
        else:
            old = self.down.get(role)
            self.down[role] = seconds if old is None else self._mix(old, seconds)

    def _mix(self, old: float, new: float) -> float:
        return (1 - self.alpha) * old + self.alpha * new

    def shift_times(self) -> ShiftTimes:
        if self.up is None:
            return self.configured
        return ShiftTimes(
            **{
                r: self.down[r] + self.up if r in self.down else getattr(self.configured, r)
                for r in ROLES
            }
        )


class OnlineFit:
    """A role's A–D from recent decode steps; `refit` returns a new model when the window
    holds enough varied steps, else None (the current model stays)."""

    def __init__(self, window: int = 512, min_steps: int = 64, every: int = 64) -> None:
        self.steps: deque[tuple[float, int, int]] = deque(maxlen=window)
        self.min_steps = min_steps
        self.every = every
        self._since = 0

    def add(self, steps: Iterable[tuple[float, int, int]]) -> None:
        for latency, n_seq, n_tok in steps:
            if latency > 0 and n_seq >= 1:
                self.steps.append((float(latency), int(n_seq), int(n_tok)))
                self._since += 1

    def refit(self, max_running: int = 0) -> ThroughputModel | None:
        if len(self.steps) < self.min_steps or self._since < self.every:
            return None
        self._since = 0
        y, n, tok = (np.array(c, dtype=float) for c in zip(*self.steps, strict=True))
        if len(np.unique(n)) < 2:  # one batch size says nothing about B vs C·N_seq
            return None
        fit = fit_throughput_model(y, n, tok).model
        return ThroughputModel(fit.A, fit.B, fit.C, fit.D, max_running=max_running)


class TrainingTime(Protocol):
    """Seconds of a training step over sequences of `lengths` tokens on `gpus` GPUs."""

    def ready(self) -> bool:
        """Whether `step_time` can answer yet."""
        ...

    def step_time(self, lengths: Sequence[int], gpus: int) -> float: ...

    def observe(self, lengths: Sequence[int], gpus: int, seconds: float) -> None:
        """A step that ran: its sequences, GPUs and measured duration."""
        ...


class MeasuredTrainingTime:
    """seconds ≈ a + b·tokens/gpus, least squares (a ≥ 0) over the last `window` steps:
    data parallelism divides the tokens, the GPS write and step overheads do not. With a
    single tokens/gpus value seen, a = 0 (ideal scaling until a step shows otherwise)."""

    def __init__(self, window: int = 32) -> None:
        self.points: deque[tuple[float, float]] = deque(maxlen=window)  # (tokens/gpu, s)
        self.a, self.b = 0.0, 0.0

    def ready(self) -> bool:
        return bool(self.points)

    def observe(self, lengths: Sequence[int], gpus: int, seconds: float) -> None:
        if gpus < 1 or seconds <= 0 or not len(lengths):
            return
        self.points.append((float(sum(lengths)) / gpus, float(seconds)))
        x, y = (np.array(c) for c in zip(*self.points, strict=True))
        a, b = 0.0, float(y.sum() / x.sum())
        if np.ptp(x) > 1e-9 * x.max():
            slope, icept = np.polyfit(x, y, 1)
            if icept >= 0 and slope > 0:
                a, b = float(icept), float(slope)
        self.a, self.b = a, b

    def step_time(self, lengths: Sequence[int], gpus: int) -> float:
        return self.a + self.b * float(sum(lengths)) / max(gpus, 1)
