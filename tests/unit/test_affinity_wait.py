"""The bounded wait for a returning turn's cached replica (issue 37, `affinity_wait_s`): a
sequence whose preferred replica is up but has no room stays queued up to the bound
since its submit, goes there as soon as a slot frees, and to the argmax once its wait
is over, with no event needed; it never holds back the sequences behind it, and never
waits for a replica that shifted down."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivot_hpc.config.loader import ConfigError
from pivot_hpc.job.config import load_config
from pivot_hpc.scheduler import Scheduler, SchedulerError, SeqState, ThroughputModel
from pivot_hpc.scheduler.scheduler import _HEAD
from tests.unit.reference_scheduler import RefReplica, RefScheduler
from tests.unit.test_scheduler import MODEL, models

CAP = 100_000
ONE = ThroughputModel(A=MODEL.A, B=MODEL.B, C=MODEL.C, D=MODEL.D, max_running=1)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def full_preferred(wait_s: float = 2.0, slack: float = 0.1, clock: Clock | None = None):
    """rollout:0 empty; rollout:1 (one running slot) runs sequence 100. Returns the
    scheduler, its clock and rollout:1's position (the preference)."""
    clock = Clock() if clock is None else clock
    s = Scheduler("rollout", affinity_slack=slack, affinity_wait_s=wait_s, clock=clock)
    s.add_replica("rollout:0", CAP, MODEL)
    s.add_replica("rollout:1", CAP, ONE)
    s.submit(SeqState(100, 1000))
    s.dispatch(["rollout:1"])
    assert s.location(100) == "rollout:1"
    return s, clock, s.replicas["rollout:1"]


def test_waits_within_the_bound_then_takes_the_slot_that_frees() -> None:
    s, clock, pref = full_preferred()
    s.submit(SeqState(1, 500, affinity=pref))
    assert s.dispatch() == [] and s.location(1) is None and s.n_queued == 1
    assert s.wait_until == 2.0
    clock.t = 1.9
    assert s.dispatch() == []  # still within the bound, still full
    s.finish(100)  # a slot frees on the preferred replica
    assert s.dispatch() == [(1, "rollout:1")]
    assert s.wait_until == math.inf
    s.check_invariants()


def test_goes_to_the_best_replica_once_the_bound_passed_with_no_event() -> None:
    s, clock, pref = full_preferred()
    s.submit(SeqState(1, 500, affinity=pref))
    assert s.dispatch() == []
    clock.t = s.wait_until  # nothing finished: the caller dispatches at the deadline
    assert s.dispatch() == [(1, "rollout:0")]
    assert s.wait_until == math.inf
    s.check_invariants()


def test_the_bound_counts_from_the_submit() -> None:
    s, clock, pref = full_preferred(wait_s=2.0)
    clock.t = 10.0
    s.submit(SeqState(1, 500, affinity=pref))
    clock.t = 11.5
    assert s.dispatch() == [] and s.wait_until == 12.0
    clock.t = 12.0
    assert s.dispatch() == [(1, "rollout:0")]


def test_a_waiting_sequence_blocks_none_behind_it() -> None:
    s, clock, pref = full_preferred()
    s.submit(SeqState(1, 500, affinity=pref))
    s.submit(SeqState(2, 700))  # no preference
    s.submit(SeqState(3, 600, affinity=pref))  # waits too
    s.submit(SeqState(4, 800, affinity=s.replicas["rollout:0"]))  # its replica has room
    assert s.dispatch() == [(2, "rollout:0"), (4, "rollout:0")]
    assert [q.seq_id for q in s.queued()] == [1, 3]
    s.check_invariants()
    s.finish(100)  # one slot: the first in priority order takes it
    assert s.dispatch() == [(1, "rollout:1")]
    clock.t = 2.0
    assert s.dispatch() == [(3, "rollout:0")]
    s.check_invariants()


def test_a_sequence_that_fits_nowhere_still_stops_the_queue() -> None:
    """Strict priority is kept: a waiting sequence is skipped, one that fits nowhere is
    waited behind as before."""
    s, _, pref = full_preferred()
    s.submit(SeqState(1, 500, affinity=pref))
    s.submit(SeqState(2, 10 * CAP))  # fits nowhere
    s.submit(SeqState(3, 10))
    assert s.dispatch() == []
    assert [q.seq_id for q in s.queued()] == [1, 2, 3]


