"""Resuming tool-calling rollouts from a checkpoint (issue 37 §5) through the coordinator
and the simulated cluster: a GRPO group with a trajectory that cannot continue (parked on
a tool neither idempotent nor replayable) is sampled again from scratch before anything is
re-queued. Its samples are never trained; its prompt is, with fresh sample ids, in the
same places of the batch; every kept sample is trained exactly once and every step still
trains a full batch. A trajectory parked on a stateful tool's call (replayable, not
idempotent) keeps its group: the call is issued again with its history, and its sandbox
child gives the observation an uninterrupted run gets."""

from __future__ import annotations

from pathlib import Path

import pytest

from pivot_hpc.checkpoint import codec
from pivot_hpc.coordinator.hooks import Hooks
from pivot_hpc.coordinator.rl_state import Sample
from pivot_hpc.job import build as builder
from pivot_hpc.job.sim_backend import SimBackend
from pivot_hpc.runtime.checkpoint_records import allow_payload
from pivot_hpc.sim.workload import SimPayload
from pivot_hpc.telemetry import open_run
from tests.sim.test_simulator import tiny
from tests.unit.test_tool_resume import call, declared, live, turn  # noqa: F401

codec.register(Sample, SimPayload)
allow_payload(SimPayload)  # this module checkpoints simulated samples
TOOLS = [
    "tools.enabled=true",
    "sim.workload.tool_calls_mean=1.5",
    # long, widely spread calls: trajectories are still parked while others are rewarded
    "sim.workload.tool_latency_s=30",
    "sim.workload.tool_latency_sigma=1.5",
    "loop.steps=3",
]


class SaveWhileParked(Hooks):
    """Saves the RL state (through the checkpoint codec, as a live checkpoint stores it)
    between training steps when trajectories are parked on calls while others are
    rewarded (kept: they wait in the replay buffer): the latest moment with the most of
    both, so the test does not hang on the simulator's exact timing."""

    def __init__(self) -> None:
        self.coord = None
        self.state: dict = {}
        self.parked: set[int] = set()
        self.best = 0

    def before_run(self, coord) -> None:
        self.coord = coord

    def stop_requested(self) -> bool:
        c = self.coord
        both = min(len(c.turns.parked), sum(c.rl.rewarded_count.values()))
        if c.rl.training_step is None and both > self.best:
            self.best = both
            self.state = codec.loads(codec.dumps(c.rl.state()), "rl_state.json")
            self.parked = {p.sample.sample_id for p in c.turns.parked.values()}
        return False


def test_a_group_that_cannot_continue_is_sampled_again_and_trained_once(
    capsys, tmp_path: Path
) -> None:
    saver = SaveWhileParked()
    builder.build(tiny("pivot", *TOOLS), SimBackend(hooks=saver)).run()
    state, parked = saver.state, saver.parked
    assert state and parked
    saved = {s.sample_id: s for b in state["batches"].values() for s in b}
    # the groups with a parked trajectory: as if their tool were neither idempotent nor
    # replayable (the simulator's trajectories carry no tool flags; live_turns decides
    # this from the saved trajectory: the last test)
    doomed = {(s.step, s.prompt_index) for s in saved.values() if s.sample_id in parked}
    dropped_ids = {i for i, s in saved.items() if (s.step, s.prompt_index) in doomed}
    kept_ids = set(saved) - dropped_ids
    assert kept_ids, "every saved group had a parked trajectory: nothing kept to check"
    next_id = state["next_sample_id"]

    assert any(saved[i].rewarded for i in dropped_ids)  # rewards that no longer count

    job = builder.build(tiny("pivot", *TOOLS), SimBackend(out=tmp_path))
    coord = job.coordinator
    coord.rl.restore(state)
    coord.turns.source.resample_reason = lambda group: (
        "tool 'x' is neither idempotent nor replayable"
        if any(x.sample_id in parked for x in group)
        else None
    )
    coord.restore(coord.rl.batches, {})
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "sampled again" in ln]
    assert len(lines) == len(doomed)  # one line per resampled group, saying why
    assert all("neither idempotent nor replayable" in ln for ln in lines)
    assert not dropped_ids & set(coord.samples)  # none of them queued or waiting
    for step, batch in coord.rl.batches.items():
        before = list(state["batches"][step])
        assert [(s.prompt_index, s.group) for s in batch] == [
            (s.prompt_index, s.group) for s in before
        ]  # the same prompts, in the same places
        for s, old in zip(batch, before, strict=True):
            if old.sample_id in dropped_ids:
                assert s.sample_id >= next_id and not s.rolled_out and not s.rewarded
        assert coord.rl.rewarded_count[step] == sum(s.rewarded for s in batch)

    trained = []
    end_training = coord.rl.end_training
    coord.rl.end_training = lambda step: trained.append(end_training(step)) or trained[-1]
    job.run()
    rl = coord.rl
    assert rl.version == 3 and len(trained) == 3 - state["version"]
    ids = [s.sample_id for batch in trained for s in batch]
    assert all(len(batch) == rl.batch_size for batch in trained)  # full batches
    assert len(ids) == len(set(ids))  # none trained twice
    assert not set(ids) & dropped_ids  # the dropped never
    for batch in trained:  # every kept sample trained, in its own step
        assert all(saved[s.sample_id].step == s.step for s in batch if s.sample_id in saved)
    assert kept_ids <= set(ids)
    rows = open_run(tmp_path)["trained"]  # telemetry says the same: no gap, no duplicate
    assert sorted(int(i) for i in rows["sample_id"]) == sorted(ids)
    # every sample id made since the save was trained (the fresh groups included), or is
    # a later batch's: no gap
    assert set(range(next_id, rl.next_sample_id)) <= set(ids) | set(coord.samples)
    assert len(dropped_ids) + len(ids) + sum(map(len, rl.batches.values())) == (
        rl.next_sample_id - min(saved)
    )


