"""The planner counts trajectories parked on a tool call as rollout demand when they are
due back within its horizon, and not when they are due later (issue 37 §3): long tool
waits let rollout GPUs serve the GenRM meanwhile; short ones keep them for the next turn."""

from __future__ import annotations

from pivot_hpc.config.schema import PlannerConfig
from pivot_hpc.coordinator.turns import Parked, ToolStats, TurnLoop
from pivot_hpc.planner import Snapshot, Topology, TrainingState, replica_id, role_of
from pivot_hpc.planner.planner import make_strategy
from pivot_hpc.scheduler import Scheduler, SeqState, ThroughputModel

MODEL = ThroughputModel(A=1e-6, B=5e-3, C=2e-4, D=1e-3)


def snapshot(parked_due: dict[str, int]) -> Snapshot:
    """Rollout holds GPUs 0-5 with every trajectory parked (no sequence); the GenRM holds
    6-11 with 600 judgements queued; training (12-15) is busy."""
    topo = Topology.build(
        num_gpus=16,
        gpus_per_node=8,
        tp={"rollout": 1, "reward": 1},
        kv_capacity={"rollout": 50_000, "reward": 50_000},
        models={"rollout": MODEL, "reward": MODEL},
        training_gpus=[12, 13, 14, 15],
    )
    scheds = {r: Scheduler(r) for r in ("rollout", "reward")}
    for g in range(6):
        scheds["rollout"].add_replica(replica_id("rollout", g), 50_000, MODEL)
        scheds["reward"].add_replica(replica_id("reward", g + 6), 50_000, MODEL)
    for i in range(600):
        scheds["reward"].submit(SeqState(i, 400))
    scheds["reward"].dispatch()
    training = TrainingState(active=True, busy=True)
    return Snapshot(topo, scheds, training, parked_due=parked_due)


def test_parked_trajectories_due_within_h_are_rollout_demand() -> None:
    assert snapshot({}).n_seq("rollout") == 0
    assert snapshot({"rollout": 48}).n_seq("rollout") == 48


def test_gpus_go_to_the_genrm_while_calls_are_long_and_stay_while_they_are_due() -> None:
    strategy = make_strategy(PlannerConfig(strategy="pivot+"))
    away = strategy.plan(snapshot({}))  # every call due after H: rollout has no demand
    assert away.up_role == "reward" and away.down
    assert all(role_of(r) == "rollout" for r in away.down)
    due = strategy.plan(snapshot({"rollout": 48}))  # 48 turns due back within H
    assert not any(role_of(r) == "rollout" for r in due.down)


def test_due_within_uses_each_tools_measured_wait() -> None:
    loop = TurnLoop.__new__(TurnLoop)  # (only its parked calls and measured waits)
    loop._waits = {"slow": (300.0, 1), "fast": (2.0, 2)}
    loop.stats = ToolStats()
    loop.parked = {
        0: Parked(None, since=100.0, tool="slow", rid=""),  # back at ~400 s
        1: Parked(None, since=100.0, tool="fast", rid=""),  # back at ~101 s
        2: Parked(None, since=100.0, tool="new", rid=""),  # no measurement: due at once
    }
    assert loop.due_within(now=110.0, horizon_s=60.0) == 2
    assert loop.due_within(now=350.0, horizon_s=60.0) == 3
