"""Tool-calling rollouts in the simulator (coordinator/turns.py, issue 37): trajectories of
turns park on tool calls holding no rollout slot, come back as new turns from their
context, and each is one sample: rolled out, rewarded and trained exactly once within the
staleness bound; the summary and the report count the calls."""

from __future__ import annotations

from pathlib import Path

import pytest

from pivot_hpc.job.simulate import build, simulate
from pivot_hpc.telemetry import open_run
from pivot_hpc.telemetry.summary import summarise
from tests.sim.test_simulator import MODES, tiny
from tests.sim.trained import run_collecting as run_trained

OBS = 16  # sim.workload.tool_output_tokens (its default)
TOOLS = ["tools.enabled=true", "sim.workload.tool_calls_mean=1.5", "sim.workload.tool_latency_s=5"]


def run_collecting(cfg):
    coord, cluster, _ = build(cfg)
    return coord, cluster, run_trained(coord)


@pytest.mark.parametrize(("mode", "strategy"), MODES[:4])
def test_trajectories_are_one_sample_each_in_every_mode(mode: str, strategy: str) -> None:
    coord, cluster, trained = run_collecting(tiny(mode, f"planner.strategy={strategy}", *TOOLS))
    assert coord.rl.version == 3 and len(trained) == 3
    seen: set[int] = set()
    for batch in trained:
        assert len(batch) == 12 * 4
        for s in batch:
            turns = s.payload.turn_lens or (s.payload.response_len,)
            assert s.turn == len(turns)  # every turn ran, once
            assert s.tool_calls == len(turns) - 1
            # the response training sees: every turn and every observation
            assert s.response_len == sum(turns) + OBS * s.tool_calls
            assert s.rolled_out and s.rewarded and 0 <= s.version_start
        ids = {s.sample_id for s in batch}
        assert not ids & seen
        seen |= ids
    stats = coord.turns.stats
    assert stats.calls == cluster.tool_calls > 0
    assert stats.results + coord.turns.n_parked == stats.calls  # none lost, none twice
    for p in coord.turns.parked.values():  # a later batch's, when the run ended
        assert p.sample.sample_id in coord.samples and not p.sample.rolled_out
        assert p.sample.sample_id not in coord.schedulers["rollout"]
    assert max(coord.stats.staleness) <= coord.rl.staleness


def test_a_parked_trajectory_holds_no_slot_and_no_kv() -> None:
    coord, cluster, _ = build(tiny("pivot", *TOOLS))
    sched = coord.schedulers["rollout"]
    checked = []

    def nowhere(sid: int) -> None:
        assert sid not in sched  # neither running nor queued
        for r in cluster._replicas.values():
            assert sid not in r.seqs and sid not in r.waiting  # nothing held in an engine
        checked.append(sid)

    call_tool, on_result = cluster.call_tool, coord.turns.on_result

    def calling(call):
        nowhere(call.traj_id)
        call_tool(call)

    def answered(ev):
        s = coord.turns.parked[ev.result.call_id].sample
        nowhere(s.sample_id)
        on_result(ev)
        assert s.sample_id in sched or s.rolled_out  # back as a new turn, or done

    cluster.call_tool = calling
    coord.turns.on_result = answered
    coord.run()
    assert len(checked) > 100


def test_tools_that_are_never_called_change_nothing() -> None:
    plain_coord, plain, _ = run_collecting(tiny("pivot"))
    tools_coord, tools, _ = run_collecting(tiny("pivot", "tools.enabled=true"))
    assert tools_coord.turns is not None and tools_coord.turns.stats.calls == 0
    assert tools.now() == plain.now()
    assert tools_coord.stats.steps == plain_coord.stats.steps


def test_max_turns_bounds_the_calls() -> None:
    _, _, trained = run_collecting(
        tiny("pivot", *TOOLS, "sim.workload.tool_calls_mean=3", "tools.max_turns=2")
    )
    assert {s.tool_calls for b in trained for s in b} == {1}


@pytest.mark.parametrize("latency", [0.5, 200.0])
def test_the_summary_and_the_report_count_the_calls(tmp_path: Path, latency: float) -> None:
    cfg = tiny(
        "pivot",
        "tools.enabled=true",
        "sim.workload.tool_calls_mean=0.5",
        f"sim.workload.tool_latency_s={latency}",
        "sim.workload.tool_latency_sigma=0",
    )
    out = simulate(cfg, tmp_path, progress=False)
    run = open_run(tmp_path)
    report = summarise(run)
    rollout = run["throughput"][run["throughput"]["role"] == "rollout"]
    assert rollout["n_parked"].max() > 0  # the parked series (they are not in n_seq)
    for s in (out, report):
        assert s["tool_calls"] > 0
        assert 0.2 < s["tool_call_trajectory_share"] < 0.8  # about half the trajectories call
        assert s["tool_wait_s_mean"] == pytest.approx(latency, rel=1e-6)
    assert report["tool_call_trajectory_share"] == pytest.approx(out["tool_call_trajectory_share"])
    # the report counts the calls answered before the run's last allocation ended
    assert report["tool_calls"] == out["tool_calls"]


def test_without_tools_the_keys_say_none_were_made(tmp_path: Path) -> None:
    out = simulate(tiny("pivot"), tmp_path, progress=False)
    report = summarise(open_run(tmp_path))
    for s in (out, report):
        assert s["tool_calls"] == 0 and s["tool_wait_s_mean"] is None
        assert s["tool_call_trajectory_share"] == 0.0