# ---------------------------------------------------- live trajectories, saved as data
@pytest.mark.usefixtures("declared")
@pytest.mark.parametrize(
    ("tool", "resampled"), [("counter", True), ("ledger", False), ("calculator", False)]
)
def test_the_coordinators_resume_reads_saved_live_trajectories(
    tool: str, resampled: bool, capsys
) -> None:
    """The coordinator's resume path (`Coordinator.restore`) on the live source's
    trajectories, through the checkpoint codec: a group with a trajectory parked on
    `counter` (neither idempotent nor replayable) is sampled again — its rewarded sample
    no longer counts, its fresh samples are queued from their prompt — while one parked
    on `ledger` (stateful: replayed) or the calculator (idempotent) keeps its group; the
    other group's parked calculator call is issued again and its trajectory between turns
    re-queued."""
    import pivot_hpc.runtime.checkpointing  # noqa: F401  (registers the checkpoint types)

    cfg = tiny("pivot", "tools.enabled=true", "loop.batch_prompts=2", "loop.samples_per_prompt=2")

    def job_on(src):
        job = builder.build(cfg, SimBackend())
        job.coordinator.rl.source = job.coordinator.turns.source = src  # live trajectories
        return job

    src = live()
    rl = job_on(src).coordinator.rl
    batch = rl.release()  # prompt 0: samples 0 and 1; prompt 1: samples 2 and 3
    stuck, answered, waiting, between = batch
    assert turn(src, stuck, call(tool) if tool != "calculator" else "<calc>1+1</calc>", 0) == "call"
    assert turn(src, answered, "85", 1) == "done"
    rl.rollout_done(answered, src.response_len(answered))
    src.on_rollout(answered, 0, None)
    rl.reward_done(answered, 1.0, 0.0, 3)
    assert turn(src, waiting, "<calc>47+38</calc>", 2) == "call"
    assert turn(src, between, "<tool_call>oops</tool_call>", 3) == "again"  # a refusal
    between.context_len = len(between.payload.traj.context_ids())  # as the turn loop sets it
    state = codec.loads(codec.dumps(rl.state()), "rl_state.json")

    job = job_on(live())
    coord = job.coordinator
    coord.rl.restore(state)
    coord.restore(coord.rl.batches, {})
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "sampled again" in ln]
    restored = coord.rl.batches[0]
    rollout = coord.schedulers["rollout"]
    parked = sorted(p.sample.sample_id for p in coord.turns.parked.values())
    if resampled:
        (line,) = lines
        assert f"'{tool}'" in line and "group of prompt 0" in line
        assert [s.sample_id for s in restored] == [4, 5, 2, 3]
        assert coord.rl.rewarded_count[0] == 0  # the dropped group's reward: uncounted
        assert set(coord.samples) == {2, 3, 4, 5}
        for s in restored[:2]:  # from scratch: the prompt alone, no turn
            assert s.payload.traj.state == "gen" and not s.payload.traj.segments
            assert rollout.sequence(s.sample_id).length == s.prompt_len
        assert parked == [2]  # only the calculator's call is issued again
    else:
        assert not lines and [s.sample_id for s in restored] == [0, 1, 2, 3]
        assert coord.rl.rewarded_count[0] == 1 and parked == [0, 2]
    # between turns: re-queued from its context; parked: not queued
    assert rollout.sequence(3).length == between.context_len > between.prompt_len
    assert 2 not in rollout
    assert job.cluster.tool_calls == len(parked)


