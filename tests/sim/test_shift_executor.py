"""Shift execution at the edges of a training step (coordinator/shifts.py)."""

from __future__ import annotations

from pivot_hpc.coordinator.events import ShiftDone
from pivot_hpc.job.config import load_config
from pivot_hpc.job.simulate import build

TINY = ["cluster.nodes=1", "cluster.gpus_per_node=4", "training.num_gpus=1", "loop.steps=4"]
# the paper's caps and veRL's activation recompute
TINY += [
    "rl.max_response_tokens=15000",
    "rl.reward.genrm_max_tokens=20000",
    "rl.trainer.recompute=full",
]


def test_a_rollout_replica_that_arrives_as_a_step_ends_loads_the_new_policy() -> None:
    # One batch of events holds the replica's shift-up completion and then a training
    # step's end: the step updates the replicas the scheduler has, which this one is not
    # yet (Alg. 4 activates it after the batch). Without a check at activation it would
    # decode with the old policy and its samples would break the staleness bound.
    coord, cluster, _ = build(load_config(None, [*TINY, "deployment.mode=pivot"]))
    updates: list[tuple[str, int]] = []
    cluster.update_weights = lambda rid, version: updates.append((rid, version))
    shifts = coord.shifts
    rid = "rollout:1"
    shifts.request_up([rid])
    shifts.on_shift_done(ShiftDone(cluster.now(), rid, "up", {}))
    assert shifts.replica_version[rid] == 0
    coord.rl.version = 1  # a step ended in the same batch (its update skipped rid)
    shifts.activate_arrived()
    assert updates == [(rid, 1)] and shifts.replica_version[rid] == 1
    assert rid in coord.schedulers["rollout"].replicas


def test_a_replica_up_to_date_is_not_updated_again() -> None:
    coord, cluster, _ = build(load_config(None, [*TINY, "deployment.mode=pivot"]))
    updates: list = []
    cluster.update_weights = lambda rid, version: updates.append((rid, version))
    coord.shifts.request_up(["rollout:2"])
    coord.shifts.on_shift_done(ShiftDone(cluster.now(), "rollout:2", "up", {}))
    coord.shifts.activate_arrived()
    assert updates == []
