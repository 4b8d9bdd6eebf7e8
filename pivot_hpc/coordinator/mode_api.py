"""The contract between the coordinator and a deployment mode (modes.py): a mode is told
when to act (`Mode`) and sees the coordinator only through `ModeView`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

from pivot_hpc.coordinator.rl_state import RLState
from pivot_hpc.planner import ShiftPlan, Snapshot
from pivot_hpc.planner.snapshot import Topology


class RoleView(Protocol):
    """A role's scheduler, as far as a mode reads it."""

    @property
    def replicas(self) -> Mapping[str, int]: ...  # active replica ids

    @property
    def n_seq(self) -> int: ...  # sequences running or queued

    @property
    def n_idle_replicas(self) -> int: ...  # active replicas running nothing


class Clock(Protocol):
    def now(self) -> float: ...


class ModeView(Protocol):
    """What a deployment mode may read and ask of the coordinator."""

    topology: Topology
    rl: RLState
    cluster: Clock
    schedulers: Mapping[str, RoleView]

    def idle(self) -> bool:
        """No shift in flight or waiting."""
        ...

    def settled(self) -> bool:
        """No shift in flight or waiting but engine recoveries (a dead engine's restart
        or exclusion): a mode may move on; a replica it asks up on a restarting engine's
        GPUs takes them over."""
        ...

    def request_up(self, rids: Iterable[str]) -> None: ...

    def take_down(self, rids: Iterable[str]) -> None: ...

    def release(self) -> None:
        """Release every batch the staleness bound and the mode allow."""
        ...

    def training_waits(self) -> bool:
        """A training batch is ready and training holds no GPU (they are lent out)."""
        ...

    def training_idle(self) -> bool:
        """Training holds its GPUs and runs no step."""
        ...

    def snapshot(self) -> Snapshot: ...

    def execute(self, plan: ShiftPlan) -> None: ...


class Mode(Protocol):
    name: str

    def may_release(self, c: ModeView, step: int) -> bool:
        """Whether batch `step` may start rolling out (on top of the staleness bound)."""
        ...

    def start(self, c: ModeView) -> None: ...

    def on_change(self, c: ModeView) -> None:
        """Called after every handled event batch: react to drained stages, ready batches."""
        ...

    def on_tick(self, c: ModeView) -> None: ...
