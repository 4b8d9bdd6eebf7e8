"""Beyond the paper: elastic training's data-parallel size (planner/elastic.py), pipeline
admission (scheduler/admission.py), pivot+'s re-prefill penalty and repayment wait, the
measured training time model."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pivot_hpc.coordinator.inference_rates import InferenceRates
from pivot_hpc.coordinator.monitor import MeasuredTrainingTime
from pivot_hpc.coordinator.shifts import ShiftExecutor
from pivot_hpc.planner import Snapshot, SnapshotError, Topology, TrainingState, replica_id
from pivot_hpc.planner.config import PlannerConfig, ShiftTimes
from pivot_hpc.planner.elastic import ElasticInputs, elastic_plan
from pivot_hpc.planner.pairs import penalty
from pivot_hpc.planner.plan import ShiftPlan
from pivot_hpc.planner.planner import PivotStrategy, make_strategy
from pivot_hpc.scheduler import Scheduler, SeqState, ThroughputModel
from pivot_hpc.scheduler.admission import PipelineAdmission

MODEL = ThroughputModel(A=1e-6, B=5e-3, C=2e-4, D=1e-3)


def topology(elastic: bool = True, prefill: float = 0.0, tau: float = 1.0) -> Topology:
    """16 GPUs; training owns 12-15 (tp 1), extension slots 0-11."""
    return Topology.build(
        num_gpus=16,
        gpus_per_node=8,
        tp={"rollout": 1, "reward": 1},
        kv_capacity={"rollout": 50_000, "reward": 50_000},
        models={"rollout": MODEL, "reward": MODEL},
        training_gpus=[12, 13, 14, 15],
        shift_time=ShiftTimes(rollout=tau, reward=tau, training=tau),
        elastic=elastic,
        prefill_s_per_token={"rollout": prefill, "reward": prefill},
    )


def snapshot(topo, rollout: int, reward: int, seqs: tuple[int, int], held=()) -> Snapshot:
    """`rollout` replicas on GPUs 0.., `reward` after them, `seqs` sequences each role."""
    scheds = {r: Scheduler(r) for r in ("rollout", "reward")}
    for g in range(rollout):
        scheds["rollout"].add_replica(replica_id("rollout", g), 50_000, MODEL)
    for g in range(rollout, rollout + reward):
        scheds["reward"].add_replica(replica_id("reward", g), 50_000, MODEL)
    sid = 0
    for role, n in zip(("rollout", "reward"), seqs, strict=True):
        for _ in range(n):
            scheds[role].submit(SeqState(sid, 300))
            sid += 1
        scheds[role].dispatch()
    training = TrainingState(active=True, busy=False, batch_ready=True, extensions=set(held))
    return Snapshot(topo, scheds, training)


def step_time(gpus: int) -> float:
    return 4.0 + 400.0 / gpus  # 104 s on the 4 training GPUs


def inputs(work: float) -> ElasticInputs:
    return ElasticInputs(step_time=step_time, reshard_s=2.0, work_tokens=work, value_rate=1000.0)


def test_topology_has_extension_slots_outside_training() -> None:
    topo = topology()
    assert sorted(topo.elastic) == list(range(12))
    assert topo.gpus_of("training:3") == (3,)
    assert not topology(elastic=False).elastic
    with pytest.raises(SnapshotError, match="not a training extension"):
        topo.gpus_of("training:13")


def test_idle_inference_gpus_are_lent_to_training() -> None:
    snap = snapshot(topology(), rollout=2, reward=2, seqs=(0, 0))
    plan = elastic_plan(snap, inputs(0.0), strategy="pivot")
    assert plan is not None and len(plan.up) == 12  # every slot: the idle replicas too
    assert sorted(plan.down) == ["reward:2", "reward:3", "rollout:0", "rollout:1"]
    assert plan.penalty == 0.0 and plan.benefit > 0


def test_busy_inference_keeps_its_gpus_when_it_is_the_longer_stage() -> None:
    snap = snapshot(topology(), rollout=6, reward=6, seqs=(600, 600))
    assert elastic_plan(snap, inputs(1e9), strategy="pivot") is None  # drains for days


def test_training_bound_takes_busy_gpus_when_the_step_is_the_longer_stage() -> None:
    snap = snapshot(topology(), rollout=6, reward=6, seqs=(12, 12))
    plan = elastic_plan(snap, inputs(100.0), strategy="pivot")  # little inference work
    assert plan is not None and plan.up and plan.benefit > 0
    assert plan.penalty == pytest.approx(penalty(snap, plan.down))


@pytest.mark.parametrize("tau", [0.1, 2.0])
def test_at_equal_benefit_training_grows_only_if_that_shortens_its_step(tau: float) -> None:
    """Inference drains for days whatever training holds, so every size has B = 0. Growing
    onto idle replicas' slots starts the step only once they are down and the new slots
    have read their state (the longer of R and the occupants' τ_shift): taken when that
    still shortens the step (it releases the next batch), not when it delays it."""
    snap = snapshot(topology(tau=tau), rollout=2, reward=2, seqs=(600, 0))

    def flat(gpus: int) -> float:
        return 10.0 + 4.0 / gpus  # 11 s on the 4 training GPUs, 10.25 s on 16

    work = ElasticInputs(step_time=flat, reshard_s=tau, work_tokens=1e12, value_rate=1e3)
    plan = elastic_plan(snap, work, strategy="pivot")
    if tau < 1.0:  # 10.25 + 0.1 < 11: the step ends sooner on every GPU it can take
        assert plan is not None and plan.benefit == 0 and "training:2" in plan.up
    else:  # 10.25 + 2 > 11: the step would end later
        assert plan is None


def test_held_extensions_go_back_to_a_starved_role() -> None:
    """Training holds GPUs 0-11, rollout has 600 queued sequences and no replica: the step
    would leave the work waiting, so extensions are given back."""
    held = [replica_id("training", s) for s in range(12)]
    snap = snapshot(topology(), rollout=0, reward=0, seqs=(600, 0), held=held)
    plan = elastic_plan(snap, inputs(600 * 300.0), strategy="pivot")
    assert plan is not None and not plan.up and plan.down
    assert set(plan.down) <= set(held)


def test_released_work_drains_as_a_pool_not_on_todays_replicas() -> None:
    """At a batch's release pivot+ has just moved every replica to the GenRM, so the
    rollout work has no replica: a replay of today's replicas drains it never, every
    size's makespan is unbounded and training never grows (the flaw issue 39 found). With
    the measured GPU-seconds the work needs, it drains on the GPUs inference keeps: 600
    GPU-s over 12 GPUs is 50 s against a 104 s step, so training grows to where both
    stages meet (7 replicas: 63 s step beside 600/9 = 67 s of inference)."""
    snap = snapshot(topology(), rollout=0, reward=12, seqs=(64, 0))
    work = 64 * 1000.0
    assert elastic_plan(snap, inputs(work), strategy="pivot") is None  # the replay: never
    pooled = dataclasses.replace(inputs(work), inference_gpu_s=600.0)
    plan = elastic_plan(snap, pooled, strategy="pivot")
    assert plan is not None and len(plan.up) == 3 and plan.benefit > 0
    assert all(d.startswith("reward:") for d in plan.down) and plan.penalty == 0.0


def test_inference_rates_count_gpu_seconds_while_a_role_has_work() -> None:
    topo = topology()
    scheds = {r: Scheduler(r) for r in ("rollout", "reward")}
    for g in range(4):
        scheds["rollout"].add_replica(replica_id("rollout", g), 50_000, MODEL)
    scheds["reward"].add_replica(replica_id("reward", 4), 50_000, MODEL)
    rates = InferenceRates()
    rates.advance(0.0, scheds, topo)
    scheds["rollout"].submit(SeqState(0, 300))
    rates.advance(10.0, scheds, topo)  # rollout: 4 GPUs x 10 s; reward had no work
    rates.finished("rollout", 800)
    assert rates.gpu_s == {"rollout": 40.0, "reward": 0.0}
    assert rates.per_gpu_s("rollout") == 20.0 and rates.per_gpu_s("reward") is None
    assert rates.gpu_seconds({"rollout": 400.0, "reward": 0.0}) == 20.0
    assert rates.gpu_seconds({"rollout": 400.0, "reward": 10.0}) is None  # not measured


def test_no_model_no_decision() -> None:
    snap = snapshot(topology(), rollout=2, reward=2, seqs=(0, 0))
    none = ElasticInputs(step_time=None, reshard_s=2.0, work_tokens=0.0, value_rate=1.0)
    assert elastic_plan(snap, none, strategy="pivot") is None


def test_pipeline_admission_limit() -> None:
    adm = PipelineAdmission(staleness=2, batch_size=100)
    assert adm.concurrency("rollout") == 0  # nothing finished: no cap
    for n in (100, 100, 400):
        adm.observe("rollout", n)
    # (s+1) × batch × mean/longest = 3 × 100 × 200/400
    assert adm.concurrency("rollout") == 150
    assert adm.replica_limit("rollout", slots=16) == math.ceil(150 / 16)


def test_replica_limit_caps_dispatch_and_keeps_priority_order() -> None:
    s = Scheduler("rollout")
    for g in range(2):
        # B = 0: every sequence lengthens an iteration, so the limit applies as set
        s.add_replica(replica_id("rollout", g), 10**6, ThroughputModel(1e-6, 0.0, 2e-4, 1e-3))
    for i in range(10):
        s.submit(SeqState(i, 100))
    s.replica_limit = 3
    placed = s.dispatch()
    assert len(placed) == 6 and {sid for sid, _ in placed} == set(range(6))  # oldest first
    assert [q.seq_id for q in s.queued()] == [6, 7, 8, 9]
    s.replica_limit = 0
    assert len(s.dispatch()) == 4


@pytest.mark.parametrize(
    ("b", "c", "cap"),
    [(5e-3, 2e-4, 25), (5e-3, 0.0, 40), (0.0, 2e-4, 3)],  # knee ⌈B/C⌉; never compute-bound; MoE
)
def test_replica_limit_never_caps_below_the_models_knee(b: float, c: float, cap: int) -> None:
    """Below ⌈B/C⌉ running sequences an iteration streams the weights whatever their
    number: a pipeline limit there would only make sequences wait. The engine's own cap
    still holds."""
    s = Scheduler("rollout")
    s.add_replica("rollout:0", 10**6, ThroughputModel(1e-6, b, c, 1e-3, max_running=40))
    for i in range(60):
        s.submit(SeqState(i, 100))
    s.replica_limit = 3
    placed = s.dispatch()
    assert [sid for sid, _ in placed] == list(range(cap))
    # a refitted model moves the knee with it
    s.set_model(ThroughputModel(1e-6, 0.0, 2e-4, 1e-3, max_running=40))
    assert s.dispatch() == []  # already above the new limit of 3


def test_pivot_plus_counts_the_re_prefill_of_what_it_migrates() -> None:
    """Same snapshot: pivot's φ is τ_shift·T of the replicas it takes down; pivot+ adds the
    re-prefill of their sequences' contexts, and with an expensive prefill shifts less."""
    snaps = {}
    for prefill in (0.0, 1e-2):
        snaps[prefill] = snapshot(topology(elastic=False, prefill=prefill), 3, 9, (400, 40))
        snaps[prefill].training = TrainingState(active=True, busy=True)
    base = PivotStrategy(PlannerConfig()).plan(snaps[0.0])
    assert not base.is_noop
    plus = PivotStrategy(PlannerConfig(), name="pivot+", reprefill=True)
    same = plus.plan(snaps[0.0])
    assert same.up == base.up and same.penalty == pytest.approx(base.penalty)
    costly = plus.plan(snaps[1e-2])
    ev = {e.k: e for e in costly.candidates}
    first = ev[min(ev)]
    assert first.penalty > penalty(snaps[1e-2], first.down)  # re-prefill counted
    assert len(costly.up) < len(base.up)


def test_pivot_plus_waits_until_a_plan_has_repaid_before_moving_gpus_back() -> None:
    """A plan that moved GPUs from reward to rollout has not repaid its φ yet: pivot+ does
    not take GPUs from rollout for reward (it would undo a shift that has not paid); the
    paper's pivot does not look."""
    snap = snapshot(topology(elastic=False), 9, 3, (40, 400))
    snap.training = TrainingState(active=True, busy=True)
    pivot = PivotStrategy(PlannerConfig()).plan(snap)
    plus = PivotStrategy(PlannerConfig(), name="pivot+", reprefill=True, wait_repayment=True)
    assert pivot.up_role == "reward" and pivot.down and plus.plan(snap).down
    waiting = dataclasses.replace(snap, unrepaid=frozenset({("reward", "rollout")}))
    assert PivotStrategy(PlannerConfig()).plan(waiting).down == pivot.down
    assert plus.plan(waiting).is_noop
    # the other direction is not held back
    other = dataclasses.replace(snap, unrepaid=frozenset({("rollout", "reward")}))
    assert plus.plan(other).down


@pytest.mark.parametrize("name", ["pivot", "pivot+"])
def test_training_holding_every_gpu_gives_them_back_when_both_roles_wait(name) -> None:
    """After an elastic step on all 16 GPUs both roles have work and no replica: Eq. 1 is 0
    whatever one role gets, so the planner values a candidate by what the chosen role would
    make (before, no benefit was ever positive and the run stalled)."""
    held = [replica_id("training", s) for s in range(12)]
    snap = snapshot(topology(), 0, 0, (50, 5), held=held)
    snap.training = TrainingState(active=True, extensions=set(held))
    plan = PivotStrategy(PlannerConfig(), name=name, reprefill=name == "pivot+").plan(snap)
    assert plan.up_role == "reward" and plan.up and plan.benefit > 0
    assert {d.split(":")[0] for d in plan.down} == {"training"}


def test_pivot_plus_keeps_the_last_reward_replica_while_rollouts_run() -> None:
    """Reward idle on its one replica, rollout busy: the paper's pivot takes that replica
    for rollout at φ = 0 and must buy it back as soon as judgements arrive (Eq. 1 is 0
    with work and no reward replica); pivot+ leaves it, and takes free GPUs only."""
    snap = snapshot(topology(elastic=False), 11, 1, (400, 0))
    snap.training = TrainingState(active=True, busy=True)
    pivot = PivotStrategy(PlannerConfig()).plan(snap)
    assert pivot.up_role == "rollout" and "reward:11" in pivot.down
    plus = make_strategy(PlannerConfig(strategy="pivot+"))
    assert plus.plan(snap).is_noop
    snap = snapshot(topology(elastic=False), 10, 2, (400, 0))  # two: one may go
    snap.training = TrainingState(active=True, busy=True)
    assert plus.plan(snap).down == ["reward:11"]


def test_pivot_plus_keeps_a_reward_replica_without_stalling_a_starved_rollout() -> None:
    """Rollout has work and no replica; reward's one replica idles on GPU 9, whose pair (at
    φ = 0, like the free GPUs and idle training) wins Alg. 1's ties for every k. pivot+
    keeps that replica and still gives rollout the free GPUs (it used to reject every
    candidate, all of which took it, and the run stalled with GPUs idle)."""
    snap = snapshot(topology(elastic=False), 0, 0, (400, 0))
    snap.schedulers["reward"].add_replica(replica_id("reward", 9), 50_000, MODEL)
    snap.training = TrainingState(active=True)
    plan = make_strategy(PlannerConfig(strategy="pivot+")).plan(snap)
    assert plan.up_role == "rollout" and plan.benefit > 0
    assert "reward:9" not in plan.down and "rollout:9" not in plan.up


def test_a_plan_is_repaid_at_its_break_even() -> None:
    """φ / (T_expected − T_current) after the decision; free and mandatory plans hold
    nothing back."""
    clock = SimpleNamespace(t=100.0)
    shifts = ShiftExecutor(SimpleNamespace(cluster=SimpleNamespace(now=lambda: clock.t)), None)
    plan = ShiftPlan(
        "pivot+",
        up_role="reward",
        up=["reward:3"],
        down=["rollout:3", "training"],
        penalty=500.0,
        throughput_current=1000.0,
        throughput_expected=1050.0,
    )
    shifts._note_repayment(plan)
    assert shifts.unrepaid() == {("rollout", "reward"), ("training", "reward")}
    clock.t = 109.9
    assert shifts.unrepaid()
    clock.t = 110.0  # 500 tokens at +50 tokens/s
    assert not shifts.unrepaid()
    for free in (
        dataclasses.replace(plan, penalty=0.0),
        dataclasses.replace(plan, throughput_expected=990.0),
        dataclasses.replace(plan, mandatory=True),
    ):
        shifts._note_repayment(free)
        assert not shifts.unrepaid()


@settings(max_examples=40, deadline=None)
@given(
    rollout=st.integers(0, 6),
    reward=st.integers(0, 6),
    seqs=st.tuples(st.integers(0, 300), st.integers(0, 300)),
    held=st.integers(0, 4),
    work=st.sampled_from([0.0, 1e3, 1e5, 1e7, math.inf]),
    tau=st.floats(0.01, 30.0),
)
def test_elastic_never_pays_more_than_it_gains(rollout, reward, seqs, held, work, tau) -> None:
    """Whatever the snapshot, an elastic plan's benefit (makespan saved at T_ref, minus the
    penalty at the measured τ_shift) is not negative, and its penalty is the occupants'."""
    assume(rollout + reward + held <= 12)  # held extensions sit on GPUs 12-held..11
    held_ids = [replica_id("training", s) for s in range(12 - held, 12)]
    snap = snapshot(topology(tau=tau), rollout, reward, seqs, held=held_ids)
    plan = elastic_plan(snap, inputs(work), strategy="pivot")
    if plan is None:
        return
    assert plan.benefit >= 0
    assert plan.penalty == pytest.approx(
        penalty(snap, [d for d in plan.down if "training" not in d])
    )


def test_measured_training_time_fits_fixed_plus_data_parallel_part() -> None:
    m = MeasuredTrainingTime()
    assert not m.ready()
    m.observe([100] * 10, 1, 2.0 + 1000 * 1e-3)
    assert m.ready() and m.step_time([100] * 10, 2) == pytest.approx(1.5)  # ideal until seen
    m.observe([100] * 10, 2, 2.0 + 500 * 1e-3)
    m.observe([100] * 20, 4, 2.0 + 500 * 1e-3)
    assert m.step_time([100] * 10, 4) == pytest.approx(2.0 + 250 * 1e-3)
