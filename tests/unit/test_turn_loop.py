"""The coordinator's turn loop (coordinator/turns.py) on a scripted source: a refusal queues
the next turn at once, a call parks the trajectory outside the scheduler until its result,
an observation that leaves no room ends the trajectory, and a result nobody waits for is a
conservation error."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pivot_hpc.agentic.messages import ToolResult
from pivot_hpc.coordinator.coordinator import NullTelemetry
from pivot_hpc.coordinator.events import SequenceFinished, ToolReturned
from pivot_hpc.coordinator.rl_state import ConservationError, Sample
from pivot_hpc.coordinator.turns import Turn, TurnLoop
from pivot_hpc.errors import PivotError
from pivot_hpc.scheduler import Scheduler


class Script:
    """Turns and observations as a test writes them."""

    def __init__(self, turns: list[Turn], contexts: list[int | None]) -> None:
        self.turns, self.contexts = list(turns), list(contexts)
        self.observed: list[ToolResult] = []

    def turn(self, s, generated, result, call_id):
        return self.turns.pop(0)

    def observe(self, s, result):
        self.observed.append(result)
        return self.contexts.pop(0)

    def response_len(self, s):
        return 42

    def resume_call(self, s, call_id):
        return Turn("call", tool="calculator", args_json="{}") if s.sample_id == 9 else None


def loop(source) -> tuple[TurnLoop, SimpleNamespace, list]:
    calls: list = []
    done: list = []
    clock = SimpleNamespace(t=0.0)
    coord = SimpleNamespace(
        cluster=SimpleNamespace(now=lambda: clock.t, call_tool=calls.append),
        schedulers={"rollout": Scheduler("rollout")},
        dispatch=lambda role: None,
        telemetry=NullTelemetry(),
        clock=clock,
        calls=calls,
    )
    turns = TurnLoop(
        coord, source, call_timeout_s=5.0, rolled_out=lambda s, n, r: done.append((s, n))
    )
    return turns, coord, done


def finished(s: Sample, t: float = 1.0) -> SequenceFinished:
    return SequenceFinished(t, "rollout", "rollout:0", s.sample_id, 120, 20, None)


def test_a_call_parks_outside_the_scheduler_until_its_result() -> None:
    turns, coord, done = loop(Script([Turn("call", tool="calculator", args_json="{}")], [150]))
    s = Sample(1, 0, 0, 0, prompt_len=100)
    assert not turns.on_turn(s, finished(s))
    sched = coord.schedulers["rollout"]
    assert s.sample_id not in sched and turns.n_parked == 1 and s.turn == 1
    (call,) = coord.calls
    assert call.traj_id == 1 and call.tool == "calculator" and call.deadline_s == 5.0
    coord.clock.t = 3.5
    turns.on_result(ToolReturned(3.5, ToolResult(call.call_id, "ok", "2", 0.1)))
    assert turns.n_parked == 0 and s.sample_id in sched and s.context_len == 150
    assert sched.sequence(s.sample_id).length == 150
    assert turns.stats.wait_s == pytest.approx(3.5) and s.tool_calls == 1 and not done


def test_a_refusal_queues_the_next_turn_at_once() -> None:
    turns, coord, _ = loop(Script([Turn("again", context=130), Turn("done")], []))
    s = Sample(2, 0, 0, 0, prompt_len=100)
    assert not turns.on_turn(s, finished(s))
    assert s.sample_id in coord.schedulers["rollout"] and not coord.calls
    assert turns.stats.refusals == 1 and s.turn_context == 130
    coord.schedulers["rollout"].cancel(s.sample_id)
    assert turns.on_turn(s, finished(s))  # the answer: the caller rolls it out
    assert turns.stats.trajectories == 1 and turns.stats.with_calls == 0


def test_an_observation_without_room_ends_the_trajectory() -> None:
    turns, coord, done = loop(Script([Turn("call", tool="calculator", args_json="{}")], [None]))
    s = Sample(3, 0, 0, 0, prompt_len=100)
    turns.on_turn(s, finished(s))
    turns.on_result(ToolReturned(2.0, ToolResult(coord.calls[0].call_id, "ok", "2", 0.1)))
    assert done == [(s, 42)] and s.sample_id not in coord.schedulers["rollout"]
    assert turns.stats.with_calls == 1


def test_a_result_nobody_waits_for_is_a_conservation_error() -> None:
    turns, _, _ = loop(Script([], []))
    with pytest.raises(ConservationError, match="tool call 7"):
        turns.on_result(ToolReturned(1.0, ToolResult(7, "ok", "2", 0.1)))


def test_resume_issues_a_parked_trajectorys_call_again() -> None:
    turns, coord, _ = loop(Script([], []))
    assert not turns.resume(Sample(8, 0, 0, 0, prompt_len=10))
    assert turns.resume(Sample(9, 0, 0, 0, prompt_len=10))
    assert turns.n_parked == 1 and coord.calls[0].traj_id == 9


def test_a_source_without_turns_is_refused_in_one_line() -> None:
    with pytest.raises(PivotError, match="tools.enabled=false"):
        loop(object())
