"""The planner's five steps (§7.1) on the worked example of Figure 8, and its strategies."""

from __future__ import annotations

import pytest

from pivot_hpc.planner import (
    Snapshot,
    SnapshotError,
    Topology,
    TrainingState,
    make_strategy,
    overall_throughput,
    replica_id,
)
from pivot_hpc.planner.config import PlannerConfig, ShiftTimes
from pivot_hpc.planner.pairs import shift_pairs
from pivot_hpc.planner.planner import PivotStrategy, latency_tau, search_candidates
from pivot_hpc.scheduler import BusyModel, Scheduler, SeqState, ThroughputModel

# Figure 8: 32 GPUs; reward replicas of 4 GPUs (16 GPUs, N=385, T≈4752), rollout replicas
# of 1 GPU (8 GPUs, N=59, T≈2077), training holds 8 GPUs and its batch is not ready.
REWARD_LAT = 200 / 4752  # 4 replicas × 50 running sequences of 100 tokens
ROLLOUT_LAT = 59 / 2077
REWARD_MODEL = ThroughputModel(A=1e-9, B=REWARD_LAT - 1e-3, C=0.0, D=1e-3)
ROLLOUT_MODEL = ThroughputModel(A=1e-9, B=ROLLOUT_LAT - 1e-3, C=0.0, D=1e-3)


def topology(vanilla: bool = False) -> Topology:
    return Topology.build(
        num_gpus=32,
        gpus_per_node=8,
        tp={"rollout": 1, "reward": 4},
        kv_capacity={"rollout": 100_000, "reward": 5000},
        models={
            "rollout": BusyModel() if vanilla else ROLLOUT_MODEL,
            "reward": BusyModel() if vanilla else REWARD_MODEL,
        },
        training_gpus=list(range(24, 32)),
        shift_time=ShiftTimes(rollout=2.0, reward=2.0, training=5.0),
    )


def figure8(training: TrainingState | None = None, vanilla: bool = False) -> Snapshot:
    topo = topology(vanilla)
    rollout, reward = Scheduler("rollout"), Scheduler("reward")
    for g in range(16, 24):
        rollout.add_replica(replica_id("rollout", g), 100_000, topo.roles["rollout"].model)
    for b in range(4):
        reward.add_replica(replica_id("reward", b), 5000, topo.roles["reward"].model)
    for i in range(59):
        rollout.submit(SeqState(i, 100))
    for i in range(385):
        reward.submit(SeqState(1000 + i, 100))
    rollout.dispatch()
    reward.dispatch()
    return Snapshot(
        topo,
        {"rollout": rollout, "reward": reward},
        training or TrainingState(active=True, busy=False, batch_ready=False),
    )


def gpus_by_role(snap: Snapshot, plan) -> dict[str, int]:
    count = {"rollout": 0, "reward": 0, "training": 0}
    for role in ("rollout", "reward"):
        count[role] = len(snap.schedulers[role].replicas) * snap.topology.roles[role].tp
    if snap.training.active:
        count["training"] = len(snap.topology.training_gpus)
    for rid in plan.down:
        role = rid.split(":")[0]
        count[role] -= len(snap.topology.gpus_of(rid))
    for rid in plan.up:
        role = rid.split(":")[0]
        count[role] += len(snap.topology.gpus_of(rid))
    return count


def test_figure8_role_choice_from_its_numbers() -> None:
    snap = figure8()
    assert snap.throughput("reward") == pytest.approx(4752, rel=1e-3)
    assert snap.throughput("rollout") == pytest.approx(2077, rel=1e-3)
    assert latency_tau(385, 4752) == pytest.approx(0.081, abs=1e-3)
    assert latency_tau(59, 2077) == pytest.approx(0.028, abs=1e-3)
    assert PivotStrategy(PlannerConfig()).choose_role(snap) == "reward"


