"""Token-in/token-out trajectories: the loss mask, limits and truncation, checkpoint data,
the resume rule, and the prefix-preservation check — with the tiny character tokenizer and
with a BPE tokenizer trained here, so that merges exist and re-encoding would show."""

from __future__ import annotations

import copy
import json

import pytest

from pivot_hpc.agentic.trajectory import (
    CallRecord,
    ObservationFormat,
    Trajectory,
    TrajectoryLimits,
    calls_to_issue,
    encoder,
    observation_format,
    preserves_prefix,
    replay_history,
    resume_action,
    resume_group,
    template_delta,
    truncate,
)

WRAPPER = ObservationFormat("<result>", "</result>")


def call(call_id: int = 1, idempotent: bool = True, replayable: bool = True) -> CallRecord:
    return CallRecord(call_id, "calculator", '{"expression":"1+1"}', idempotent, replayable)


def two_turns(limits: TrajectoryLimits | None = None) -> Trajectory:
    """prompt (3) → gen (4) → obs (2) → gen (3), done."""
    t = Trajectory(7, [1, 2, 3], limits or TrajectoryLimits())
    t.add_generation([10, 11, 12, 13], [-0.1, -0.2, -0.3, -0.4], version=2)
    assert t.park(call())
    t.add_observation([90, 91], status="ok", seconds=0.05)
    t.add_generation([14, 15, 2], [-0.5, -0.6, -0.7], version=3)
    t.finish()
    return t


# ---------------------------------------------------------------------- mask and views
def test_loss_mask_never_trains_tool_output():
    t = two_turns()
    assert t.response_ids() == [10, 11, 12, 13, 90, 91, 14, 15, 2]
    assert t.context_ids() == [1, 2, 3, *t.response_ids()]
    assert t.loss_mask() == [1, 1, 1, 1, 0, 0, 1, 1, 1]
    obs = {tok for s in t.segments if s.kind == "obs" for tok in s.token_ids}
    assert all(m == 0 for tok, m in zip(t.response_ids(), t.loss_mask(), strict=True) if tok in obs)
    assert t.response_logprobs() == [-0.1, -0.2, -0.3, -0.4, 0.0, 0.0, -0.5, -0.6, -0.7]
    assert (t.turns, t.state, t.calls[0].status) == (2, "done", "ok")


def test_transitions_are_checked():
    t = Trajectory(1, [1])
    with pytest.raises(ValueError, match="not parked"):
        t.add_observation([5])
    with pytest.raises(ValueError, match="an observation follows a generated turn"):
        t.park(call())
    t.add_generation([4])
    t.park(call())
    with pytest.raises(ValueError, match="is parked, not gen"):
        t.add_generation([5])
    with pytest.raises(ValueError, match="one logprob per token"):
        Trajectory(2, [1]).add_generation([1, 2], [0.0])


def test_a_refused_call_is_answered_at_once_and_masked():
    t = Trajectory(1, [1], TrajectoryLimits(max_turns=2))
    t.add_generation([4, 5])
    assert t.add_refusal([80, 81, 82])
    assert (t.state, t.calls, t.loss_mask()) == ("gen", [], [1, 1, 0, 0, 0])
    t.add_generation([6])
    assert not t.add_refusal([80])  # after the last turn: no observation, truncated
    assert (t.state, t.end_reason) == ("truncated", "max_turns")


# ---------------------------------------------------------------------- limits
def test_max_turns_ends_the_trajectory_without_running_the_call():
    t = Trajectory(1, [1], TrajectoryLimits(max_turns=2))
    t.add_generation([4])
    assert t.park(call(1))
    t.add_observation([9])
    t.add_generation([5])
    assert not t.park(call(2))
    assert (t.state, t.end_reason, len(t.calls)) == ("truncated", "max_turns", 1)


def test_max_context_tokens():
    limits = TrajectoryLimits(max_context_tokens=10, max_tool_output_tokens=4)
    t = Trajectory(1, [1, 2, 3], limits)
    assert t.room() == 7
    with pytest.raises(ValueError, match="room for 7"):
        t.add_generation(list(range(8)))
    t.add_generation([4, 5, 6, 7])
    assert t.park(call())
    assert not t.add_observation([8, 9, 10])  # would leave no room to generate
    assert (t.state, t.end_reason) == ("truncated", "max_context_tokens")
    assert len(t.context_ids()) == 7  # never beyond the limit; the observation not appended
    t2 = Trajectory(1, [1, 2, 3], limits)
    t2.add_generation([4, 5, 6, 7, 8, 9, 10])  # the turn used all the room
    assert not t2.park(call()) and t2.end_reason == "max_context_tokens"


