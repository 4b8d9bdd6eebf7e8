"""A parked trajectory's prefix affinity (issue 37 §3) in the turn loop and the planner: its
next turn prefers the replica incarnation its last turn ran on, and φ of that replica grows
with the prefix it caches for trajectories due back within H."""

from __future__ import annotations

import pytest

from pivot_hpc.agentic.messages import ToolResult
from pivot_hpc.coordinator.events import SequenceFinished, ToolReturned
from pivot_hpc.coordinator.rl_state import Sample
from pivot_hpc.coordinator.turns import Turn
from pivot_hpc.planner import Snapshot, Topology, TrainingState, replica_id
from pivot_hpc.planner.pairs import lost_prefix, penalty
from pivot_hpc.scheduler import Scheduler, SeqState, ThroughputModel
from tests.unit.test_turn_loop import Script, loop

MODEL = ThroughputModel(A=1e-6, B=5e-3, C=2e-4, D=1e-3)
CALL = Turn("call", tool="calculator", args_json="{}")


def with_replicas(turns_coord, slack: float) -> Scheduler:
    sched = Scheduler("rollout", affinity_slack=slack)
    for i in range(2):
        sched.add_replica(f"rollout:{i}", 100_000, MODEL)
    turns_coord.schedulers["rollout"] = sched
    return sched


def test_the_next_turn_prefers_the_replica_incarnation_it_ran_on() -> None:
    turns, coord, _ = loop(Script([CALL, CALL], [150, 170]))
    sched = with_replicas(coord, 0.1)
    s = Sample(1, 0, 0, 0, prompt_len=100)
    turns.on_turn(s, SequenceFinished(1.0, "rollout", "rollout:1", 1, 120, 20, None))
    (p,) = turns.parked.values()
    assert (p.rid, p.idx, p.prefix) == ("rollout:1", sched.replicas["rollout:1"], 120)
    turns.on_result(ToolReturned(2.0, ToolResult(coord.calls[0].call_id, "ok", "2", 0.1)))
    assert sched.sequence(1).affinity == sched.replicas["rollout:1"]
    # rollout:0 would win the argmax (ties: the first replica); the affinity takes rollout:1
    assert sched.dispatch() == [(1, "rollout:1")]
    # a turn whose replica shifted down before its finish was heard: no preference
    sched.finish(1)
    turns.on_turn(s, SequenceFinished(3.0, "rollout", "rollout:7", 1, 180, 10, None))
    (p,) = turns.parked.values()
    assert p.idx == -1
    turns.on_result(ToolReturned(4.0, ToolResult(coord.calls[1].call_id, "ok", "2", 0.1)))
    assert sched.sequence(1).affinity == -1


def test_prefix_due_counts_the_incarnation_and_the_horizon() -> None:
    turns, coord, _ = loop(Script([CALL] * 3, []))
    sched = with_replicas(coord, 0.1)
    for sid, rid, length in ((1, "rollout:0", 100), (2, "rollout:0", 300), (3, "rollout:1", 50)):
        s = Sample(sid, 0, 0, 0, prompt_len=10)
        turns.on_turn(s, SequenceFinished(0.0, "rollout", rid, sid, length, 5, None))
    # no answered call yet: every call is due at once
    assert turns.prefix_due(0.0, 10.0) == {"rollout:0": (2, 400), "rollout:1": (1, 50)}
    turns.waits.add("calculator", 100.0)  # calls take 100 s: none due within 10 s
    assert turns.prefix_due(0.0, 10.0) == {}
    assert turns.prefix_due(95.0, 10.0) == {"rollout:0": (2, 400), "rollout:1": (1, 50)}
    # rollout:1 came back up as a fresh engine: its cache is gone, nothing to lose
    sched.shift_down(["rollout:1"])
    sched.shift_up([("rollout:1", 100_000, MODEL)])
    assert turns.prefix_due(95.0, 10.0) == {"rollout:0": (2, 400)}
    # without affinity a returning turn re-prefills anyway: no cache to lose
    sched.affinity_slack = 0.0
    assert turns.prefix_due(95.0, 10.0) == {}


def snapshot(parked_prefix: dict[str, tuple[int, int]]) -> Snapshot:
    topo = Topology.build(
        num_gpus=8,
        gpus_per_node=8,
        tp={"rollout": 1, "reward": 1},
        kv_capacity={"rollout": 100_000, "reward": 100_000},
        models={"rollout": MODEL, "reward": MODEL},
        training_gpus=[6, 7],
        prefill_s_per_token={"rollout": 1e-4, "reward": 1e-4},
    )
    scheds = {r: Scheduler(r) for r in ("rollout", "reward")}
    for g in range(3):
        scheds["rollout"].add_replica(replica_id("rollout", g), 100_000, MODEL)
        scheds["reward"].add_replica(replica_id("reward", g + 3), 100_000, MODEL)
    for i in range(6):
        scheds["rollout"].submit(SeqState(i, 1000))
    scheds["rollout"].dispatch()
    return Snapshot(
        topo, scheds, TrainingState(active=True, busy=True), parked_prefix=parked_prefix
    )


def test_phi_grows_with_the_prefix_parked_with_affinity_due_within_h() -> None:
    down = ["rollout:1"]
    base = penalty(snapshot({}), down)
    assert base > 0  # τ·T_i alone
    small = penalty(snapshot({"rollout:1": (2, 4_000)}), down)
    large = penalty(snapshot({"rollout:1": (8, 16_000)}), down)
    assert base < small < large
    # another replica's parked prefix is not this shift-down's loss
    assert penalty(snapshot({"rollout:2": (8, 16_000)}), down) == base
    # units: prefill seconds × the replica's throughput with them back (tokens)
    snap = snapshot({"rollout:1": (2, 4_000)})
    v = snap.schedulers["rollout"].replica("rollout:1")
    expected = 4_000 * 1e-4 * MODEL.throughput(v.n_seq + 2, v.n_tok + 4_000)
    assert lost_prefix(snap, "rollout:1") == pytest.approx(expected)
    assert small - base == pytest.approx(expected)


def test_phi_counts_the_prefix_even_when_every_trajectory_is_parked() -> None:
    snap = snapshot({"rollout:0": (4, 8_000)})
    for i in range(6):  # nothing runs: T_i = 0, τ·T_i = 0
        snap.schedulers["rollout"].finish(i)
    assert penalty(snap, ["rollout:0"]) > 0
