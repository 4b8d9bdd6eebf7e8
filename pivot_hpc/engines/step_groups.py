"""The data-parallel process groups of elastic training's step member sets
(runtime/training_world.py): built in the worker rank's torch.distributed world, or in its
trainer child's (`rl.trainer.process: child`, engines/process/child.py), by the same code.
"""

from __future__ import annotations

from collections.abc import Sequence


class StepGroups:
    """The data-parallel process groups of every member set the run has trained with.

    `ranks`: the world (MPI) ranks that may train, in torch.distributed rank order; `tp`:
    training's tensor parallelism (a replica is `tp` consecutive members).

    Every rank that may train forms each new set's groups (`FormGroups`, sent to all of
    them in the same order): torch names a group by a per-rank counter, so every rank must
    create the same groups in the same order — a group made by its members alone gets a
    name that depends on the groups each member made before, and the members never meet.
    A rank outside a group returns at once, so inference on it goes on."""

    def __init__(self, ranks: Sequence[int], tp: int) -> None:
        self.ranks = tuple(ranks)
        self.tp = tp
        self._mine: dict[tuple[int, ...], tuple[object, int, int]] = {}

    def form(self, members: Sequence[int], rank: int) -> None:
        """Create the groups of `members` (one per tensor-parallel position)."""
        import torch.distributed as dist

        members = tuple(members)
        tp = self.tp
        replicas = [members[i : i + tp] for i in range(0, len(members), tp)]
        if len(members) % tp or len(set(members)) != len(members):
            raise ValueError(f"step members {list(members)} are not whole replicas of {tp}")
        for j in range(tp):
            ranks = [self.ranks.index(rep[j]) for rep in replicas]
            # one replica: nothing to reduce, no group (the same choice on every rank)
            group = dist.new_group(ranks) if len(replicas) > 1 else None
            for d, rep in enumerate(replicas):
                if rep[j] == rank:
                    self._mine[members] = (group, len(replicas), d)

    def of(self, members: Sequence[int]) -> tuple[object, int, int]:
        """(group, data-parallel size, this rank's replica index) for a step of `members`."""
        try:
            return self._mine[tuple(members)]
        except KeyError:
            raise RuntimeError(
                f"no process group for the step members {list(members)}: FormGroups must "
                "reach every training rank before the step"
            ) from None
