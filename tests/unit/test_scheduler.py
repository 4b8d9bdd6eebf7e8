"""Shift-aware scheduler: Dispatch/Abort (Alg. 2), shift down (Alg. 3), shift up (Alg. 4)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivot_hpc.scheduler import BusyModel, Scheduler, SchedulerError, SeqState, ThroughputModel
from tests.unit.reference_scheduler import RefScheduler

MODEL = ThroughputModel(A=1e-6, B=5e-3, C=2e-4, D=1e-3)


def make(replicas: int, capacity: int, lengths: list[int], model=MODEL) -> Scheduler:
    s = Scheduler("rollout")
    for i in range(replicas):
        s.add_replica(f"rollout:{i}", capacity, model)
    for i, n in enumerate(lengths):
        s.submit(SeqState(i, n))
    return s


def test_dispatch_goes_to_max_gain_and_respects_capacity() -> None:
    s = make(3, 1000, [600, 600, 600, 600])
    out = s.dispatch()
    # Three fit (one per replica: an empty replica gives the largest gain); the fourth
    # would need 1200 tokens on any replica and waits.
    assert [rid for _, rid in out] == ["rollout:0", "rollout:1", "rollout:2"]
    assert s.n_queued == 1 and s.n_running == 3
    for v in s.replica_views():
        assert v.n_tok <= v.capacity
    s.check_invariants()


def test_queue_is_strict_priority_order() -> None:
    s = make(1, 1000, [500, 600, 10])
    out = s.dispatch()
    # seq 1 (600 tokens) does not fit next to seq 0; seq 2 would, but waits behind it:
    # strict priority, so a long (e.g. resumed) sequence is never starved.
    assert out == [(0, "rollout:0")]
    assert [q.seq_id for q in s.queued()] == [1, 2]
    s.finish(0)
    assert [sid for sid, _ in s.dispatch()] == [1, 2]


def test_abort_keeps_generated_tokens() -> None:
    s = make(2, 10_000, [100, 200])
    s.dispatch()
    s.grow(0, 150)  # generated 50 tokens
    assert s.replica(s.location(0)).n_tok in (150, 350)
    rid = s.location(0)
    aborted = s.abort(rid, "all")
    assert 0 in aborted
    assert s.sequence(0).length == 150 and s.location(0) is None
    s.dispatch()
    assert s.sequence(0).length == 150
    s.check_invariants()


def test_abort_shortest_picks_shortest_then_lowest_id() -> None:
    s = make(1, 10_000, [300, 100, 100, 200])
    s.dispatch()
    assert s.abort("rollout:0", "shortest") == [1]
    assert s.abort("rollout:0", "shortest") == [2]


def test_shift_down_migrates_everything_and_keeps_lengths() -> None:
    s = make(4, 12_000, [100 * (i + 1) for i in range(20)])
    s.dispatch()
    before = {i: s.sequence(i).length for i in range(20)}
    res = s.shift_down(["rollout:0", "rollout:1"])
    assert {sid for sid, _ in res.aborted} == {sid for sid, _ in res.dispatched}
    assert all(rid not in ("rollout:0", "rollout:1") for _, rid in res.dispatched)
    assert sorted(s.replicas) == ["rollout:2", "rollout:3"]
    assert {i: s.sequence(i).length for i in range(20)} == before
    assert s.n_running + s.n_queued == 20
    s.check_invariants()


def test_shift_up_fills_new_replicas_from_queue_before_migrating() -> None:
    s = make(1, 1000, [400, 400, 400, 400])
    s.dispatch()
    assert s.n_queued == 2
    res = s.shift_up([("rollout:1", 1000, MODEL)])
    assert res.migrations == 0  # the queue did not drain: no migration (Alg. 4)
    assert [rid for _, rid in res.dispatched] == ["rollout:1", "rollout:1"]


def test_shift_up_migration_raises_throughput() -> None:
    s = make(2, 100_000, [500 + 37 * i for i in range(40)])
    s.dispatch()
    t0 = s.throughput()
    res = s.shift_up([("rollout:2", 100_000, MODEL), ("rollout:3", 100_000, MODEL)])
    assert res.migrations > 0
    assert s.throughput() > t0
    assert res.throughput_after == pytest.approx(s.throughput())
    assert {s.location(i) for i in range(40)} >= {"rollout:2", "rollout:3"}
    s.check_invariants()


def test_vanilla_busy_model_and_no_migration() -> None:
    s = Scheduler("reward", migration=False)
    for i in range(2):
        s.add_replica(f"reward:{i}", 10_000, BusyModel())
    for i in range(6):
        s.submit(SeqState(i, 100))
    s.dispatch()
    # least-loaded dispatch: 3 and 3
    assert sorted(v.n_seq for v in s.replica_views()) == [3, 3]
    res = s.shift_up([("reward:2", 10_000, BusyModel())])
    assert res.migrations == 0 and s.replica("reward:2").n_seq == 0
    assert s.throughput() == 2.0


def test_errors_name_the_problem() -> None:
    s = make(1, 100, [10])
    with pytest.raises(SchedulerError, match="already scheduled"):
        s.submit(SeqState(0, 5))
    with pytest.raises(SchedulerError, match="not active"):
        s.abort("rollout:9")
    with pytest.raises(SchedulerError, match="valid"):
        s.abort("rollout:0", "longest")
    s.dispatch()
    with pytest.raises(SchedulerError, match="still runs"):
        s.remove_replica("rollout:0")
    with pytest.raises(SchedulerError, match="already active"):
        s.add_replica("rollout:0", 10, MODEL)
    with pytest.raises(SchedulerError, match="priority"):
        Scheduler("x", priority="random")
    with pytest.raises(SchedulerError, match="KV capacity -5 < 0"):
        s.add_replica("rollout:7", -5, MODEL)
    with pytest.raises(SchedulerError, match="negative length"):
        s.submit(SeqState(99, -1))


def test_clone_is_independent() -> None:
    s = make(2, 10_000, [100] * 10)
    s.dispatch()
    c = s.clone()
    c.shift_down(["rollout:0"])
    assert "rollout:0" in s.replicas and "rollout:0" not in c.replicas
    s.check_invariants()
    c.check_invariants()


def test_a_live_clone_survives_changes_to_the_original() -> None:
    """Clones share the sequence tables copy-on-write, in both directions."""
    s = make(2, 10_000, [100] * 10)
    s.dispatch()
    c = s.clone()
    n_seq, lengths = c.n_seq, [c.sequence(i).length for i in range(10)]
    s.submit(SeqState(99, 50))
    s.set_lengths({i: 200 for i in range(10)})
    s.finish(3)
    assert c.n_seq == n_seq and [c.sequence(i).length for i in range(10)] == lengths
    assert 99 not in c and 3 in c
    c.check_invariants()
    s.check_invariants()


def test_finish_and_compaction_keep_state_consistent() -> None:
    s = Scheduler("rollout")
    s.add_replica("rollout:0", 10**9, MODEL)
    for i in range(6000):
        s.submit(SeqState(i, 10))
        s.dispatch()
        if i >= 10:
            s.finish(i - 10)
    assert s.n_running == 10
    s.check_invariants()


# ---------------------------------------------------------------- properties
lengths = st.lists(st.integers(1, 3000), min_size=0, max_size=60)
models = st.builds(
    ThroughputModel,
    A=st.floats(0, 1e-5),
    B=st.floats(1e-4, 1e-2),
    C=st.floats(0, 1e-3),
    D=st.floats(0, 5e-3),
)


@settings(max_examples=150, deadline=None)
@given(
    model=models,
    n_rep=st.integers(1, 6),
    cap=st.integers(500, 20_000),
    lens=lengths,
    n_new=st.integers(1, 4),
    n_down=st.integers(0, 3),
)
def test_matches_reference_alg_2_to_4(model, n_rep, cap, lens, n_new, n_down) -> None:
    """Dispatch, shift down and shift up decide exactly as the plain reference does."""
    s = make(n_rep, cap, lens, model)
    ref = RefScheduler()
    for i in range(n_rep):
        ref.add(f"rollout:{i}", cap, model)
    ref.queue = dict(enumerate(lens))
    s.dispatch()
    ref.dispatch()
    assert {i: s.location(i) for i in range(len(lens)) if s.location(i)} == ref.assignment()

    down = [f"rollout:{i}" for i in range(min(n_down, n_rep - 1))]
    s.shift_down(down)
    ref.shift_down(down)
    assert {i: s.location(i) for i in range(len(lens)) if s.location(i)} == ref.assignment()

    new = [(f"rollout:{n_rep + j}", cap, model) for j in range(n_new)]
    t_before = s.throughput()
    res = s.shift_up(new)
    moves = ref.shift_up(new)
    assert res.migrations == moves
    assert {i: s.location(i) for i in range(len(lens)) if s.location(i)} == ref.assignment()
    # Migration never lowers the estimated aggregate throughput.
    assert s.throughput() >= t_before - 1e-9 * max(1.0, t_before)
    s.check_invariants()
    # Capacity is respected everywhere, with generated tokens included in lengths.
    for v in s.replica_views():
        assert v.n_tok <= v.capacity
    # Nothing lost, nothing duplicated.
    assert s.n_running + s.n_queued == len(lens)


def test_migration_result_says_what_moved() -> None:
    """Net effect of a shift up: a sequence from the queue is started; a running one that
    moved twice (a → b → c) is stopped on a and started on c; one that moved back home
    (a → b → a) is left alone."""
    from pivot_hpc.scheduler.scheduler import MigrationResult

    res = MigrationResult(
        aborted=[(2, "r:a"), (3, "r:a"), (2, "r:b"), (3, "r:b")],
        dispatched=[(1, "r:c"), (2, "r:b"), (3, "r:b"), (2, "r:c"), (3, "r:a")],
        from_queue=1,
    )
    moved, started = res.net_moves()
    assert moved == {2: "r:a"}
    assert started == {1: "r:c", 2: "r:c"}


def test_rebalance_moves_a_crowded_tail_onto_idle_replicas() -> None:
    """`scheduler.rebalance` (beyond the paper): the sequences left on one replica after the
    rest finished move to the role's idle replicas, shortest first, while the role's
    throughput rises; nothing moves while a replica is busy everywhere or work waits."""
    s = make(1, 100_000, [100, 200, 300, 400, 500, 600])
    s.dispatch()
    s.add_replica("rollout:1", 100_000, MODEL)
    s.add_replica("rollout:2", 100_000, MODEL)  # up, empty: no shift migrated onto them
    before = s.throughput()
    res = s.rebalance()
    assert res.migrations >= 2 and s.throughput() > before
    moved, starts = res.net_moves()
    assert set(moved) == set(starts) and {s.location(q) for q in starts} <= {
        "rollout:1",
        "rollout:2",
    }
    assert all(s.sequence(q).length == 100 * (q + 1) for q in range(6))  # tokens kept
    assert min(v.n_seq for v in s.replica_views()) > 0
    s.check_invariants()
    assert s.rebalance().migrations == 0  # every replica busy now
    # work waiting: dispatch, not migration, fills an idle replica
    q = make(1, 100_000, [100, 200, 300])
    q.dispatch()
    q.add_replica("rollout:1", 100_000, MODEL)
    q.submit(SeqState(9, 50))
    assert q.rebalance().migrations == 0


def _submit_dispatch_finish(seed: int) -> tuple[list, list[int]]:
    """A long queue fed one submit at a time between dispatches and finishes (the
    reward role's pattern): what was dispatched where, and the queue at the end."""
    import random

    rng = random.Random(seed)
    model = ThroughputModel(A=1e-6, B=5e-3, C=2e-4, D=1e-3, max_running=rng.choice([0, 3]))
    s = Scheduler("reward", priority=rng.choice(["seq_id", "longest_first"]))
    for i in range(rng.randint(1, 4)):
        s.add_replica(f"reward:{i}", rng.choice([300, 2000]), model)
    ids = rng.sample(range(10**6), 400)
    out = []
    for sid in ids:
        s.submit(SeqState(sid, rng.randint(1, 150)))
        out.append(s.dispatch())
        running = sorted(q for q in s._q_of if s.location(q) is not None)
        if running and rng.random() < 0.4:
            s.finish(rng.choice(running))
            out.append(s.dispatch())
    s.check_invariants()
    return out, [q.seq_id for q in s.queued()]


@pytest.mark.parametrize("seed", range(20))
def test_dispatch_from_a_queue_head_matches_a_full_merge(monkeypatch, seed: int) -> None:
    """Dispatch merges pending submissions into the head of a long queue only (`_head`);
    it places exactly what merging them into the whole queue first would."""
    from pivot_hpc.scheduler import scheduler as mod

    monkeypatch.setattr(mod, "_HEAD", 1 << 30)  # never a head: every dispatch merges all
    full = _submit_dispatch_finish(seed)
    monkeypatch.setattr(mod, "_HEAD", 2)
    monkeypatch.setattr(mod, "_MERGE_PENDING", 5)
    assert _submit_dispatch_finish(seed) == full
