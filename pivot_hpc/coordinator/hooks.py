"""What runs around a job's loop (docs/design.md §2): the live run's checkpoints,
held-out evaluation, step log and trackers; nothing for a bench or a test.

The coordinator is built with its hooks and calls them; nobody sets attributes on it
afterwards. Each hook gets the coordinator as an argument, so a hook object can be made
before the coordinator exists.
"""

from __future__ import annotations

from typing import Any, Protocol


class RunView(Protocol):
    """What a hook sees of the coordinator that calls it (a narrow view, not the class):
    the run's state and accounting, its cluster and schedulers, and the two calls a hook
    makes (`handle` an event while waiting for the workers, `restore` a checkpoint)."""

    rl: Any  # the RL loop's state (coordinator/rl_state.py)
    samples: dict[int, Any]
    stats: Any  # the run's accounting
    cluster: Any
    schedulers: dict[str, Any]
    telemetry: Any
    topology: Any
    shift_clock: Any
    fits: Any
    stopped: bool
    stop_reason: str | None
    tokens_total: int
    first_step_start: float
    last_step_end: float

    def allocation(self) -> dict[str, int]: ...

    def handle(self, event: Any) -> None: ...

    def restore(self, batches: Any, generated: dict[tuple[str, int], int]) -> None: ...


class Hooks:
    """Every hook does nothing; a job's backend overrides what it needs."""

    def before_run(self, coord: RunView) -> None:
        """Once, before the loop starts (the live run: wait for the workers)."""

    def stop_requested(self) -> bool:
        """Polled every loop turn: true = drain and stop (a signal, a test's deadline)."""
        return False

    def on_step(self, coord: RunView, step: int, metrics: dict[str, float]) -> None:
        """After each trained step (`step` counts from 0), with its metrics."""

    def after_run(self, coord: RunView) -> None:
        """Once, after the loop returns normally (also after a drained stop)."""

    def close(self) -> None:
        """Always, last (trackers, files)."""
