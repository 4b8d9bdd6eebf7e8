"""Learning curves of a run from its telemetry (paper §8.6, Figure 15): held-out accuracy
and the moving-average training reward, against RL step and against wall-clock time.

`analysis/convergence.py` plots them; `pivot-hpc bench convergence` reports their ends.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pivot_hpc.telemetry.reader import Run
from pivot_hpc.telemetry.summary import completed_steps


@dataclass(frozen=True)
class Curves:
    label: str
    seed: int | None
    eval_version: np.ndarray  # policy version (= RL steps) of each held-out evaluation
    eval_t: np.ndarray  # seconds since the first step started
    accuracy: np.ndarray
    step: np.ndarray  # completed steps, in order
    step_t: np.ndarray  # seconds since the first step started, at each step's end
    reward_ma: np.ndarray  # trailing moving average of the step's mean training reward

    @property
    def accuracy_first(self) -> float | None:
        return float(self.accuracy[0]) if len(self.accuracy) else None

    @property
    def accuracy_last(self) -> float | None:
        return float(self.accuracy[-1]) if len(self.accuracy) else None

    @property
    def wall_s(self) -> float:
        return float(self.step_t[-1]) if len(self.step_t) else 0.0


def moving_average(x: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over up to `window` values (shorter at the start)."""
    if not len(x):
        return x.astype(np.float64)
    c = np.cumsum(np.insert(x.astype(np.float64), 0, 0.0))
    k = np.minimum(np.arange(1, len(x) + 1), window)
    return (c[1:] - c[np.arange(1, len(x) + 1) - k]) / k


def curves(run: Run, window: int = 8) -> Curves:
    steps = completed_steps(run["steps"])
    order = np.argsort(steps["step"], kind="stable")
    steps = steps[order]
    t0 = float(steps["start"].min()) if len(steps) else 0.0
    evals = run["evals"]
    evals = evals[np.argsort(evals["version"], kind="stable")]
    seed = (run.config.get("rl") or {}).get("trainer", {}).get("seed")
    return Curves(
        label=run.label,
        seed=None if seed is None else int(seed),
        eval_version=evals["version"].astype(np.int64),
        eval_t=np.maximum(evals["t"] - t0, 0.0),
        accuracy=evals["accuracy"].astype(np.float64),
        step=steps["step"].astype(np.int64) + 1,  # trained steps after it
        step_t=steps["end"] - t0,
        reward_ma=moving_average(steps["reward_mean"], window),
    )
