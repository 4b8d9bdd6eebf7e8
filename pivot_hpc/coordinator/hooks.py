"""What runs around a job's loop (docs/design.md §2): the live run's checkpoints,
held-out evaluation, step log and trackers; nothing for a bench or a test.

The coordinator is built with its hooks and calls them; nobody sets attributes on it
afterwards. Each hook gets the coordinator as an argument, so a hook object can be made
before the coordinator exists.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pivot_hpc.coordinator.coordinator import Coordinator


class Hooks:
    """Every hook does nothing; a job's backend overrides what it needs."""

    def before_run(self, coord: Coordinator) -> None:
        """Once, before the loop starts (the live run: wait for the workers)."""

    def stop_requested(self) -> bool:
        """Polled every loop turn: true = drain and stop (a signal, a test's deadline)."""
        return False

    def on_step(self, coord: Coordinator, step: int, metrics: dict[str, float]) -> None:
        """After each trained step (`step` counts from 0), with its metrics."""

    def after_run(self, coord: Coordinator) -> None:
        """Once, after the loop returns normally (also after a drained stop)."""

    def close(self) -> None:
        """Always, last (trackers, files)."""
