"""The planner's view of the cluster: fixed topology plus a workload snapshot.

Topology (from the config, fixed for a run): GPUs grouped in nodes; each inference role
has replica *slots* of `tp` aligned GPUs on one node (slot s = GPUs [s·tp, (s+1)·tp)),
restricted to the GPUs the role may use; training owns one fixed GPU set. With elastic
training (beyond the paper) training also has extension slots: data-parallel replicas of
`training_tp` aligned GPUs outside its set that it may grow onto between steps.

Snapshot (from the monitor, each planning round): the active replicas of rollout and
reward with their scheduler states, and the training state. Replica ids are
"<role>:<slot>"; training's own set is the single id "training", its extensions
"training:<slot>".
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from pivot_hpc.errors import PivotError
from pivot_hpc.planner.config import ShiftTimes
from pivot_hpc.scheduler import ReplicaModel, Scheduler

INFERENCE_ROLES = ("rollout", "reward")
TRAINING = "training"


class SnapshotError(PivotError, ValueError):
    """The snapshot contradicts the topology (overlapping replicas, unknown slots, …)."""


def replica_id(role: str, slot: int) -> str:
    return f"{role}:{slot}"


def role_of(rid: str) -> str:
    return TRAINING if rid == TRAINING else rid.split(":", 1)[0]


def is_extension(rid: str) -> bool:
    """A data-parallel extension of training ("training:<slot>", elastic training)."""
    return rid.startswith(TRAINING + ":")


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
    prefill_s_per_token: float = 0.0  # re-prefill cost of a migrated sequence's context


def extension_slots(
    num_gpus: int, training_gpus: Iterable[int], training_tp: int
) -> dict[int, tuple[int, ...]]:
    """Elastic training's extension slots: every aligned group of `training_tp` GPUs that
    the training set does not touch (slot s = GPUs s·tp … s·tp+tp-1). The planner and the
    live training world (runtime/training_world.py) both take them from here."""
    base = set(training_gpus)
    out = {}
    for s in range(num_gpus // training_tp):
        gpus = tuple(range(s * training_tp, (s + 1) * training_tp))
        if not base & set(gpus):
            out[s] = gpus
    return out


@dataclass(frozen=True)
class Topology:
    num_gpus: int
    gpus_per_node: int
    roles: Mapping[str, RoleSpec]
    training_gpus: tuple[int, ...]
    shift_time: ShiftTimes = field(default_factory=ShiftTimes)
    training_tp: int = 1  # GPUs of one data-parallel replica of training
    # elastic training: extension slot -> its GPUs (empty: training is "0 or N")
    elastic: Mapping[int, tuple[int, ...]] = field(default_factory=dict)

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
        base = set(self.training_gpus)
        for s, gpus in self.elastic.items():
            if len(gpus) != self.training_tp or base & set(gpus):
                raise SnapshotError(f"training extension {s}: GPUs {gpus} overlap training's")

    def with_shift_time(self, shift_time: ShiftTimes) -> Topology:
        """This topology with refitted shift times (at every shift done): the slots are
        unchanged, so it skips `__post_init__`'s check of every slot's GPUs."""
        out = copy.copy(self)
        object.__setattr__(out, "shift_time", shift_time)
        return out

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
        training_tp: int = 1,
        elastic: bool = False,
        prefill_s_per_token: Mapping[str, float] | None = None,
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
            prefill = (prefill_s_per_token or {}).get(name, 0.0)
            roles[name] = RoleSpec(name, t, kv_capacity[name], models[name], slots, prefill)
        if training_tp < 1 or gpus_per_node % training_tp:
            raise SnapshotError(
                f"training tp={training_tp} must divide gpus_per_node={gpus_per_node}"
            )
        extensions = extension_slots(num_gpus, training_gpus, training_tp) if elastic else {}
        return cls(
            num_gpus=num_gpus,
            gpus_per_node=gpus_per_node,
            roles=roles,
            training_gpus=tuple(sorted(training_gpus)),
            shift_time=shift_time or ShiftTimes(),
            training_tp=training_tp,
            elastic=extensions,
        )

    def without_gpus(self, gpus: Iterable[int]) -> Topology:
        """This topology with `gpus` out of every inference role and elastic extension (a
        replica whose engine kept dying: coordinator/shifts.py); training's own GPUs stay."""
        out = set(gpus)
        roles = {
            name: dataclasses.replace(
                spec, slots={s: g for s, g in spec.slots.items() if not out & set(g)}
            )
            for name, spec in self.roles.items()
        }
        elastic = {s: g for s, g in self.elastic.items() if not out & set(g)}
        return dataclasses.replace(self, roles=roles, elastic=elastic)

    def gpus_of(self, rid: str) -> tuple[int, ...]:
        role = role_of(rid)
        if rid == TRAINING:
            return self.training_gpus
        if role == TRAINING:
            try:
                return self.elastic[slot_of(rid)]
            except (KeyError, ValueError):
                raise SnapshotError(
                    f"replica {rid!r} is not a training extension of this topology "
                    "(planner.elastic_training off, or the slot overlaps training's GPUs)"
                ) from None
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
    """Training shifts as a whole: it holds its GPU set (`active`) or none. With elastic
    training, `extensions` are the data-parallel replicas it holds beyond its set; every
    one of them takes part in each step."""

    active: bool = False  # holds its GPUs (context loaded)
    busy: bool = False  # running a training step; cannot shift down
    batch_ready: bool = False  # the next batch is ready within the staleness bound
    batch_pending: bool = False  # the next batch is released, its samples still in flight
    extensions: set[str] = field(default_factory=set)  # "training:<slot>" held

    def validate(self) -> None:
        if self.busy and not self.active:
            raise SnapshotError("training is busy but does not hold its GPUs (active=False)")

    def holds(self, rid: str) -> bool:
        return self.active if rid == TRAINING else rid in self.extensions


