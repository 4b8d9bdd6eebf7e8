"""Soft affinity in Dispatch (issue 37 §3): a tool-calling trajectory's next turn prefers the
replica that caches its prefix, when that replica has room and its ΔT is within
`affinity_slack` of the best; otherwise, and for every sequence without a preference, the
argmax ΔT as before. A preference names one incarnation of a replica: once it shifted
down it is none."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivot_hpc.scheduler import Scheduler, SchedulerError, SeqState, ThroughputModel
from tests.unit.reference_scheduler import RefReplica, RefScheduler
from tests.unit.test_scheduler import MODEL, models

CAP = 100_000


def two_replicas(slack: float, lens: tuple[int, int], cap: int = CAP) -> Scheduler:
    """rollout:0 runs one sequence of lens[0] tokens, rollout:1 one of lens[1]."""
    s = Scheduler("rollout", affinity_slack=slack)
    for i in range(2):
        s.add_replica(f"rollout:{i}", cap, MODEL)
    for i, n in enumerate(lens):
        s.submit(SeqState(100 + i, n, affinity=i))
    s.dispatch()
    assert [s.location(100), s.location(101)] == ["rollout:0", "rollout:1"]
    return s


def gains(s: Scheduler, length: int) -> list[float]:
    return [v.model.gain(v.n_seq, v.n_tok, length) for v in s.replica_views()]


def test_the_preferred_replica_is_taken_within_the_slack() -> None:
    for slack, where in ((0.0, "rollout:0"), (0.1, "rollout:1")):
        s = two_replicas(slack, (1000, 1200))
        g0, g1 = gains(s, 500)
        assert g1 < g0 and g1 >= 0.9 * g0  # rollout:1 is a little worse
        s.submit(SeqState(1, 500, affinity=s.replicas["rollout:1"]))
        assert s.dispatch() == [(1, where)]
        s.check_invariants()


def test_a_full_or_clearly_worse_preferred_replica_is_not_taken() -> None:
    # full: rollout:1 has no KV room for the sequence, however close its gain
    s = two_replicas(0.5, (1000, 1200), cap=1600)
    s.submit(SeqState(1, 500, affinity=1))
    assert s.dispatch() == [(1, "rollout:0")]
    # clearly worse: rollout:1 is loaded, rollout:2 empty (a far larger gain)
    s = two_replicas(0.1, (1000, 1200))
    s.add_replica("rollout:2", CAP, MODEL)
    g = gains(s, 500)
    assert g[1] < 0.9 * max(g)
    s.submit(SeqState(1, 500, affinity=1))
    assert s.dispatch() == [(1, "rollout:2")]
    # full by the running-request cap
    capped = ThroughputModel(A=MODEL.A, B=MODEL.B, C=MODEL.C, D=MODEL.D, max_running=1)
    s = Scheduler("rollout", affinity_slack=1.0)
    for i in range(2):
        s.add_replica(f"rollout:{i}", CAP, capped if i else MODEL)
    s.submit(SeqState(0, 10, affinity=1))
    s.submit(SeqState(1, 10, affinity=1))
    assert s.dispatch() == [(0, "rollout:1"), (1, "rollout:0")]


def test_a_preferred_replica_that_shifted_down_is_no_preference() -> None:
    s = Scheduler("rollout", affinity_slack=0.1)
    for i in range(2):
        s.add_replica(f"rollout:{i}", CAP, MODEL)
    stale = s.replicas["rollout:1"]
    s.shift_down(["rollout:1"])
    s.shift_up([("rollout:1", CAP, MODEL)])  # the same slot, a fresh engine: no cache
    fresh = s.replicas["rollout:1"]
    assert fresh != stale
    s.submit(SeqState(100, 1000))
    s.submit(SeqState(101, 1200))
    assert s.dispatch() == [(100, "rollout:0"), (101, "rollout:1")]
    for pref, where in ((stale, "rollout:0"), (-1, "rollout:0"), (fresh, "rollout:1")):
        c = s.clone()
        c.submit(SeqState(1, 500, affinity=pref))
        assert c.dispatch() == [(1, where)]
        c.check_invariants()
    # queued with a live preference that then shifts down: no preference left, no error
    s.submit(SeqState(1, 10**6, affinity=fresh))  # fits nowhere: waits
    s.shift_down(["rollout:1"])
    s.check_invariants()
    s.cancel(1)
    s.submit(SeqState(2, 500, affinity=fresh))
    assert dict(s.dispatch())[2] == "rollout:0"
    s.check_invariants()


def test_the_preference_survives_clone_and_compaction() -> None:
    s = two_replicas(0.1, (1000, 1200))
    c = s.clone()
    c.submit(SeqState(1, 500, affinity=1))
    assert c.dispatch() == [(1, "rollout:1")]
    s.submit(SeqState(1, 500, affinity=1))
    c2 = s.clone()  # a clone of a queued preference
    assert c2.dispatch() == [(1, "rollout:1")] == s.dispatch()
    assert c2.affinity_slack == 0.1 and c2.sequence(1).affinity == 1
    # compaction (many finished sequences) keeps each live sequence's preference: seq 1,
    # aborted back to the queue, returns to its preferred replica
    for i in range(5000):
        s.submit(SeqState(1000 + i, 1))
        s.dispatch()
        s.finish(1000 + i)
    s.check_invariants()  # (checks every preference against its SeqState)
    assert s.abort("rollout:1", "shortest") == [1]
    assert s.dispatch() == [(1, "rollout:1")]
    s.check_invariants()


def test_affinity_slack_is_checked() -> None:
    with pytest.raises(SchedulerError, match="affinity_slack"):
        Scheduler("rollout", affinity_slack=1.5)


def ref_dispatch(ref: RefScheduler, prefs: dict[int, int], slack: float) -> None:
    """The reference's Dispatch with the affinity rule written plainly."""
    for seq_id in sorted(ref.queue):
        length = ref.queue[seq_id]
        best = ref.best(length, ref.replicas)
        if best is None:
            return
        p = prefs.get(seq_id, -1)
        if slack > 0 and 0 <= p < len(ref.replicas) and ref.replicas[p] is not best:
            pref: RefReplica = ref.replicas[p]
            if pref.tok + length <= pref.capacity:
                g_best = best.model.gain(best.n, best.tok, length)
                g_pref = pref.model.gain(pref.n, pref.tok, length)
                if g_pref >= g_best - slack * abs(g_best):
                    best = pref
        best.seqs[seq_id] = ref.queue.pop(seq_id)


@settings(max_examples=150, deadline=None)
@given(
    model=models,
    n_rep=st.integers(1, 5),
    cap=st.integers(500, 20_000),
    seqs=st.lists(st.tuples(st.integers(1, 3000), st.integers(-1, 5)), max_size=50),
    slack=st.sampled_from([0.0, 0.05, 0.2, 1.0]),
)
def test_matches_the_reference_with_and_without_preferences(model, n_rep, cap, seqs, slack):
    """Sequences with a preference follow the rule; without one (and at slack 0) the
    plain argmax, so the existing brute-force comparison still holds."""
    s = Scheduler("rollout", affinity_slack=slack)
    ref = RefScheduler()
    for i in range(n_rep):
        s.add_replica(f"rollout:{i}", cap, model)
        ref.add(f"rollout:{i}", cap, model)
    prefs = {}
    for i, (length, pref) in enumerate(seqs):
        s.submit(SeqState(i, length, affinity=pref))
        ref.queue[i] = length
        if 0 <= pref < n_rep:
            prefs[i] = pref
    s.dispatch()
    ref_dispatch(ref, prefs, slack)
    assert {i: s.location(i) for i in range(len(seqs)) if s.location(i)} == ref.assignment()
    s.check_invariants()