def test_figure8_shift_pairs() -> None:
    snap = figure8()
    pairs = shift_pairs(snap, "reward", snap.validate())
    assert len(pairs) == 3
    train, ro_a, ro_b = pairs
    assert train.up == ["reward:6", "reward:7"] and train.down == ["training"]
    assert train.penalty == 0.0
    assert ro_a.penalty <= ro_b.penalty and ro_a.penalty > 0
    assert sorted([ro_a.up, ro_b.up]) == [["reward:4"], ["reward:5"]]
    for p in (ro_a, ro_b):
        slot = int(p.up[0].split(":")[1])
        assert p.down == sorted(replica_id("rollout", g) for g in range(4 * slot, 4 * slot + 4))
        tau = snap.topology.tau("rollout")
        t = sum(snap.schedulers["rollout"].replica(r).T for r in p.down)
        assert p.penalty == pytest.approx(tau * t)


def test_figure8_plan_picks_four_rollout_gpus_to_reward() -> None:
    snap = figure8()
    plan = PivotStrategy(PlannerConfig(horizon_s=60)).plan(snap)
    assert plan.up_role == "reward" and not plan.is_noop
    assert [c.k for c in plan.candidates] == [1, 2, 3, 4]
    # As in Figure 8: the chosen plan leaves rollout 4, reward 28, training 0 GPUs; the
    # candidate that removes all rollout has a negative benefit.
    assert gpus_by_role(snap, plan) == {"rollout": 4, "reward": 28, "training": 0}
    assert plan.candidates[-1].benefit < 0
    assert plan.benefit == max(c.benefit for c in plan.candidates) > 0
    assert plan.throughput_expected > plan.throughput_current
    t = plan.timings
    assert t.total_s == pytest.approx(t.preprocess_s + t.construct_s + t.simulate_s)
    # The planner only reads the snapshot.
    assert len(snap.schedulers["reward"].replicas) == 4
    assert snap.schedulers["reward"].n_queued == 185


def test_horizon_zero_means_no_shift_and_larger_h_shifts_more() -> None:
    shifted = []
    for h in (0.0, 0.01, 1.0, 60.0, 6000.0):
        snap = figure8()
        plan = PivotStrategy(PlannerConfig(horizon_s=h)).plan(snap)
        shifted.append(len(plan.up))
    assert shifted[0] == 0
    assert shifted == sorted(shifted)
    assert shifted[-1] > shifted[1]


def test_no_positive_candidate_means_no_shift() -> None:
    snap = figure8()
    # Reward has no queue, so extra reward replicas only win by migration, which a
    # near-linear model makes worth almost nothing; training is busy, so every
    # candidate frees rollout GPUs and pays a penalty.
    for seq in list(snap.schedulers["reward"].queued()):
        snap.schedulers["reward"].cancel(seq.seq_id)
    snap.training.busy = True
    plan = PivotStrategy(PlannerConfig()).plan(snap)
    assert plan.is_noop and plan.reason


def test_training_ready_always_wins() -> None:
    topo = topology()
    rollout, reward = Scheduler("rollout"), Scheduler("reward")
    for g in range(8, 32):
        rollout.add_replica(replica_id("rollout", g), 100_000, ROLLOUT_MODEL)
    reward.add_replica("reward:0", 5000, REWARD_MODEL)
    reward.add_replica("reward:1", 5000, REWARD_MODEL)
    for i in range(200):
        rollout.submit(SeqState(i, 100))
    for i in range(300):
        reward.submit(SeqState(1000 + i, 100))
    rollout.dispatch()
    reward.dispatch()
    snap = Snapshot(
        topo, {"rollout": rollout, "reward": reward}, TrainingState(active=False, batch_ready=True)
    )
    for strategy in ("pivot", "static", "rule", "vanilla"):
        plan = make_strategy(PlannerConfig(strategy=strategy)).plan(snap)
        assert plan.mandatory and plan.up == ["training"], strategy
        assert plan.down == sorted(replica_id("rollout", g) for g in range(24, 32))
        assert plan.benefit < 0  # Eq. 1 sees only the loss; training is still needed


def test_training_busy_blocks_its_gpus() -> None:
    snap = figure8(TrainingState(active=True, busy=True, batch_ready=False))
    pairs = shift_pairs(snap, "reward", snap.validate())
    assert all("training" not in p.down for p in pairs)