@pytest.mark.parametrize("ahead", [False, True], ids=["after", "interleaved"])
def test_a_long_queue_of_waiting_sequences_lets_new_ones_past(ahead: bool) -> None:
    """A queue longer than Dispatch's head, all of it waiting, with a few submissions not
    merged yet (`Scheduler._head`): the waiting ones stay, the new ones are placed, whether
    they come after the waiting ones in priority order or among them."""
    s, clock, pref = full_preferred()
    waiting = list(range(1000, 1000 + 12 * _HEAD, 2))
    for sid in waiting:
        s.submit(SeqState(sid, 100, affinity=pref))
    assert s.dispatch() == []
    new = [5, 1001, 1003] if ahead else [5000, 5001]  # (1001, 1003: in the head)
    for sid in new:
        s.submit(SeqState(sid, 100))
    assert sorted(sid for sid, _ in s.dispatch()) == sorted(new)
    assert [q.seq_id for q in s.queued()] == waiting
    s.check_invariants()
    clock.t = 5.0
    placed = s.dispatch()
    assert [sid for sid, _ in placed] == waiting  # all to rollout:0, in priority order
    assert {rid for _, rid in placed} == {"rollout:0"} and not s.n_queued
    s.check_invariants()


def test_no_wait_for_a_replica_that_shifted_down() -> None:
    # shifted down while the turn waited: no preference left, it goes at once
    s, _, pref = full_preferred()
    s.submit(SeqState(1, 500, affinity=pref))
    assert s.dispatch() == []
    res = s.shift_down(["rollout:1"])  # its sequence 100 goes to rollout:0, and so does 1
    assert sorted(res.dispatched) == [(1, "rollout:0"), (100, "rollout:0")]
    assert s.wait_until == math.inf
    s.check_invariants()
    # shifted down before the turn came back (the same slot up again: a fresh engine)
    s, _, pref = full_preferred()
    s.shift_down(["rollout:1"])
    s.shift_up([("rollout:1", CAP, ONE)])
    s.submit(SeqState(2, 10))
    s.dispatch(["rollout:1"])  # the fresh incarnation is full again
    s.submit(SeqState(1, 500, affinity=pref))
    assert s.dispatch() == [(1, "rollout:0")]
    s.check_invariants()


def test_no_wait_when_it_is_off_or_has_no_clock() -> None:
    for kw in ({"wait_s": 0.0}, {"slack": 0.0}):
        s, _, pref = full_preferred(**kw)
        s.submit(SeqState(1, 500, affinity=pref))
        assert s.dispatch() == [(1, "rollout:0")]
        assert s.wait_until == math.inf
    s = Scheduler("rollout", affinity_slack=0.1, affinity_wait_s=2.0)  # no clock
    s.add_replica("rollout:0", CAP, MODEL)
    s.add_replica("rollout:1", CAP, ONE)
    s.submit(SeqState(100, 1000))
    s.dispatch(["rollout:1"])
    s.submit(SeqState(1, 500, affinity=1))
    assert s.dispatch() == [(1, "rollout:0")]


def test_a_full_kv_cache_is_waited_for_too() -> None:
    clock = Clock()
    s = Scheduler("rollout", affinity_slack=0.5, affinity_wait_s=1.0, clock=clock)
    s.add_replica("rollout:0", CAP, MODEL)
    s.add_replica("rollout:1", 1500, MODEL)
    s.submit(SeqState(100, 1200))
    s.dispatch(["rollout:1"])
    s.submit(SeqState(1, 500, affinity=1))  # 1200 + 500 > 1500
    assert s.dispatch() == []
    s.grow(100, 900)  # (a shorter context would leave room: it is dispatched then)
    assert s.dispatch() == [(1, "rollout:1")]