@pytest.mark.parametrize(("side", "kept"), [("right", [0, 1, 2]), ("left", [7, 8, 9])])
def test_tool_output_truncation(side, kept):
    assert truncate(list(range(10)), 3, side) == kept
    limits = TrajectoryLimits(max_tool_output_tokens=3, truncation_side=side)
    t = Trajectory(1, [1], limits)
    t.add_generation([4])
    t.park(call())
    assert t.add_observation(list(range(10)))
    assert t.segments[-1].token_ids == kept and t.segments[-1].truncated


def chars(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_observation_format_keeps_its_wrapper_whole():
    ids, cut = WRAPPER.encode(chars, "12345678", TrajectoryLimits(max_tool_output_tokens=30))
    assert ids == chars("<result>12345678</result>") and not cut
    room = len("<result></result>") + 3  # the wrapper and three body tokens
    for side, body in (("right", "123"), ("left", "678")):
        limits = TrajectoryLimits(max_tool_output_tokens=room, truncation_side=side)
        ids, cut = WRAPPER.encode(chars, "12345678", limits)
        assert ids == chars(f"<result>{body}</result>") and cut


# ---------------------------------------------------------------------- checkpoints
def test_serialisation_round_trip_through_json():
    done = two_turns()
    parked = Trajectory(8, [1, 2], TrajectoryLimits(truncation_side="left"))
    parked.add_generation([3, 4], None, version=None)
    parked.park(call(5, idempotent=False, replayable=False))
    for t in (done, parked):
        data = json.loads(json.dumps(t.to_dict()))
        back = Trajectory.from_dict(data)
        assert back == t
        assert back.to_dict() == t.to_dict()
    back = Trajectory.from_dict(json.loads(json.dumps(parked.to_dict())))
    assert back.pending == CallRecord(5, "calculator", '{"expression":"1+1"}', False, False)
    assert back.loss_mask() == parked.loss_mask()


def _broken(mutate) -> dict:
    data = two_turns().to_dict()
    mutate(data)
    return data


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.update(format=2),
        lambda d: d.update(prompt_ids=[1, -2]),
        lambda d: d.update(prompt_ids=[1, True]),
        lambda d: d.update(traj_id="7"),
        lambda d: d.update(state="running"),
        lambda d: d.update(state="parked"),  # parked without a pending call
        lambda d: d["segments"][0].update(kind="tool"),
        lambda d: d["segments"][0].update(logprobs=[0.0]),
        lambda d: d["segments"][1].update(logprobs=[0.0, 0.0]),  # an observation's logprobs
        lambda d: d["segments"][0].update(logprobs=[float("nan")] * 4),
        lambda d: d["calls"][0].update(status=None),  # pending, yet done
        lambda d: d["calls"][0].update(idempotent="yes"),
        lambda d: d["limits"].update(max_turns=0),
        lambda d: d["limits"].update(truncation_side="middle"),
        lambda d: d.pop("segments"),
        lambda d: d.update(segments={"0": 1}),
    ],
)
def test_malformed_checkpoint_data_is_refused_in_one_line(mutate):
    with pytest.raises(ValueError) as info:
        Trajectory.from_dict(_broken(mutate))
    assert "\n" not in str(info.value)


def test_resume_rule():
    gen = Trajectory(1, [1])
    done = two_turns()
    failed = two_turns()
    failed.state = "failed"

    def parked_on(**flags) -> Trajectory:
        t = Trajectory(2, [1])
        t.add_generation([4])
        t.park(call(1))
        t.add_observation([9])
        t.add_generation([5])
        t.park(call(2, **flags))
        return t

    reissue = parked_on(idempotent=True, replayable=False)
    replay = parked_on(idempotent=False, replayable=True)
    drop = parked_on(idempotent=False, replayable=False)
    assert [resume_action(t) for t in (gen, done, failed, reissue, replay, drop)] == [
        "continue",
        "keep",
        "drop",
        "reissue",
        "replay",
        "drop",
    ]
    assert [c.call_id for c in calls_to_issue(reissue)] == [2]
    # the history (the earlier answered calls of its tool, in order), then the call
    assert [c.call_id for c in calls_to_issue(replay)] == [1, 2]
    assert replay.history("calculator") == ['{"expression":"1+1"}'] and not replay.history("x")
    assert replay_history(replay) == ('{"expression":"1+1"}',)
    with pytest.raises(ValueError, match="not parked on a replayable call"):
        replay_history(reissue)
    assert calls_to_issue(drop) == [] and calls_to_issue(done) == []
    assert not resume_group([gen, done, reissue, replay], can_replay=True).resample
    assert resume_group([gen, done, reissue, replay]).resample  # a runtime that cannot
    group = resume_group([done, drop])
    assert group.resample and group.actions == ("keep", "drop")
    # the rule also holds on the data read back from a checkpoint
    assert resume_action(Trajectory.from_dict(drop.to_dict())) == "drop"


