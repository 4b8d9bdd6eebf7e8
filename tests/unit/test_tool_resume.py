"""Resuming tool-calling rollouts (issue 37 §5), the pure parts: the group rule
(`resume_group`: a group with a trajectory that cannot continue is resampled, and says
why; one parked on a stateful tool's call is replayed when its history can be rebuilt),
the RL state's in-place resampling of one group (fresh ids, same prompt and places,
rewards uncounted), and the live source's reading of saved trajectories."""

from __future__ import annotations

import pytest

from pivot_hpc.agentic.config import ToolsConfig
from pivot_hpc.agentic.messages import ToolResult
from pivot_hpc.agentic.tools import BUILTIN_TOOLS, MAX_HISTORY_CALLS, ToolSpec
from pivot_hpc.agentic.trajectory import CallRecord, Trajectory, TrajectoryLimits, resume_group
from pivot_hpc.coordinator.rl_state import ConservationError, RLState, Sample
from pivot_hpc.coordinator.turns import Turn
from pivot_hpc.data.problem import Problem
from pivot_hpc.engines.base import SeqResult
from pivot_hpc.models.tokenizer import build_tokenizer
from pivot_hpc.rl.config import RLConfig
from pivot_hpc.runtime.live_samples import LiveSamples

TOK = build_tokenizer()
NO_ARGS = {"type": "object", "properties": {}, "additionalProperties": False}


def traj(i: int, state: str = "gen", tool: str = "t", idem: bool = True, replay: bool = True):
    t = Trajectory(i, [1, 2, 3])
    t.add_generation([4, 5], [-0.1, -0.2], 0)
    if state == "parked":
        assert t.park(CallRecord(i, tool, "{}", idem, replay))
    elif state in ("done", "failed"):
        t.finish() if state == "done" else t.fail("sandbox lost")
    return t


# ------------------------------------------------------------------ the group rule
def test_a_group_of_trajectories_that_can_go_on_stays() -> None:
    group = [traj(0, "done"), traj(1, "gen"), traj(2, "parked")]  # keep, continue, reissue
    r = resume_group(group)
    assert not r.resample and r.why is None
    assert r.actions == ("keep", "continue", "reissue")


def test_a_call_on_a_tool_neither_idempotent_nor_replayable_resamples_the_group() -> None:
    group = [traj(0, "done"), traj(1, "parked", "counter", idem=False, replay=False)]
    r = resume_group(group)
    assert r.resample and r.actions == ("keep", "drop")
    assert r.why is not None and "'counter'" in r.why and "neither idempotent nor" in r.why


def test_a_replayable_call_resamples_unless_the_runtime_replays() -> None:
    group = [traj(0, "gen"), traj(1, "parked", "ledger", idem=False, replay=True)]
    r = resume_group(group)
    assert r.resample and r.actions == ("continue", "replay")
    assert r.why is not None and "'ledger'" in r.why and "does not replay" in r.why
    assert not resume_group(group, can_replay=True).resample


def stateful_history(*args_json: str) -> Trajectory:
    """A trajectory that called `ledger` with each of `args_json` and is parked on one
    more call of it."""
    t = Trajectory(5, [1, 2, 3], TrajectoryLimits(max_turns=64, max_context_tokens=4096))
    for i, a in enumerate((*args_json, "{}")):
        t.add_generation([4, 5], None, 0)
        assert t.park(CallRecord(i, "ledger", a, False, True))
        if i < len(args_json):
            t.add_observation([6], "ok", 0.01)
    return t


