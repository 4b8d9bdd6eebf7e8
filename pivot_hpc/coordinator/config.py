"""Configuration of the coordinator: deployment mode and the RL loop."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pivot_hpc.errors import fail


@dataclass(kw_only=True)
class DeploymentConfig:
    """How roles share GPUs (paper §8.1, Table 4). GPU counts are for the static splits."""

    mode: Literal["colocated", "disaggregated", "rr_colocated", "pivot"] = "pivot"  # deployment
    staleness: int | None = None  # None: 0 for colocated, 2 otherwise (App. E)
    rollout_gpus: int | None = None  # disaggregated split (and static/rule's start)
    reward_gpus: int | None = None  # disaggregated split: GenRM GPUs
    # An inference replica whose engine process dies is shifted down (its sequences move
    # with their tokens) and restarted on its GPUs, refit from GPS. One that dies again
    # within this many seconds of its last death is excluded instead: its GPUs leave the
    # inference roles for the rest of the allocation. 0 = always restart.
    engine_restart_window_s: float = 600.0

    def validate(self, path: str) -> None:
        if not 0 <= self.engine_restart_window_s < float("inf"):
            fail(f"{path}.engine_restart_window_s", self.engine_restart_window_s, "seconds >= 0")
        if self.staleness is not None and self.staleness < 0:
            fail(f"{path}.staleness", self.staleness, "must be >= 0")
        if self.mode == "colocated" and self.staleness:
            fail(f"{path}.staleness", self.staleness, "colocated runs synchronously: use 0")

    def effective_staleness(self) -> int:
        if self.staleness is not None:
            return self.staleness
        return 0 if self.mode == "colocated" else 2


@dataclass(kw_only=True)
class LoopConfig:
    """The RL loop: steps, and prompts × samples per step."""

    steps: int = 10  # RL steps (optimizer updates) of the run
    batch_prompts: int = 64  # prompts per step
    samples_per_prompt: int = 8  # responses per prompt (one GRPO group)
    monitor_interval_s: float = 1.0  # telemetry rows and length sync
    # Held-out evaluation (greedy accuracy on rl.data.validation), at the start and end of
    # every allocation and every `eval_every_steps` steps (0: start and end only).
    eval_problems: int = 64  # 0 = off
    eval_every_steps: int = 0  # held-out evaluation cadence (0: start and end)

    def validate(self, path: str) -> None:
        if self.steps < 1:
            fail(f"{path}.steps", self.steps, "must be >= 1")
        if self.batch_prompts < 1 or self.samples_per_prompt < 1:
            fail(
                f"{path}.batch_prompts",
                (self.batch_prompts, self.samples_per_prompt),
                "must be >= 1",
            )
        if self.eval_problems < 0 or self.eval_every_steps < 0:
            fail(
                f"{path}.eval_problems",
                (self.eval_problems, self.eval_every_steps),
                "eval_problems and eval_every_steps must be >= 0 (0 = off / start and end)",
            )
        if self.monitor_interval_s <= 0:
            fail(f"{path}.monitor_interval_s", self.monitor_interval_s, "must be > 0")