def test_the_wait_survives_clone_abort_and_its_bound_is_checked() -> None:
    s, clock, pref = full_preferred()
    s.submit(SeqState(1, 500, affinity=pref))
    c = s.clone()
    assert c.dispatch() == [] == s.dispatch()
    assert c.affinity_wait_s == 2.0 and c.wait_until == 2.0
    clock.t = 3.0
    assert c.dispatch() == [(1, "rollout:0")]
    assert s.location(1) is None  # the clone's dispatch moved nothing of the original
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(SchedulerError, match="affinity_wait_s"):
            Scheduler("rollout", affinity_wait_s=bad)


def test_the_config_key_is_checked_and_documented() -> None:
    from pivot_hpc.config.docs import field_docs
    from pivot_hpc.scheduler.config import SchedulerConfig

    assert load_config(None, ["scheduler.affinity_wait_s=0.5"]).scheduler.affinity_wait_s == 0.5
    for bad in ("-1", "nan", "inf"):
        with pytest.raises(ConfigError, match="affinity_wait_s"):
            load_config(None, [f"scheduler.affinity_wait_s={bad}"])
    assert "running cap" in field_docs(SchedulerConfig)["affinity_wait_s"]


def ref_dispatch(ref: RefScheduler, prefs: dict[int, int], waits: set[int], slack: float) -> None:
    """The reference's Dispatch with the affinity and the wait written plainly: `waits`
    are the sequences still within their bound."""
    for seq_id in sorted(ref.queue):
        length = ref.queue[seq_id]
        best = ref.best(length, ref.replicas)
        if best is None:
            return
        p = prefs.get(seq_id, -1)
        if slack > 0 and 0 <= p < len(ref.replicas) and ref.replicas[p] is not best:
            pref: RefReplica = ref.replicas[p]
            room = pref.tok + length <= pref.capacity
            if not room and seq_id in waits:
                continue  # it waits for its replica; the next ones go on
            if room:
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
    seqs=st.lists(
        st.tuples(st.integers(1, 3000), st.integers(-1, 5), st.sampled_from([0.0, 3.0])),
        max_size=50,
    ),
    slack=st.sampled_from([0.0, 0.05, 0.2, 1.0]),
    rounds=st.integers(1, 3),
)
def test_matches_the_reference_with_waits(model, n_rep, cap, seqs, slack, rounds):
    """Submitted at 0 or 3 s with a 2 s bound and dispatched at 4 s: those submitted at 3
    still wait; the compiled Dispatch skips exactly the reference's sequences. Further
    rounds (the running ones finishing in id order) dispatch the same queue again."""
    clock = Clock()
    s = Scheduler("rollout", affinity_slack=slack, affinity_wait_s=2.0, clock=clock)
    ref = RefScheduler()
    for i in range(n_rep):
        s.add_replica(f"rollout:{i}", cap, model)
        ref.add(f"rollout:{i}", cap, model)
    prefs, waits = {}, set()
    for i, (length, pref, t) in enumerate(seqs):
        clock.t = t
        s.submit(SeqState(i, length, affinity=pref))
        ref.queue[i] = length
        if 0 <= pref < n_rep:
            prefs[i] = pref
            if t + 2.0 > 4.0:
                waits.add(i)
    clock.t = 4.0
    for _ in range(rounds):
        s.dispatch()
        ref_dispatch(ref, prefs, waits, slack)
        assert {i: s.location(i) for i in range(len(seqs)) if s.location(i)} == ref.assignment()
        s.check_invariants()
        for i in sorted(ref.assignment())[:2]:
            s.finish(i)
            for r in ref.replicas:
                r.seqs.pop(i, None)


def test_live_hf_runs_do_not_wait_for_a_prefix_cache_they_do_not_have() -> None:
    from types import SimpleNamespace

    from pivot_hpc.job.build import affinity_wait
    from pivot_hpc.job.config import load_config

    live, sim = SimpleNamespace(simulated=False), SimpleNamespace(simulated=True)
    hf = load_config(None, ["scheduler.affinity_wait_s=2"])
    vllm = load_config(None, ["scheduler.affinity_wait_s=2", "engines.rollout.engine=vllm"])
    assert hf.engines.rollout.engine == "hf"
    assert affinity_wait(hf, live) == 0.0
    assert affinity_wait(hf, sim) == affinity_wait(vllm, live) == 2.0
