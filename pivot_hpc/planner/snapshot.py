"""The planner's view of the cluster: fixed topology plus a workload snapshot.

Topology (from the config, fixed for a run): GPUs grouped in nodes; each inference role
has replica *slots* of `tp` aligned GPUs on one node (slot s = GPUs [s·tp, (s+1)·tp)),
restricted to the GPUs the role may use; training owns one fixed GPU set.

Snapshot (from the monitor, each planning round): the active replicas of rollout and
reward with their scheduler states, and the training state. Replica ids are
"<role>:<slot>"; training is the single id "training".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pivot_hpc.config.schema import ShiftTimes
from pivot_hpc.errors import PivotError
from pivot_hpc.scheduler import ReplicaModel, Scheduler

INFERENCE_ROLES = ("rollout", "reward")
TRAINING = "training"


class SnapshotError(PivotError, ValueError):
    """The snapshot contradicts the topology (overlapping replicas, unknown slots, …)."""


def replica_id(role: str, slot: int) -> str:
    return f"{role}:{slot}"


def role_of(rid: str) -> str:
    return TRAINING if rid == TRAINING else rid.split(":", 1)[0]


def slot_of(rid: str) -> int:
    return int(rid.split(":", 1)[1])


@dataclass(frozen=True)
class RoleSpec:
    """Replica slots of one inference role."""

    name: str
    tp: int
    kv_capacity: int
    model: ReplicaModel
    slots: Mapping[int, tuple[int, ...]]  # slot index -> GPU ids (only allowed slots)


@dataclass(frozen=True)
class Topology:
    num_gpus: int
    gpus_per_node: int
    roles: Mapping[str, RoleSpec]
    training_gpus: tuple[int, ...]
    shift_time: ShiftTimes = field(default_factory=ShiftTimes)

    def __post_init__(self) -> None:
        for name, spec in self.roles.items():
            if name not in INFERENCE_ROLES:
                raise SnapshotError(f"unknown inference role {name!r}; valid: {INFERENCE_ROLES}")
            for s, gpus in spec.slots.items():
                if len(gpus) != spec.tp or len({g // self.gpus_per_node for g in gpus}) != 1:
                    raise SnapshotError(f"{name} slot {s}: GPUs {gpus} do not form one tp group")
                if any(not 0 <= g < self.num_gpus for g in gpus):
                    raise SnapshotError(
                        f"{name} slot {s}: GPUs {gpus} outside 0..{self.num_gpus - 1}"
                    )
        if len(set(self.training_gpus)) != len(self.training_gpus):
            raise SnapshotError(f"training GPUs {self.training_gpus} are not a set")
        if any(not 0 <= g < self.num_gpus for g in self.training_gpus):
            raise SnapshotError(f"training GPUs {self.training_gpus} outside the cluster")

    @classmethod
    def build(
        cls,
        *,
        num_gpus: int,
        gpus_per_node: int,
        tp: Mapping[str, int],
        kv_capacity: Mapping[str, int],
        models: Mapping[str, ReplicaModel],
        training_gpus: tuple[int, ...] | list[int],
        allowed: Mapping[str, list[int] | None] | None = None,
        shift_time: ShiftTimes | None = None,
    ) -> Topology:
        roles = {}
        for name in INFERENCE_ROLES:
            t = tp[name]
            if t < 1 or gpus_per_node % t:
                raise SnapshotError(f"{name}.tp={t} must divide gpus_per_node={gpus_per_node}")
            ok = (
                set(range(num_gpus))
                if not allowed or allowed.get(name) is None
                else set(allowed[name])
            )
            slots = {
                s: tuple(range(s * t, (s + 1) * t))
                for s in range(num_gpus // t)
                if set(range(s * t, (s + 1) * t)) <= ok
            }
            roles[name] = RoleSpec(name, t, kv_capacity[name], models[name], slots)
        return cls(
            num_gpus=num_gpus,
            gpus_per_node=gpus_per_node,
            roles=roles,
            training_gpus=tuple(sorted(training_gpus)),
            shift_time=shift_time or ShiftTimes(),
        )

    def gpus_of(self, rid: str) -> tuple[int, ...]:
        role = role_of(rid)
        if role == TRAINING:
            return self.training_gpus
        spec = self.roles.get(role)
        if spec is None:
            raise SnapshotError(f"replica {rid!r}: unknown role {role!r}")
        try:
            return spec.slots[slot_of(rid)]
        except (KeyError, ValueError):
            raise SnapshotError(
                f"replica {rid!r} is not a valid {role} slot of this topology"
            ) from None

    def tau(self, role: str) -> float:
        return float(getattr(self.shift_time, role))


@dataclass
class TrainingState:
    """Training shifts as a whole: it holds its GPU set (`active`) or none."""

    active: bool = False  # holds its GPUs (context loaded)
    busy: bool = False  # running a training step; cannot shift down
    batch_ready: bool = False  # the next batch is ready within the staleness bound

    def validate(self) -> None:
        if self.busy and not self.active:
            raise SnapshotError("training is busy but does not hold its GPUs (active=False)")


@dataclass
class Snapshot:
    """Workload state handed to the planner (schedulers are only read, never changed)."""

    topology: Topology
    schedulers: Mapping[str, Scheduler]
    training: TrainingState = field(default_factory=TrainingState)

    def validate(self) -> dict[int, str]:
        """Check consistency; return the GPU → occupant replica map."""
        self.training.validate()
        occupancy: dict[int, str] = {}
        for role in INFERENCE_ROLES:
            sched = self.schedulers.get(role)
            if sched is None:
                raise SnapshotError(f"snapshot has no scheduler for role {role!r}")
            if sched.role != role:
                raise SnapshotError(f"scheduler for {role!r} says its role is {sched.role!r}")
            for rid in sched.replicas:
                if role_of(rid) != role:
                    raise SnapshotError(f"replica {rid!r} is listed under role {role!r}")
                for g in self.topology.gpus_of(rid):
                    if g in occupancy:
                        raise SnapshotError(
                            f"GPU {g} is held by both {occupancy[g]!r} and {rid!r}: "
                            "a GPU serves one replica of one role at a time"
                        )
                    occupancy[g] = rid
        if self.training.active:
            for g in self.topology.training_gpus:
                if g in occupancy:
                    raise SnapshotError(f"GPU {g} is held by both {occupancy[g]!r} and training")
                occupancy[g] = TRAINING
        return occupancy

    def n_seq(self, role: str) -> int:
        return self.schedulers[role].n_seq

    def throughput(self, role: str) -> float:
        return self.schedulers[role].throughput()
