"""Engine recoveries do not hold plans and stage changes up (coordinator/shifts.py
`settled`): a dead engine's restart is a shift no plan made, so the planner plans around
its GPUs and a mode moves on, and a replica asked up on those GPUs takes them over."""

from __future__ import annotations

import pytest

from pivot_hpc.coordinator.events import ReplicaFailed, ShiftDone
from pivot_hpc.job.config import load_config
from pivot_hpc.job.simulate import build
from tests.sim.test_failures import OFTEN, _job
from tests.sim.test_shift_executor import TINY


def _serving(rid: str):
    """A coordinator (pivot mode, nothing up) with `rid` up and serving."""
    coord, cluster, _ = build(load_config(None, [*TINY, "deployment.mode=pivot"]))
    coord.shifts.request_up([rid])
    coord.shifts.on_shift_done(ShiftDone(cluster.now(), rid, "up", {}))
    coord.shifts.activate_arrived()
    assert rid in coord.schedulers["rollout"].replicas
    return coord, cluster


def _die(coord, rid: str) -> None:
    ev = ReplicaFailed(coord.cluster.now(), "rollout", rid, rid, "injected engine death")
    coord.shifts.on_failure(ev)


def test_a_restart_leaves_the_executor_settled_and_the_planner_plans_around_it(capsys) -> None:
    coord, cluster = _serving("rollout:1")
    _die(coord, "rollout:1")
    shifts = coord.shifts
    assert shifts.shifting == {"rollout:1": "down"} and not coord.idle()
    assert coord.settled()  # only the recovery moves
    assert shifts.recovering_gpus() == {1}
    snap = coord.snapshot()  # no slot on the restarting GPU, of either role
    assert all(1 not in g for spec in snap.topology.roles.values() for g in spec.slots.values())
    assert 1 in coord.topology.roles["reward"].slots[1]  # the coordinator's own is whole
    shifts.on_shift_done(ShiftDone(cluster.now(), "rollout:1", "down", {}))
    assert shifts.shifting == {"rollout:1": "up"} and coord.settled()  # refitting
    shifts.on_shift_done(ShiftDone(cluster.now(), "rollout:1", "up", {}))
    shifts.activate_arrived()
    assert coord.idle() and not shifts.recovering() and coord.snapshot().topology is coord.topology
    assert coord.stats.engine_restarts == 1 and "rollout:1" in coord.schedulers["rollout"].replicas
    assert "injected engine death" in capsys.readouterr().out


def test_a_replica_asked_up_on_a_restarting_engines_gpus_takes_them_over() -> None:
    coord, cluster = _serving("rollout:1")
    shifts = coord.shifts
    _die(coord, "rollout:1")
    shifts.request_up(["reward:1"])  # e.g. colocated's next stage
    assert shifts.pending_up == ["reward:1"] or shifts.chained == {"rollout:1": "reward:1"}
    assert not coord.settled()  # that shift-up is the mode's: it waits for it
    shifts.on_shift_done(ShiftDone(cluster.now(), "rollout:1", "down", {}))
    assert shifts.shifting == {"reward:1": "up"} and shifts.owner[1] == "reward:1"
    assert not shifts.recovering()
    assert coord.stats.engine_restarts == 1  # the GPUs' engine restarted, as reward:1's
    shifts.on_shift_done(ShiftDone(cluster.now(), "reward:1", "up", {}))
    shifts.activate_arrived()
    assert coord.idle() and "reward:1" in coord.schedulers["reward"].replicas
    assert "rollout:1" not in coord.schedulers["rollout"].replicas


def test_a_restart_superseded_while_it_comes_up_goes_down_again_once_up() -> None:
    coord, cluster = _serving("rollout:1")
    shifts = coord.shifts
    _die(coord, "rollout:1")
    shifts.on_shift_done(ShiftDone(cluster.now(), "rollout:1", "down", {}))
    assert shifts.shifting == {"rollout:1": "up"}  # the restart is under way
    shifts.request_up(["reward:1"])
    assert shifts.pending_up == ["reward:1"] and shifts.retiring == {"rollout:1"}
    shifts.on_shift_done(ShiftDone(cluster.now(), "rollout:1", "up", {}))
    shifts.activate_arrived()
    assert shifts.shifting == {"rollout:1": "down"}  # never served
    assert "rollout:1" not in coord.schedulers["rollout"].replicas
    shifts.on_shift_done(ShiftDone(cluster.now(), "rollout:1", "down", {}))
    assert shifts.shifting == {"reward:1": "up"} and not shifts.recovering()