@dataclass
class Snapshot:
    """Workload state handed to the planner (schedulers are only read, never changed)."""

    topology: Topology
    schedulers: Mapping[str, Scheduler]
    training: TrainingState = field(default_factory=TrainingState)
    # (up role, down role) shifts that would undo a plan that has not repaid its penalty
    # yet (coordinator/shifts.py; pivot+ does not plan them)
    unrepaid: frozenset[tuple[str, str]] = frozenset()
    # Trajectories parked on a tool call (issue 37) that are due back within the planning
    # horizon, per role: demand the role's scheduler does not hold yet (no running slot,
    # no queue place) but whose next turn will need a replica within H. Those due later
    # are not demand: their GPUs can serve the GenRM or training meanwhile.
    parked_due: Mapping[str, int] = field(default_factory=dict)
    # Replica -> (trajectories, context tokens it caches for them) of those parked with
    # affinity to it (SeqState.affinity) and due back within H: a shift-down of the
    # replica makes their next turns re-prefill those tokens instead of only the
    # observation (pairs.lost_prefix).
    parked_prefix: Mapping[str, tuple[int, int]] = field(default_factory=dict)

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
        held = [TRAINING] if self.training.active else []
        for rid in [*held, *sorted(self.training.extensions)]:
            for g in self.topology.gpus_of(rid):
                if g in occupancy:
                    raise SnapshotError(f"GPU {g} is held by both {occupancy[g]!r} and {rid!r}")
                occupancy[g] = rid
        return occupancy

    def n_seq(self, role: str) -> int:
        """N_seq of Eq. 1: the role's running and queued sequences, plus parked
        trajectories due back within the horizon (`parked_due`)."""
        return self.schedulers[role].n_seq + self.parked_due.get(role, 0)

    def throughput(self, role: str) -> float:
        return self.schedulers[role].throughput()