def test_static_strategy_splits_idle_training_gpus() -> None:
    snap = figure8()
    plan = make_strategy(PlannerConfig(strategy="static")).plan(snap)
    assert plan.down == ["training"]
    assert sorted(plan.up) == sorted(
        [replica_id("rollout", g) for g in range(24, 28)] + ["reward:7"]
    )
    idle = figure8(TrainingState(active=False))
    assert make_strategy(PlannerConfig(strategy="static")).plan(idle).is_noop


def test_rule_strategy_reacts_to_kv_utilisation() -> None:
    snap = figure8()  # reward KV is full (util 1.0 > 0.8), training idle
    plan = make_strategy(PlannerConfig(strategy="rule")).plan(snap)
    assert plan.up_role == "reward" and len(plan.up) == 1 and plan.down == ["training"]


def test_vanilla_uses_busy_model_without_migration() -> None:
    snap = figure8(vanilla=True)
    plan = make_strategy(PlannerConfig(strategy="vanilla")).plan(snap)
    assert plan.strategy == "vanilla"
    assert all(c.throughput >= 0 for c in plan.candidates)


def test_bad_snapshots_raise_clear_errors() -> None:
    topo = topology()
    ro, rm = Scheduler("rollout"), Scheduler("reward")
    ro.add_replica("rollout:1", 10, ROLLOUT_MODEL)
    rm.add_replica("reward:0", 10, REWARD_MODEL)  # GPUs 0-3 overlap rollout:1
    with pytest.raises(SnapshotError, match="GPU 1 is held by both"):
        Snapshot(topo, {"rollout": ro, "reward": rm}).validate()
    ro2 = Scheduler("rollout")
    ro2.add_replica("rollout:25", 10, ROLLOUT_MODEL)
    with pytest.raises(SnapshotError, match="held by both 'rollout:25' and 'training'"):
        Snapshot(
            topo, {"rollout": ro2, "reward": Scheduler("reward")}, TrainingState(active=True)
        ).validate()
    with pytest.raises(SnapshotError, match="busy"):
        Snapshot(
            topo,
            {"rollout": Scheduler("rollout"), "reward": Scheduler("reward")},
            TrainingState(active=False, busy=True),
        ).validate()
    wrong = Scheduler("reward")
    wrong.add_replica("rollout:0", 10, REWARD_MODEL)
    with pytest.raises(SnapshotError, match="listed under role 'reward'"):
        Snapshot(topo, {"rollout": Scheduler("rollout"), "reward": wrong}).validate()
    with pytest.raises(SnapshotError, match="not a set"):
        Topology.build(
            num_gpus=8,
            gpus_per_node=8,
            tp={"rollout": 1, "reward": 4},
            kv_capacity={"rollout": 1, "reward": 1},
            models={"rollout": ROLLOUT_MODEL, "reward": REWARD_MODEL},
            training_gpus=[6, 6],
        )
    with pytest.raises(SnapshotError, match="must divide"):
        Topology.build(
            num_gpus=8,
            gpus_per_node=8,
            tp={"rollout": 3, "reward": 4},
            kv_capacity={"rollout": 1, "reward": 1},
            models={"rollout": ROLLOUT_MODEL, "reward": REWARD_MODEL},
            training_gpus=[7],
        )


def test_eq1_overall_throughput() -> None:
    assert overall_throughput(0, 0.0, 0, 0.0) == 0.0
    assert overall_throughput(10, 0.0, 10, 5.0) == 0.0  # rollout stalled
    assert overall_throughput(0, 0.0, 10, 5.0) == pytest.approx(5.0)
    assert overall_throughput(59, 2077, 385, 4752) == pytest.approx(444 / (59 / 2077 + 385 / 4752))


def test_coarse_to_fine_search() -> None:
    seen: list[int] = []

    def bump(i: int) -> float:
        seen.append(i)
        return -((i - 137) ** 2)

    search_candidates(400, bump, max_exact=64)
    assert 137 in seen and len(seen) < 60
    seen.clear()
    search_candidates(20, bump, max_exact=64)
    assert seen == list(range(20))