@pytest.mark.parametrize(
    ("history", "why"),
    [
        (["[1]"], "earlier call 0 are not a JSON object"),
        (["{}"] * (MAX_HISTORY_CALLS + 1), f"at most {MAX_HISTORY_CALLS} earlier calls"),
    ],
)
def test_a_replayable_call_whose_history_cannot_be_rebuilt_resamples(history, why) -> None:
    group = [traj(0, "done"), stateful_history(*history)]
    assert resume_group([traj(0, "done"), stateful_history("{}")], can_replay=True).why is None
    r = resume_group(group, can_replay=True)
    assert r.resample and r.actions == ("keep", "replay")
    assert r.why is not None and "'ledger'" in r.why and "cannot be rebuilt" in r.why
    assert why in r.why and "\n" not in r.why


def test_a_failed_trajectory_resamples_its_group() -> None:
    r = resume_group([traj(0, "failed"), traj(1, "done")])
    assert r.resample and r.why is not None and "sandbox lost" in r.why


# ------------------------------------------------------------------ the RL state
class Counting:
    def make(self, sample_id: int, step: int, prompt_index: int, group: int) -> Sample:
        return Sample(sample_id, step, prompt_index, group, prompt_len=10)

    def on_rollout(self, sample, generated, result) -> int:
        return 20


def rl_state() -> RLState:
    rl = RLState(steps=4, batch_prompts=3, samples_per_prompt=2, staleness=1, source=Counting())
    rl.release()
    rl.release()
    return rl


def test_a_group_is_sampled_again_in_place_with_fresh_ids() -> None:
    rl = rl_state()
    batch = rl.batches[0]
    for s in batch[2:4]:  # prompt 1: one rewarded, one in flight
        rl.rollout_done(s, 5)
    rl.reward_done(batch[2], 1.0, 0.0, 3)
    rl.rollout_done(batch[0], 5)
    rl.reward_done(batch[0], 0.0, 0.0, 3)  # another group's: it stays counted
    old, fresh = rl.resample_group(0, 1)
    assert [s.sample_id for s in old] == [2, 3]
    assert [s.sample_id for s in fresh] == [12, 13] and rl.next_sample_id == 14
    assert [s.sample_id for s in rl.batches[0]] == [0, 1, 12, 13, 4, 5]  # same places
    assert [(s.prompt_index, s.group) for s in rl.batches[0]] == [
        (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)
    ]  # fmt: skip
    assert rl.rewarded_count[0] == 1 and rl.data_cursor == 6  # the same prompt: no new data
    assert not rl.filtered and not rl.resampled  # dynamic sampling's counters: untouched
    assert len(rl.batches[0]) == rl.batch_size


def test_resampling_a_group_that_is_not_there_is_a_conservation_error() -> None:
    rl = rl_state()
    with pytest.raises(ConservationError, match="no group of prompt 7"):
        rl.resample_group(0, 7)
    with pytest.raises(ConservationError, match="batch 3"):
        rl.resample_group(3, 0)


