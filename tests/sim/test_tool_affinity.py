"""Prefix affinity of tool-calling turns in the simulator (issue 37 §3): a turn that comes
back from a tool on the replica incarnation that ran its last turn prefills only its
observation, so with `scheduler.affinity_slack` on far fewer rollout tokens are
prefilled; every trajectory is still one sample, trained once, and a run is
deterministic."""

from __future__ import annotations

from pivot_hpc.job.simulate import build, simulate
from tests.sim.test_simulator import tiny
from tests.sim.trained import run_collecting

TOOLS = ["tools.enabled=true", "sim.workload.tool_calls_mean=2", "sim.workload.tool_latency_s=2"]


def run(slack: float) -> dict:
    out = simulate(tiny("pivot", *TOOLS, f"scheduler.affinity_slack={slack}"), None, progress=False)
    out.pop("wall_s")
    return out


def test_affinity_cuts_the_prefill_of_returning_turns_deterministically() -> None:
    off, on = run(0.0), run(0.1)
    assert on["tool_calls"] == off["tool_calls"] > 100
    # most returning turns land where their prefix is; without affinity few do, by chance
    assert on["rollout_prefix_hit_tokens"] > 3 * off["rollout_prefix_hit_tokens"]
    assert on["rollout_prefill_tokens"] < 0.6 * off["rollout_prefill_tokens"]
    assert on == run(0.1)  # deterministic


def test_with_affinity_every_trajectory_is_one_sample_trained_once() -> None:
    coord, cluster, _ = build(tiny("pivot", *TOOLS, "scheduler.affinity_slack=0.5"))
    trained = run_collecting(coord)
    assert len(trained) == 3 and cluster.prefix_hit_tokens > 0
    ids = [s.sample_id for batch in trained for s in batch]
    assert len(ids) == len(set(ids)) == 3 * 12 * 4
    for s in (s for batch in trained for s in batch):
        turns = s.payload.turn_lens or (s.payload.response_len,)
        assert s.turn == len(turns) and s.tool_calls == len(turns) - 1
        assert s.rolled_out and s.rewarded
    stats = coord.turns.stats
    assert stats.results + coord.turns.n_parked == stats.calls == cluster.tool_calls
    coord.schedulers["rollout"].check_invariants()


def test_with_the_wait_every_sample_is_trained_once_and_waits_end_on_time() -> None:
    """scheduler.affinity_wait_s: returning turns wait for their full replica (four running
    slots each here) and take it when a slot frees; the loop never sleeps past the end of
    a wait but dispatches then, even if nothing else happens, and the turn goes to another
    replica; every trajectory is still one sample, trained once."""
    wait_s = 0.5
    cfg = tiny(
        "pivot",
        *TOOLS,
        "engines.rollout.max_batch=4",
        "scheduler.affinity_slack=0.1",
        f"scheduler.affinity_wait_s={wait_s}",
    )
    coord, cluster, _ = build(cfg)
    sched = coord.schedulers["rollout"]
    overslept, wakes, woke, took_pref, at_deadline = [], set(), set(), 0, 0
    poll, dispatch = cluster.poll, sched.dispatch

    def checked_poll(until: float) -> list:
        wake = sched.wait_until
        if cluster.now() < wake < until:
            overslept.append((cluster.now(), wake, until))
        out = poll(until)
        if cluster.now() >= wake:  # a wait ended by now: the loop must dispatch
            wakes.add(cluster.now())
        return out

    def counted_dispatch(*args, **kwargs) -> list:
        nonlocal took_pref, at_deadline
        now = cluster.now()
        if now in wakes:
            woke.add(now)
        out = dispatch(*args, **kwargs)
        for seq_id, rid in out:
            q = sched._q_of[seq_id]
            pref, deadline = int(sched.seq_pref[q]), float(sched.seq_wait[q])
            if pref < 0 or now <= deadline - wait_s:
                continue  # no preference, or placed when it came
            if sched.replicas.get(rid) == pref:
                took_pref += 1  # it waited (or fitted nowhere), then its replica had room
            elif now == deadline:
                at_deadline += 1  # its wait is over: another replica, at the deadline
        return out

    cluster.poll, sched.dispatch = checked_poll, counted_dispatch
    trained = run_collecting(coord)
    assert overslept == []
    assert wakes and woke == wakes  # a dispatch once every wait ended
    assert took_pref > 0 and at_deadline > 0
    ids = [s.sample_id for batch in trained for s in batch]
    assert len(ids) == len(set(ids)) == 3 * 12 * 4
    for s in (s for batch in trained for s in batch):
        turns = s.payload.turn_lens or (s.payload.response_len,)
        assert s.turn == len(turns) and s.tool_calls == len(turns) - 1
        assert s.rolled_out and s.rewarded
    stats = coord.turns.stats
    assert stats.results + coord.turns.n_parked == stats.calls == cluster.tool_calls
    sched.check_invariants()
