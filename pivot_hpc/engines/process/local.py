"""A trainer in the process that drives it: the worker rank (`rl.trainer.process:
in_rank`) or a trainer child (engines/process/serve.py). Both drive the same
SupervisedTrainer: the engine with elastic training's step groups beside it (they are
objects of this process's torch.distributed world: the rank names member sets, this
process keeps their groups)."""

from __future__ import annotations

from typing import Any

from pivot_hpc.engines.base import SupervisedTrainer, TrainEngine
from pivot_hpc.engines.forwarding import forward
from pivot_hpc.engines.step_groups import StepGroups
from pivot_hpc.errors import PivotError


def _call(t: LocalTrainer, name: str, args: tuple, kwargs: dict) -> Any:
    return getattr(t.engine, name)(*args, **kwargs)


def _get(t: LocalTrainer, name: str) -> Any:
    return getattr(t.engine, name)


@forward(SupervisedTrainer, call=_call, get=_get)
class LocalTrainer:
    """`engine` with the step groups of the world ranks that may train (`groups`; None: a
    trainer alone, which forms none). It dies with its process, so it is never found dead."""

    def __init__(self, engine: TrainEngine, groups: StepGroups | None, rank: int | None) -> None:
        self.engine = engine
        self.groups = groups
        self.rank = rank

    def form_groups(self, members: tuple[int, ...]) -> None:
        if self.groups is None:
            raise RuntimeError("form_groups: this trainer was built without a training world")
        self.groups.form(members, self.rank)

    def use_members(self, members: tuple[int, ...]) -> None:
        if self.groups is None:
            raise RuntimeError("use_members: this trainer was built without a training world")
        self.engine.use_data_parallel(*self.groups.of(tuple(members)))

    @property
    def dead(self) -> bool:
        return False

    def death(self) -> Exception:
        return RuntimeError("a trainer in its rank's own process dies with the rank")

    def kill(self) -> None:
        raise PivotError(
            "the trainer runs in this rank's process and cannot be killed alone: "
            "set rl.trainer.process=child"
        )