# ------------------------------------------------------------------ the live source
@pytest.fixture
def declared(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two stateful tools besides the calculator: `counter` (neither idempotent nor
    replayable) and `ledger` (replayable)."""
    for name, replay in (("counter", False), ("ledger", True)):
        spec = ToolSpec(name, "a stateful tool", NO_ARGS, "print(1)", False, replay)
        monkeypatch.setitem(BUILTIN_TOOLS, name, lambda spec=spec: spec)


def live() -> LiveSamples:
    tools = ToolsConfig(enabled=True, tools=("calculator", "counter", "ledger"))
    return LiveSamples([Problem("What is 47+38? ", "85")], TOK, RLConfig(), tools=tools)


def turn(src: LiveSamples, s: Sample, text: str, call_id: int) -> str:
    out = [*TOK.encode(text, add_special_tokens=False), TOK.eos_token_id]
    res = SeqResult(s.sample_id, s.payload.traj.context_ids(), out, [-0.1] * len(out), "stop")
    return src.turn(s, len(out), res, call_id).kind


def turn_call(src: LiveSamples, s: Sample, text: str, call_id: int) -> Turn:
    """`s`'s turn `text`, which must call a tool: the call as the source made it."""
    out = [*TOK.encode(text, add_special_tokens=False), TOK.eos_token_id]
    res = SeqResult(s.sample_id, s.payload.traj.context_ids(), out, [-0.1] * len(out), "stop")
    made = src.turn(s, len(out), res, call_id)
    assert made.kind == "call", made
    return made


def call(tool: str) -> str:
    return f'<tool_call>{{"name": "{tool}", "arguments": {{}}}}</tool_call>'


@pytest.mark.usefixtures("declared")
def test_the_live_source_reads_the_rule_from_saved_trajectories() -> None:
    src = live()
    parked, done, fresh = (src.make(i, 0, 0, i) for i in range(3))
    assert turn(src, parked, call("counter"), 0) == "call"
    assert turn(src, done, "85", 1) == "done"
    reason = src.resample_reason([parked, done, fresh])
    assert reason is not None and "'counter'" in reason and "neither idempotent" in reason
    assert src.resample_reason([done, fresh]) is None
    # its call is never issued again: reaching it means the group was not resampled
    with pytest.raises(ConservationError, match="not sampled again"):
        src.resume_call(parked, 5)


@pytest.mark.usefixtures("declared")
def test_a_stateful_call_keeps_its_group_and_is_issued_again_with_its_history() -> None:
    """`ledger` (replayable, not idempotent): each call carries the earlier ones of the
    trajectory; the one parked at the save is issued again on resume with the same
    history it first went with."""
    src = live()
    s, done = src.make(0, 0, 0, 0), src.make(1, 0, 0, 1)
    first = turn_call(src, s, call("ledger"), 0)
    assert first.history == ()
    assert src.observe(s, ToolResult(0, "ok", "1", 0.01)) is not None
    assert turn(src, s, "<calc>1+1</calc>", 1) == "call"  # another tool: not its history
    assert src.observe(s, ToolResult(1, "ok", "2", 0.01)) is not None
    second = turn_call(src, s, call("ledger"), 2)
    assert second.history == ("{}",)
    assert turn(src, done, "85", 3) == "done"
    assert src.resample_reason([s, done]) is None  # no line: nothing resampled
    again = src.resume_call(s, 9)
    assert (again.kind, again.tool, again.args_json, again.history) == (
        "call",
        "ledger",
        second.args_json,
        second.history,
    )
    assert s.payload.traj.pending.call_id == 9


@pytest.mark.usefixtures("declared")
def test_a_stateful_call_this_run_cannot_replay_resamples_its_group(monkeypatch) -> None:
    """Resumed by a run that no longer declares the tool stateful, or not at all: nothing
    can replay it, so its group is resampled, with the reason."""
    src = live()
    s = src.make(0, 0, 0, 0)
    turn_call(src, s, call("ledger"), 0)
    stateless = ToolSpec("ledger", "now stateless", NO_ARGS, "print(1)", True, True)
    monkeypatch.setitem(BUILTIN_TOOLS, "ledger", lambda: stateless)
    again = live()
    reason = again.resample_reason([s])
    assert reason is not None and "'ledger'" in reason and "declares it stateless" in reason
    calc_only = ToolsConfig(enabled=True, tools=("calculator",))
    gone = LiveSamples([Problem("What is 47+38? ", "85")], TOK, RLConfig(), tools=calc_only)
    reason = gone.resample_reason([s])
    assert reason is not None and "'ledger'" in reason and "does not declare it" in reason


@pytest.mark.usefixtures("declared")
def test_an_idempotent_call_keeps_its_group_and_is_issued_again() -> None:
    src = live()
    s = src.make(0, 0, 0, 0)
    assert turn(src, s, "<calc>47+38</calc>", 0) == "call"
    assert src.resample_reason([s, src.make(1, 0, 0, 1)]) is None
    again = src.resume_call(s, 9)
    assert (again.tool, again.args_json, again.history) == (
        "calculator",
        '{"expression":"47+38"}',
        (),
    )