def test_a_restarting_replica_asked_up_again_is_simply_left_to_its_restart() -> None:
    coord, cluster = _serving("rollout:1")
    shifts = coord.shifts
    _die(coord, "rollout:1")
    shifts.request_up(["rollout:1"])  # no error: its restart brings it up
    assert shifts.pending_up == [] and shifts.restarting == {"rollout:1"}
    shifts.on_shift_done(ShiftDone(cluster.now(), "rollout:1", "down", {}))
    shifts.on_shift_done(ShiftDone(cluster.now(), "rollout:1", "up", {}))
    shifts.activate_arrived()
    assert coord.idle() and "rollout:1" in coord.schedulers["rollout"].replicas


def test_a_shift_up_waiting_for_an_excluded_engines_gpus_is_dropped() -> None:
    coord, cluster = _serving("rollout:1")
    shifts = coord.shifts
    shifts.restart_window_s = 1e9
    shifts.died_at["rollout:1"] = -1.0  # it died before: this death excludes it
    _die(coord, "rollout:1")
    assert shifts.excluding == {"rollout:1"}
    shifts.request_up(["reward:1"])
    assert shifts.pending_up == ["reward:1"] and not shifts.chained  # no chain onto it
    shifts.on_shift_done(ShiftDone(cluster.now(), "rollout:1", "down", {}))
    assert shifts.pending_up == [] and not shifts.shifting and coord.idle()
    assert 1 not in coord.topology.roles["reward"].slots


@pytest.mark.parametrize("mode", ["pivot+", "colocated"])
def test_plans_and_stages_go_on_while_engines_restart(mode: str, capsys) -> None:
    """Deaths every few seconds with restarts longer than that: the planner plans (and
    colocated moves to its next stage) while restarts are in flight, instead of waiting
    for a moment with none, and every sample is still trained once."""
    modes = {
        "pivot+": ["deployment.mode=pivot", "planner.strategy=pivot+"],
        "colocated": ["deployment.mode=colocated"],
    }
    job, rec = _job(*modes[mode], *OFTEN, "sim.failures.restart_s=60")
    coord = job.coordinator
    during: list[bool] = []
    request_up = coord.shifts.request_up

    def spy(rids) -> None:
        rids = list(rids)
        if any(r not in coord.shifts.recovering() for r in rids):
            during.append(bool(coord.shifts.recovering()))
        request_up(rids)

    coord.shifts.request_up = spy
    job.run()
    assert coord.rl.version == 3 and sorted(rec.sample_ids) == list(range(3 * 12 * 4))
    assert coord.stats.engine_failures > 0
    assert any(during)  # some shift-ups were asked for while an engine restarted
    for role in ("rollout", "reward"):
        coord.schedulers[role].check_invariants()
    capsys.readouterr()


def test_a_training_engine_death_is_counted_and_a_second_within_the_window_stops_the_job(
    capsys,
) -> None:
    """`rl.trainer.process: child`: the training set replaces its trainer children
    itself; the coordinator counts the death and moves nothing. Training cannot be excluded: a second death
    within deployment.engine_restart_window_s stops the job, naming the rank."""
    coord, cluster = _serving("rollout:1")
    shifts = coord.shifts
    where = "training engine of rank 4"
    before = (dict(shifts.shifting), set(shifts.recovering()))
    shifts.on_failure(ReplicaFailed(cluster.now(), "training", "training", where, "killed"))
    assert (dict(shifts.shifting), set(shifts.recovering())) == before  # nothing moves
    assert coord.stats.engine_failures == 1 and coord.stats.engine_restarts == 1
    assert coord.stats.excluded == [] and shifts.died_at["training"] == cluster.now()
    assert f"pivot-hpc: {where}: killed" in capsys.readouterr().out
    shifts.on_failure(ReplicaFailed(cluster.now(), "training", "", where, "again"))
    assert (
        coord.stop_reason is not None
        and f"the {where} died 0s after the last training engine death" in coord.stop_reason
    )
    assert "saving a checkpoint to resume from" in capsys.readouterr().out
    assert coord.stats.engine_failures == 2 and coord.stats.engine_restarts == 2
