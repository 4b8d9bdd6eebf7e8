"""Prefix affinity of tool-calling turns in the simulator (issue 37 §3): a turn that comes
back from a tool on the replica incarnation that ran its last turn prefills only its
observation, so with `scheduler.affinity_slack` on far fewer rollout tokens are
prefilled; every trajectory is still one sample, trained once, and a run is
deterministic."""

from __future__ import annotations

from pivot_hpc.sim.run import build, simulate
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