# ---------------------------------------------------------------------- prefixes and TITO
@pytest.fixture(scope="module")
def tiny():
    from pivot_hpc.models.tokenizer import build_tokenizer

    return build_tokenizer()


PRESERVING = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
# Like Qwen3's: reasoning is dropped from an assistant message once another message follows.
STRIPPING = (
    "{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}"
    "<assistant>{{ m.content.split('</think>')[-1] }}</assistant>\n"
    "{% else %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_character_tokenizer_preserves_prefixes_and_uses_the_wrapper(tiny):
    enc = encoder(tiny)
    assert preserves_prefix(enc, "47+38+96=?\n<calc>47+38+96</calc>", "<result>181</result>")
    fmt = observation_format(tiny)  # no chat template: the fixed wrapper
    assert (fmt.mode, fmt.prefix, fmt.suffix) == ("wrapper", "<result>", "</result>")


def test_chat_template_delta_or_fallback(tiny):
    tok = copy.deepcopy(tiny)
    tok.chat_template = PRESERVING
    assert template_delta(tok) == ("</assistant>\n", "<tool>", "</tool>\n<assistant>")
    fmt = observation_format(tok)
    assert fmt.mode == "template"
    ids, _ = fmt.encode(encoder(tok), "181", TrajectoryLimits(), close_turn=True)
    assert tok.decode(ids) == "</assistant>\n<tool>181</tool>\n<assistant>"
    tok.chat_template = STRIPPING
    assert template_delta(tok) is None  # the history changed: not prefix-preserving
    fmt = observation_format(tok, fallback=("<tool>", "</tool>\n<assistant>"))
    assert (fmt.mode, fmt.prefix) == ("wrapper", "<tool>")
    tok.chat_template = "{{ raise_exception('no tools') }}"
    assert observation_format(tok).mode == "wrapper"


@pytest.fixture(scope="module")
def bpe():
    """A BPE tokenizer trained here on calculator transcripts: merges cross the seam between
    a call and its result ("</calc><result>"), as real BPE vocabularies merge across text."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, trainers

    from pivot_hpc.models.tokenizer import CHARS

    corpus = [
        f"{a}+{b}=?\n<calc>{a}+{b}</calc><result>{a + b}</result>Answer: {a + b}"
        for a in range(10, 100, 3)
        for b in range(11, 99, 7)
    ]
    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.decoder = decoders.Fuse()  # no pre-tokenizer: merges may cross anything
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>"], initial_alphabet=list(CHARS), show_progress=False
    )
    tok.train_from_iterator(corpus, trainer)
    return tok


def test_bpe_observations_are_appended_as_ids_never_re_encoded(bpe):
    enc = lambda text: bpe.encode(text).ids  # noqa: E731
    prompt, call_text = "47+38+96=?\n", "<calc>47+38+96</calc>"
    # The policy sampled the call one character at a time: a valid tokenisation, not the
    # one encode() gives (merges exist), exactly what re-encoding would destroy.
    generated = [bpe.token_to_id(c) for c in call_text]
    assert enc(call_text) != generated and len(enc(call_text)) < len(generated)
    t = Trajectory(1, enc(prompt), TrajectoryLimits(max_context_tokens=200))
    t.add_generation(generated, [-1.0] * len(generated))
    t.park(call())
    obs, _ = WRAPPER.encode(enc, "181", t.limits)
    t.add_observation(obs)
    t.add_generation(enc("Answer: 181"))
    t.finish()

    # the context is the ids as sampled and appended, never re-derived from text ...
    assert t.context_ids() == [*enc(prompt), *generated, *obs, *enc("Answer: 181")]
    text = bpe.decode(t.context_ids())
    assert text == prompt + call_text + "<result>181</result>Answer: 181"
    # ... which re-encoding the text would have changed
    assert enc(text) != t.context_ids()
    # every observation token is masked out, every sampled token trained
    mask = t.loss_mask()
    assert sum(mask) == len(generated) + len(enc("Answer: 181"))
    assert mask[len(generated) : len(generated) + len(obs)] == [0] * len(obs)
    # and with merges across the seam, the text view does not preserve the prefix: the
    # reason observations are encoded on their own and appended
    assert not preserves_prefix(enc, prompt + call_text, "<result>181</result>")
