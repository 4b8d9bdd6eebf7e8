"""The planner counts trajectories parked on a tool call as rollout demand when they are
due back within its horizon, and not when they are due later (issue 37 §3): long tool
waits let rollout GPUs serve the GenRM meanwhile; short ones keep them for the next turn."""

from __future__ import annotations

import pytest

from pivot_hpc.coordinator.tool_waits import WINDOW, ToolWaits
from pivot_hpc.coordinator.turns import Parked, TurnLoop
from pivot_hpc.planner import Snapshot, Topology, TrainingState, replica_id, role_of
from pivot_hpc.planner.config import PlannerConfig
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


def loop_with(waits: dict[str, list[float]], parked: dict[int, Parked]) -> TurnLoop:
    loop = TurnLoop.__new__(TurnLoop)  # (only its parked calls and measured waits)
    loop.waits = ToolWaits()
    for tool, ws in waits.items():
        for w in ws:
            loop.waits.add(tool, w)
    loop.parked = parked
    return loop


def test_due_within_uses_each_tools_measured_wait() -> None:
    loop = loop_with(
        {"slow": [300.0], "fast": [1.0, 3.0]},
        {
            0: Parked(None, since=100.0, tool="slow", rid=""),  # back at ~400 s
            1: Parked(None, since=100.0, tool="fast", rid=""),  # back at ~102 s
            2: Parked(None, since=100.0, tool="new", rid=""),  # pooled answers: ~201 s
        },
    )
    assert loop.due_within(now=100.0, horizon_s=60.0) == 1  # "fast"
    assert loop.due_within(now=350.0, horizon_s=60.0) == 2  # "slow" and "new": 50 s left
    # "fast" waited 250 s, 247 s past its longest answer: not due


def test_before_any_answer_every_call_is_due_at_once() -> None:
    loop = loop_with({}, {0: Parked(None, since=0.0, tool="t", rid="")})
    assert loop.due_within(now=500.0, horizon_s=0.0) == 1


def test_a_call_that_outlived_its_tools_answers_is_not_due_forever() -> None:
    """Bimodal waits (fast 1–2 s, slow ~200 s): the remaining wait is conditional on the
    time waited. A call past the fast mode is expected to be slow; a call older than every
    answer seen is expected to take as long again, not to be due at once (a mean would
    count it due from its age on, and keep rollout GPUs for it); past the longest answer,
    by as much again as it is past it."""
    waits = {"search": [1.0, 1.5, 2.0, 1.2, 180.0, 220.0]}
    parked = {0: Parked(None, since=0.0, tool="search", rid="")}
    loop = loop_with(waits, parked)
    assert loop.waits.remaining("search", 0.5) == pytest.approx(405.7 / 6 - 0.5)
    assert loop.due_within(now=0.5, horizon_s=10.0) == 0  # the slow answers weigh in
    assert loop.due_within(now=5.0, horizon_s=10.0) == 0  # past the fast mode: ~195 s left
    assert loop.due_within(now=195.0, horizon_s=10.0) == 0  # 25 s left
    assert loop.due_within(now=205.0, horizon_s=20.0) == 1  # 15 s left
    assert loop.due_within(now=230.0, horizon_s=60.0) == 1  # just past the longest answer
    assert loop.due_within(now=400.0, horizon_s=60.0) == 0  # long past it
    assert loop.waits.remaining("search", 400.0) == 400.0 - 220.0


def test_the_estimate_follows_the_recent_answers() -> None:
    waits = ToolWaits()
    for _ in range(WINDOW):
        waits.add("t", 100.0)
    for _ in range(WINDOW):
        waits.add("t", 1.0)  # the tool became fast: the old answers leave the window
    assert waits.remaining("t", 0.0) == pytest.approx(1.0)
