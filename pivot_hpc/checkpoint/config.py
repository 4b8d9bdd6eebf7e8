"""Checkpoint settings (docs/design.md §9)."""

from __future__ import annotations

from dataclasses import dataclass

from pivot_hpc.errors import fail


@dataclass(kw_only=True)
class CheckpointConfig:
    """Checkpoints go to `<run dir>/checkpoints/ckpt-NNNNNN` (written to a temporary
    directory, then renamed: a checkpoint is complete or absent). A run started again with
    the same run directory resumes from the newest one."""

    interval_steps: int = 5  # periodic checkpoint every N RL steps (0 = only on a signal)
    keep: int = 2  # complete checkpoints kept; older ones are deleted after a new one lands
    on_signal: bool = True  # SIGUSR1 / SIGTERM: checkpoint, then exit 3 (requeue me)
    resume: bool = True  # False: refuse to start in a run dir that has checkpoints
    # the run directory (weights, RL state, telemetry) readable by its owner only: umask
    # 077 on every rank, a new run dir 700; False keeps your umask (e.g. to share a group)
    private_run_dir: bool = True

    def validate(self, path: str) -> None:
        if self.interval_steps < 0:
            fail(f"{path}.interval_steps", self.interval_steps, "must be >= 0 (0 = off)")
        if self.keep < 1:
            fail(f"{path}.keep", self.keep, "keep at least 1 checkpoint")