# ---------------------------------------------------- a stateful tool, replayed on resume
@pytest.mark.timeout(120)
def test_a_resumed_stateful_call_gives_the_uninterrupted_observation(capsys) -> None:
    """`calc_memory` (its state `ans`, the fold of the trajectory's earlier calls):
    a trajectory calls `6*7`, then `ans+1`, and is saved parked on the second call. The
    coordinator resumed from that save keeps the group, issues the call again with the
    same history, and the real sandbox answers it as in the uninterrupted run (43, not 1):
    the trajectory goes on with the same tokens."""
    import pivot_hpc.runtime.checkpointing  # noqa: F401  (registers the checkpoint types)
    from pivot_hpc.agentic.config import ToolsConfig
    from pivot_hpc.agentic.messages import ToolCall
    from pivot_hpc.agentic.sandbox import SandboxLimits
    from pivot_hpc.agentic.server import SandboxServer
    from pivot_hpc.agentic.tools import build_registry
    from pivot_hpc.coordinator.events import ToolReturned
    from pivot_hpc.data.problem import Problem
    from pivot_hpc.rl.config import RLConfig
    from pivot_hpc.runtime.live_samples import LiveSamples
    from tests.unit.test_tool_resume import TOK, turn_call

    cfg = tiny("pivot", "tools.enabled=true", "loop.batch_prompts=1", "loop.samples_per_prompt=2")
    memory = ToolsConfig(enabled=True, tools=("calc_memory",))

    def job_on():
        src = LiveSamples([Problem("What is 6*7+1? ", "43")], TOK, RLConfig(), tools=memory)
        job = builder.build(cfg, SimBackend())
        job.coordinator.rl.source = job.coordinator.turns.source = src  # live trajectories
        return job, src

    with SandboxServer(build_registry(["calc_memory"]), SandboxLimits()) as server:

        def run(call: ToolCall):
            return server.call(call, timeout_s=30)

        # uninterrupted
        job, src = job_on()
        s, _between = job.coordinator.rl.release()  # the other: between turns
        first = turn_call(src, s, "<calc>6*7</calc>", 0)
        r1 = run(ToolCall(0, 0, first.tool, first.args_json, 5.0, first.history))
        assert (r1.status, r1.text) == ("ok", "42") and src.observe(s, r1) is not None
        second = turn_call(src, s, "<calc>ans+1</calc>", 1)
        assert second.history == (first.args_json,)
        state = codec.loads(codec.dumps(job.coordinator.rl.state()), "rl_state.json")
        r2 = run(ToolCall(1, 0, second.tool, second.args_json, 5.0, second.history))
        assert (r2.status, r2.text) == ("ok", "43") and src.observe(s, r2) is not None

        # resumed from the save, parked on the second call
        job, _ = job_on()
        coord, issued = job.coordinator, []
        job.cluster.call_tool = issued.append  # the call goes to the real sandbox below
        coord.rl.restore(state)
        coord.restore(coord.rl.batches, {})
        assert "sampled again" not in capsys.readouterr().out  # the group is kept
        (call,) = issued
        assert (call.tool, call.args_json, call.history) == (
            second.tool,
            second.args_json,
            second.history,
        )
        resumed = run(call)
        assert (resumed.status, resumed.text) == (r2.status, r2.text)
        coord.turns.on_result(ToolReturned(coord.cluster.now(), resumed))
        back = next(x for x in coord.rl.batches[0] if x.sample_id == s.sample_id)
        assert back.payload.traj.context_ids() == s.payload.traj.context_ids()
        assert back.payload.traj.calls[-1].status == "ok"
        assert coord.schedulers["rollout"].sequence(s.sample_id).length == len(
            s.payload.traj.context_ids()
        )  # its next turn is queued from there
