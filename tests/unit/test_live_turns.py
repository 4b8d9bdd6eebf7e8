"""Live trajectories (runtime/live_turns.py): a turn that calls a tool is cut at its closing
tag and parks, the observation enters as ids, the next turn's prompt is the context so
far; refusals and limits; the verifiable reward reads the final answer, the GenRM the
rendered trajectory, training the whole response with observations masked."""

from __future__ import annotations

import dataclasses

import pytest

from pivot_hpc.agentic.config import ToolsConfig
from pivot_hpc.agentic.messages import ToolResult
from pivot_hpc.data.problem import Problem
from pivot_hpc.engines.base import SeqResult
from pivot_hpc.models.tokenizer import build_tokenizer
from pivot_hpc.rl.config import RLConfig
from pivot_hpc.runtime.live_samples import LiveSamples

TOK = build_tokenizer()


def samples(**tools) -> LiveSamples:
    cfg = ToolsConfig(enabled=True, **tools)
    return LiveSamples([Problem("What is 47+38? ", "85")], TOK, RLConfig(), tools=cfg)


def ids(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


def result(s, text: str, eos: bool = True, version: int = 3) -> SeqResult:
    out = ids(text) + ([TOK.eos_token_id] if eos else [])
    lps = [-0.5 - i / 1000 for i in range(len(out))]
    return SeqResult(s.sample_id, s.payload.traj.context_ids(), out, lps, "stop", version)


def test_a_call_is_cut_at_its_tag_parks_and_its_result_is_the_next_prompt() -> None:
    src = samples()
    s = src.make(0, 0, 0, 0)
    prompt, sampling = src.rollout_turn(s)
    assert prompt == s.payload.prompt_ids
    assert sampling.max_tokens == min(RLConfig().max_response_tokens, s.payload.traj.room())
    # the engine ran on past the call (no stop string without a tokenizer): cut there
    first = result(s, "<calc>47+38</calc><result>99</result> 99")
    turn = src.turn(s, len(first.token_ids), first, call_id=7)
    assert turn.kind == "call" and turn.tool == "calculator"
    assert turn.args_json == '{"expression":"47+38"}'
    traj = s.payload.traj
    assert traj.state == "parked" and traj.pending.call_id == 7
    assert traj.response_ids() == ids("<calc>47+38</calc>")  # sampled ids, kept as they are
    assert traj.segments[0].logprobs == first.logprobs[: len(ids("<calc>47+38</calc>"))]
    context = src.observe(s, ToolResult(7, "ok", "85", 0.01))
    assert traj.state == "gen" and context == len(traj.context_ids())
    assert traj.context_ids() == s.payload.prompt_ids + ids("<calc>47+38</calc><result>85</result>")
    prompt, _ = src.rollout_turn(s)
    assert prompt == traj.context_ids()
    last = result(s, " 85")
    assert src.turn(s, len(last.token_ids), last, call_id=8).kind == "done"
    assert traj.state == "done" and src.response_len(s) == len(traj.response_ids())


def finished(src: LiveSamples, s, *texts: str) -> None:
    for i, text in enumerate(texts):
        r = result(s, text, version=i + 1)
        if src.turn(s, len(r.token_ids), r, call_id=i).kind == "call":
            src.observe(s, ToolResult(i, "ok", "85", 0.01))


def test_rewards_read_the_final_answer_and_the_rendered_trajectory() -> None:
    src = samples()
    s = src.make(0, 0, 0, 0)
    finished(src, s, "<calc>47+38</calc>", "85")
    src.on_rollout(s, src.response_len(s), None)
    pl = s.payload
    assert pl.response.token_ids == pl.traj.response_ids()
    assert pl.response.version == 2 and pl.response.finish_reason == "stop"
    genrm_prompt = TOK.decode(pl.judge_ids)
    assert "<calc>47+38</calc><result>85</result>85" in genrm_prompt  # the whole trajectory
    assert src.answer_ids(pl) == [*ids("85"), TOK.eos_token_id]  # the final answer alone
    s.reward_verifiable = s.reward_genrm = 0.0
    batch = src.batch([s])
    obs = len(ids("<result>85</result>"))
    call = len(ids("<calc>47+38</calc>"))
    assert batch.loss_mask == [[1] * call + [0] * obs + [1] * 3]
    assert batch.old_logprobs[0][call : call + obs] == [0.0] * obs


def test_the_verifiable_reward_reads_only_the_final_answer() -> None:
    src = samples()
    rewards = []
    for final in ("I do not know", "Answer: 85"):  # 85 also comes before, in the call
        s = src.make(0, 0, 0, 0)
        finished(src, s, "Answer: 85 <calc>47+38</calc>", final)
        src.on_rollout(s, src.response_len(s), None)
        judged = SeqResult(s.sample_id, [], ids("Score: 0"), [0.0] * 8, "stop")
        rewards.append(src.reward(s, judged)[0])
    wrong, right = rewards
    assert wrong < right


def test_a_refusal_is_an_observation_and_the_trajectory_goes_on() -> None:
    src = samples()
    s = src.make(0, 0, 0, 0)
    r = result(s, "<tool_call>not json</tool_call>")
    turn = src.turn(s, len(r.token_ids), r, call_id=0)
    traj = s.payload.traj
    assert turn.kind == "again" and turn.context == len(traj.context_ids())
    assert traj.state == "gen" and traj.segments[-1].kind == "obs"
    assert "error:" in TOK.decode(traj.segments[-1].token_ids)


def test_a_call_on_the_last_turn_ends_the_trajectory_unrun() -> None:
    src = samples(max_turns=1)
    s = src.make(0, 0, 0, 0)
    r = result(s, "<calc>1+1</calc>")
    assert src.turn(s, len(r.token_ids), r, call_id=0).kind == "done"
    assert s.payload.traj.state == "truncated" and s.payload.traj.end_reason == "max_turns"
    src.on_rollout(s, src.response_len(s), None)
    assert s.payload.response.finish_reason == "length"  # training's truncation mask sees it


def test_an_observation_without_room_ends_the_trajectory() -> None:
    src = samples(max_context_tokens=40, max_tool_output_tokens=30)
    s = src.make(0, 0, 0, 0)
    r = result(s, "<calc>1+1</calc>", eos=False)
    assert src.turn(s, len(r.token_ids), r, call_id=0).kind == "call"
    assert src.observe(s, ToolResult(0, "ok", "2" * 25, 0.01)) is None
    assert s.payload.traj.state == "truncated"


def test_without_tools_a_rollout_is_one_turn_as_before() -> None:
    src = LiveSamples([Problem("p", "4")], TOK, RLConfig())
    s = src.make(0, 0, 0, 0)
    assert s.payload.traj is None
    prompt, sampling = src.rollout_turn(s)
    assert prompt == s.payload.prompt_ids and sampling is src.rollout_sampling


@pytest.mark.parametrize("text", ["no call here", "<calc>1+", "<calc>1+1</calc>"])
def test_the_cut_keeps_a_prefix_of_the_sampled_tokens(text: str) -> None:
    src = samples()
    out = ids(text + "tail")
    end = src._call_end(out)
    if "</calc>" in text:
        assert end == len(ids(text))
    else:
        assert end is None
    assert dataclasses.is_dataclass(src.turn_sampling)


def test_a_parked_trajectory_is_saved_as_data_and_its_call_issued_again() -> None:
    import pivot_hpc.runtime.checkpointing  # noqa: F401  (registers the checkpoint types)
    from pivot_hpc.checkpoint import codec

    src = samples()
    s = src.make(0, 0, 0, 0)
    r = result(s, "<calc>47+38</calc>")
    src.turn(s, len(r.token_ids), r, call_id=5)
    back = codec.loads(codec.dumps(s), "test")
    assert back.payload.traj.to_dict() == s.payload.traj.to_dict()
    again = src.resume_call(back, 11)
    assert (again.kind, again.tool, again.history) == ("call", "calculator", ())
    assert again.args_json == '{"expression":"47+38"}'
    assert back.payload.traj.pending.call_id == 11  # the result it waits for now
    assert src.resume_call(src.make(1, 0, 0, 0), 12) is None  # not parked: not a call


class ScriptedEngine:
    """Calls the calculator first, then answers with what the observation said."""

    def __init__(self) -> None:
        self.seqs: dict[int, list[int]] = {}

    def add(self, seq_id, prompt, generated=None, sampling=None, logprobs=None) -> None:
        self.seqs[seq_id] = list(prompt)

    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    def step(self) -> list[SeqResult]:
        out = []
        for sid, prompt in self.seqs.items():
            text = TOK.decode(prompt)
            if text.endswith("</result>"):
                reply = "Answer: " + text.rsplit("<result>", 1)[1].removesuffix("</result>")
            else:
                reply = "<calc>47+38</calc>Answer: 12"  # runs on past the call, as hf does
            ids_ = [*ids(reply), TOK.eos_token_id]
            out.append(SeqResult(sid, prompt, ids_, [-0.1] * len(ids_), "stop"))
        self.seqs = {}
        return out


class InlineService:
    """The service's submit/poll, answering at once (the test's stand-in for the sandbox)."""

    def __init__(self) -> None:
        self.answers: list[ToolResult] = []

    def submit(self, call) -> None:
        self.answers.append(ToolResult(call.call_id, "ok", "85", 0.01))

    def poll(self) -> list[ToolResult]:
        out, self.answers = self.answers, []
        return out


def test_the_held_out_evaluation_runs_trajectories_with_the_service() -> None:
    from pivot_hpc.runtime.evaluation_turns import EvalTurns

    src = samples()
    turns = EvalTurns(TOK, src.rollout_sampling, src.tools)
    prompts = [src.make(i, 0, 0, 0).payload.prompt_ids for i in range(3)]
    answers = turns.answers(ScriptedEngine(), prompts, InlineService())
    assert answers == ["Answer: 85"] * 3  # the final turn's text, after the observation
