"""pivot+ training pre-warm (planner/prewarm.py): training shifts up in its batch's tail
when its GPUs idle, lending idle training costs its return, and a starving role is not
held back by the repayment wait."""

from __future__ import annotations

import dataclasses

import pytest

from pivot_hpc.planner import Snapshot, Topology, TrainingState, replica_id
from pivot_hpc.planner.config import PlannerConfig
from pivot_hpc.planner.pairs import shift_pairs
from pivot_hpc.planner.planner import PivotStrategy, current_throughput, make_strategy
from pivot_hpc.planner.prewarm import prewarm_plan, training_return
from pivot_hpc.scheduler import Scheduler, SeqState
from tests.unit.test_elastic import MODEL
from tests.unit.test_elastic import topology as elastic_topology

TRAINING_GPUS = [12, 13, 14, 15]  # (tests/unit/test_elastic.py's topology)
TAU = 3.0


def topology(prefill: float = 0.0) -> Topology:
    """16 GPUs, 1-GPU replica slots; training owns GPUs 12-15; τ_shift TAU for every role."""
    return elastic_topology(elastic=False, prefill=prefill, tau=TAU)


def tail(
    *,
    running: dict[int, int],
    queued_rollouts: int = 0,
    prefill: float = 0.0,
    training: TrainingState | None = None,
) -> Snapshot:
    """A batch's tail: reward replicas on every GPU (none on training's while it is up),
    `running[g]` judgements on GPU g's replica, `queued_rollouts` rollouts waiting with no
    rollout replica. By default training is down and its batch in flight."""
    training = training or TrainingState(batch_pending=True)
    scheds = {r: Scheduler(r) for r in ("rollout", "reward")}
    gpus = [g for g in range(16) if not (training.active and g in TRAINING_GPUS)]
    for g in gpus:
        scheds["reward"].add_replica(replica_id("reward", g), 50_000, MODEL)
    sid = 0
    for g, n in running.items():
        for _ in range(n):
            scheds["reward"].submit(SeqState(sid, 2000))
            sid += 1
        scheds["reward"].dispatch([replica_id("reward", g)])
    for _ in range(queued_rollouts):
        scheds["rollout"].submit(SeqState(sid, 300))
        sid += 1
    return Snapshot(topology(prefill), scheds, training)


def plus() -> PivotStrategy:
    return make_strategy(PlannerConfig(strategy="pivot+"))


@pytest.mark.parametrize("where", [0, 13])  # the tail's judgement off or on training's GPUs
def test_training_comes_up_in_its_batchs_tail(where: int) -> None:
    snap = tail(running={where: 1})
    plan = plus().plan(snap)
    assert plan.up == ["training"] and not plan.mandatory
    assert plan.down == [replica_id("reward", g) for g in TRAINING_GPUS]
    assert "pre-warm" in plan.reason
    # the paper's planner waits for the batch: its GPUs stay with reward meanwhile
    assert "training" not in PivotStrategy(PlannerConfig()).plan(snap).up


def test_no_prewarm_while_work_waits_or_a_busy_tail_cannot_move() -> None:
    cases = {
        "queued work": tail(running={0: 1}, queued_rollouts=8),
        # every replica busy: training's GPUs' judgements would crowd others
        "no idle replica to move to": tail(running=dict.fromkeys(range(16), 2)),
        # its re-prefill would cost the tail more than the reload hides
        "costly re-prefill": tail(running={13: 1}, prefill=TAU / 1000),
        "batch ready": tail(running={}, training=TrainingState(batch_ready=True)),
        "no batch in flight": tail(running={0: 1}, training=TrainingState()),
        # a plan lent training's GPUs to reward and has not repaid its penalty yet
        "lent, not repaid": dataclasses.replace(
            tail(running={0: 1}), unrepaid=frozenset({("training", "reward")})
        ),
    }
    for why, snap in cases.items():
        occ = snap.validate()
        t = current_throughput(snap)
        assert prewarm_plan(snap, occ, "pivot+", t) is None, why
    # a cheap re-prefill of the same sequence is fine
    snap = tail(running={13: 1}, prefill=TAU / 4000)
    assert prewarm_plan(snap, snap.validate(), "pivot+", current_throughput(snap)) is not None


def test_lending_idle_training_costs_its_return_while_its_batch_is_in_flight() -> None:
    """Pre-warmed training idles on its GPUs; a rollout queue appears. A pair taking its
    GPUs pays τ_shift(training) at the tokens/s inference makes now on top of φ (even
    while Eq. 1 is 0: rollout has work and no replica)."""
    up = TrainingState(active=True, batch_pending=True)
    snap = tail(running={0: 1, 1: 1}, queued_rollouts=50, training=up)
    occ = snap.validate()
    ret = training_return(snap)
    making = snap.throughput("reward")
    assert current_throughput(snap) == 0 and making > 0
    assert ret == pytest.approx(TAU * making)
    plain = {tuple(p.up): p.penalty for p in shift_pairs(snap, "rollout", occ)}
    costly = {
        tuple(p.up): p.penalty for p in shift_pairs(snap, "rollout", occ, training_return=ret)
    }
    takes_training = tuple(replica_id("rollout", g) for g in TRAINING_GPUS)
    assert costly[takes_training] == pytest.approx(plain[takes_training] + ret)
    assert all(costly[k] == plain[k] for k in plain if k != takes_training)
    # no return once the batch is ready (training runs it) or when none is in flight
    for state in (TrainingState(active=True, batch_ready=True), TrainingState(active=True)):
        assert training_return(dataclasses.replace(snap, training=state)) == 0.0


def test_a_starving_role_is_not_held_back_by_the_repayment_wait() -> None:
    """A plan of small gain moved GPUs from rollout to reward and repays slowly; then a new
    batch queues rollouts with no rollout replica. pivot+ takes the idle reward GPUs back
    at once (it waited, with Eq. 1 at 0 and the GPUs idle)."""
    snap = tail(running={0: 1}, queued_rollouts=50, training=TrainingState(active=True, busy=True))
    waiting = dataclasses.replace(snap, unrepaid=frozenset({("rollout", "reward")}))
    plan = plus().plan(waiting)
    assert plan.up_role == "rollout" and plan.up and plan.benefit > 0
    # while rollout still has a replica, the wait holds as before
    waiting.schedulers["reward"].remove_replica(replica_id("reward", 11))
    waiting.schedulers["rollout"].add_replica(replica_id("rollout", 11), 50_000, MODEL)
    occ = waiting.validate()
    assert shift_pairs(waiting, "rollout", occ)
    assert not shift_pairs(waiting, "rollout", occ, wait_repayment=True)
