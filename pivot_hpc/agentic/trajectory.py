"""Multi-turn trajectories, token in / token out.

A trajectory is its prompt's token ids, then segments: the tokens the policy generated in
a turn ("gen", in the loss) and the tokens of a tool's observation ("obs", masked out).
Each next turn's prompt is `context_ids()`, the ids exactly as they were generated or
appended: generated tokens are never decoded and re-encoded (BPE is not a bijection, and
re-encoding would train the policy on tokens it did not sample). Only an observation is
encoded, on its own (`ObservationFormat.encode`), and appended as ids.

States: "gen" (a turn to generate), "parked" (waiting on a tool call: no running slot),
"done" (answered), "truncated" (a limit ended it), "failed" (cannot continue: excluded
from training, its group resampled). The loss mask is derived from the segments, never
stored. `to_dict`/`from_dict` give plain JSON-able data for checkpoints, parked state
included; `resume_action` is the rule applied to each trajectory on resume.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pivot_hpc.agentic.tools import RESULT_CLOSE, RESULT_OPEN, history_problem

Kind = Literal["gen", "obs"]
State = Literal["gen", "parked", "done", "truncated", "failed"]
Side = Literal["left", "right"]
STATES: tuple[State, ...] = ("gen", "parked", "done", "truncated", "failed")
FORMAT = 1  # version of to_dict's layout
# A stateful tool's history: the calls of it that it answered, with a value or a refusal; a
# call that did not finish (timeout, crash, memory or output limit, unavailable) is left out
ANSWERED = ("ok", "error")

Encode = Callable[[str], list[int]]


@dataclass(frozen=True, slots=True)
class TrajectoryLimits:
    """`max_turns`: generation turns; `max_context_tokens`: prompt + every segment;
    `max_tool_output_tokens`: one observation; `truncation_side`: the side an observation
    too long is cut from ("right" keeps its beginning, "left" its end)."""

    max_turns: int = 4
    max_context_tokens: int = 512
    max_tool_output_tokens: int = 64
    truncation_side: Side = "right"

    def __post_init__(self) -> None:
        if min(self.max_turns, self.max_context_tokens, self.max_tool_output_tokens) < 1:
            raise ValueError(f"{self}: every limit must be >= 1")
        if self.truncation_side not in ("left", "right"):
            raise ValueError(f"truncation_side {self.truncation_side!r}: 'left' or 'right'")


def truncate(ids: Sequence[int], n: int, side: Side) -> list[int]:
    """`ids` cut to at most `n` tokens, from `side` (the tokenizers' convention)."""
    if len(ids) <= n:
        return list(ids)
    return list(ids[len(ids) - n :]) if side == "left" else list(ids[:n])


@dataclass(slots=True)
class Segment:
    kind: Kind
    token_ids: list[int]
    logprobs: list[float] | None = None  # gen: the rollout's logprob of each token
    version: int | None = None  # gen: the policy version that sampled it
    truncated: bool = False  # obs: cut to max_tool_output_tokens


@dataclass(slots=True)
class CallRecord:
    """A tool call of the trajectory; `status` is None while it is pending."""

    call_id: int
    tool: str
    args_json: str
    idempotent: bool
    replayable: bool
    status: str | None = None
    seconds: float | None = None


@dataclass
class Trajectory:
    traj_id: int
    prompt_ids: list[int]
    limits: TrajectoryLimits = field(default_factory=TrajectoryLimits)
    segments: list[Segment] = field(default_factory=list)
    calls: list[CallRecord] = field(default_factory=list)
    state: State = "gen"
    end_reason: str | None = None  # why it is truncated or failed

    # ------------------------------------------------------------------ views
    @property
    def turns(self) -> int:
        return sum(s.kind == "gen" for s in self.segments)

    @property
    def pending(self) -> CallRecord | None:
        """The call a parked trajectory waits on."""
        if self.state == "parked" and self.calls and self.calls[-1].status is None:
            return self.calls[-1]
        return None

    def history(self, tool: str) -> list[str]:
        """The arguments (`args_json`) of the trajectory's calls of `tool` that it answered
        (`ANSWERED`), in order, the pending one excluded: what a call of a stateful tool
        carries (`ToolCall.history`), its state being their fold."""
        return [c.args_json for c in self.calls if c.tool == tool and c.status in ANSWERED]

    def response_ids(self) -> list[int]:
        return [t for s in self.segments for t in s.token_ids]

    def context_ids(self) -> list[int]:
        """The next turn's prompt: the prompt and every segment, ids as they are."""
        return [*self.prompt_ids, *self.response_ids()]

    def loss_mask(self) -> list[int]:
        """Over `response_ids()`: 1 for generated tokens, 0 for observation tokens."""
        return [int(s.kind == "gen") for s in self.segments for _ in s.token_ids]

    def response_logprobs(self) -> list[float]:
        """Over `response_ids()`: the rollout logprobs of generated tokens; 0.0 where there
        is none (observations carry no logprob; their mask is 0)."""
        out: list[float] = []
        for s in self.segments:
            out += s.logprobs if s.logprobs is not None else [0.0] * len(s.token_ids)
        return out

    def room(self) -> int:
        """Tokens the next turn may generate within max_context_tokens."""
        return max(0, self.limits.max_context_tokens - len(self.prompt_ids) - self._length())

    def _length(self) -> int:
        return sum(len(s.token_ids) for s in self.segments)

    # ------------------------------------------------------------------ transitions
    def add_generation(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[float] | None = None,
        version: int | None = None,
    ) -> None:
        """Append one generated turn (its tokens as the engine returned them)."""
        self._expect("gen")
        if logprobs is not None and len(logprobs) != len(token_ids):
            raise ValueError("add_generation: one logprob per token")
        if len(token_ids) > self.room():
            raise ValueError(f"add_generation: {len(token_ids)} tokens, room for {self.room()}")
        self.segments.append(
            Segment("gen", list(token_ids), None if logprobs is None else list(logprobs), version)
        )

    def park(self, call: CallRecord) -> bool:
        """The turn just generated calls a tool: wait on `call`. False (and the trajectory
        ends truncated) when no further turn is allowed, so the call is not run."""
        self._expect("gen")
        if not self._may_continue():
            return False
        call.status, call.seconds = None, None
        self.calls.append(call)
        self.state = "parked"
        return True

    def add_observation(
        self, token_ids: Sequence[int], status: str = "ok", seconds: float | None = None
    ) -> bool:
        """Append the pending call's observation (already encoded, ObservationFormat.encode)
        and return to "gen". A longer one than max_tool_output_tokens is cut here too. When
        it leaves no room for another token the trajectory ends truncated and the
        observation is not appended: False."""
        self._expect("parked")
        pending = self.pending
        assert pending is not None
        pending.status, pending.seconds = status, seconds
        return self._append_observation(token_ids)

    def add_refusal(self, token_ids: Sequence[int]) -> bool:
        """The turn just generated made a call that cannot run (tools.Refusal): append the
        refusal's observation at once, under the same limits as a call's; nothing is
        parked. False when the trajectory ended truncated instead."""
        self._expect("gen")
        return self._may_continue() and self._append_observation(token_ids)

    def _may_continue(self) -> bool:
        """After a generated turn: whether another turn is allowed (else: truncated)."""
        if not self.segments or self.segments[-1].kind != "gen":
            raise ValueError("an observation follows a generated turn")
        if self.turns >= self.limits.max_turns:
            self._end("truncated", "max_turns")
            return False
        if self.room() == 0:
            self._end("truncated", "max_context_tokens")
            return False
        return True

    def _append_observation(self, token_ids: Sequence[int]) -> bool:
        ids = truncate(token_ids, self.limits.max_tool_output_tokens, self.limits.truncation_side)
        if len(ids) >= self.room():
            self._end("truncated", "max_context_tokens")
            return False
        self.segments.append(Segment("obs", ids, truncated=len(ids) < len(token_ids)))
        self.state = "gen"
        return True

    def finish(self, truncated: bool = False, reason: str | None = None) -> None:
        """The last turn answered (or hit its length limit: `truncated`)."""
        self._expect("gen")
        self._end("truncated" if truncated else "done", reason)

    def fail(self, reason: str) -> None:
        self._end("failed", reason)

    def _end(self, state: State, reason: str | None) -> None:
        self.state, self.end_reason = state, reason

    def _expect(self, state: State) -> None:
        if self.state != state:
            raise ValueError(f"trajectory {self.traj_id} is {self.state}, not {state}")

    # ------------------------------------------------------------------ plain data
    def to_dict(self) -> dict[str, Any]:
        """JSON-able plain data (lists, dicts, numbers, strings) for a checkpoint."""
        return {
            "format": FORMAT,
            "traj_id": self.traj_id,
            "prompt_ids": list(self.prompt_ids),
            "limits": {
                "max_turns": self.limits.max_turns,
                "max_context_tokens": self.limits.max_context_tokens,
                "max_tool_output_tokens": self.limits.max_tool_output_tokens,
                "truncation_side": self.limits.truncation_side,
            },
            "segments": [
                {
                    "kind": s.kind,
                    "token_ids": list(s.token_ids),
                    "logprobs": None if s.logprobs is None else list(s.logprobs),
                    "version": s.version,
                    "truncated": s.truncated,
                }
                for s in self.segments
            ],
            "calls": [
                {
                    "call_id": c.call_id,
                    "tool": c.tool,
                    "args_json": c.args_json,
                    "idempotent": c.idempotent,
                    "replayable": c.replayable,
                    "status": c.status,
                    "seconds": c.seconds,
                }
                for c in self.calls
            ],
            "state": self.state,
            "end_reason": self.end_reason,
        }

    @classmethod
    def from_dict(cls, data: Any) -> Trajectory:
        """Rebuild from `to_dict`'s data; ValueError (one line) on anything malformed —
        checkpoint files are input, never trusted."""
        d = _Reader(data, "trajectory")
        if d.integer("format") != FORMAT:
            raise ValueError(f"trajectory: format {data.get('format')!r}, expected {FORMAT}")
        lim = _Reader(d.get("limits"), "trajectory.limits")
        side = lim.get("truncation_side")
        if side not in ("left", "right"):
            raise ValueError(f"trajectory.limits.truncation_side: {side!r}")
        limits = TrajectoryLimits(
            max_turns=lim.integer("max_turns"),
            max_context_tokens=lim.integer("max_context_tokens"),
            max_tool_output_tokens=lim.integer("max_tool_output_tokens"),
            truncation_side=side,
        )
        segments = []
        for i, raw in enumerate(d.items("segments")):
            s = _Reader(raw, f"trajectory.segments[{i}]")
            kind = s.get("kind")
            if kind not in ("gen", "obs"):
                raise ValueError(f"trajectory.segments[{i}].kind: {kind!r}")
            ids = s.ids("token_ids")
            logprobs = s.optional_floats("logprobs")
            if logprobs is not None and (kind != "gen" or len(logprobs) != len(ids)):
                raise ValueError(f"trajectory.segments[{i}].logprobs: one per generated token")
            segments.append(
                Segment(kind, ids, logprobs, s.optional_int("version"), s.boolean("truncated"))
            )
        calls = []
        for i, raw in enumerate(d.items("calls")):
            c = _Reader(raw, f"trajectory.calls[{i}]")
            seconds = c.get("seconds")
            if seconds is not None and not _is_number(seconds):
                raise ValueError(f"trajectory.calls[{i}].seconds: {seconds!r}")
            calls.append(
                CallRecord(
                    c.integer("call_id"),
                    c.string("tool"),
                    c.string("args_json"),
                    c.boolean("idempotent"),
                    c.boolean("replayable"),
                    c.optional_str("status"),
                    seconds,
                )
            )
        state = d.get("state")
        if state not in STATES:
            raise ValueError(f"trajectory.state: {state!r}")
        traj = cls(
            d.integer("traj_id"),
            d.ids("prompt_ids"),
            limits,
            segments,
            calls,
            state,
            d.optional_str("end_reason"),
        )
        if (state == "parked") != (traj.pending is not None) or any(
            c.status is None for c in calls[: -1 if state == "parked" else None]
        ):
            raise ValueError("trajectory: a pending call exactly when parked")
        return traj


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


class _Reader:
    """Typed access to one mapping of checkpoint data, naming the key on failure."""

    def __init__(self, data: Any, where: str) -> None:
        if not isinstance(data, Mapping):
            raise ValueError(f"{where}: expected a mapping")
        self.data, self.where = data, where

    def get(self, key: str) -> Any:
        if key not in self.data:
            raise ValueError(f"{self.where}.{key}: missing")
        return self.data[key]

    def _bad(self, key: str, what: str) -> ValueError:
        return ValueError(f"{self.where}.{key}: expected {what}")

    def integer(self, key: str) -> int:
        v = self.get(key)
        if not isinstance(v, int) or isinstance(v, bool):
            raise self._bad(key, "an integer")
        return v

    def optional_int(self, key: str) -> int | None:
        return None if self.get(key) is None else self.integer(key)

    def boolean(self, key: str) -> bool:
        v = self.get(key)
        if not isinstance(v, bool):
            raise self._bad(key, "true or false")
        return v

    def string(self, key: str) -> str:
        v = self.get(key)
        if not isinstance(v, str):
            raise self._bad(key, "a string")
        return v

    def optional_str(self, key: str) -> str | None:
        return None if self.get(key) is None else self.string(key)

    def items(self, key: str) -> list[Any]:
        v = self.get(key)
        if not isinstance(v, list):
            raise self._bad(key, "a list")
        return v

    def ids(self, key: str) -> list[int]:
        v = self.items(key)
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v):
            raise self._bad(key, "a list of token ids")
        return list(v)

    def optional_floats(self, key: str) -> list[float] | None:
        v = self.get(key)
        if v is None:
            return None
        if not isinstance(v, list) or not all(_is_number(x) and not math.isnan(x) for x in v):
            raise self._bad(key, "a list of numbers")
        return [float(x) for x in v]


# ---------------------------------------------------------------------- resume rule
ResumeAction = Literal["keep", "continue", "reissue", "replay", "drop"]


def resume_action(traj: Trajectory) -> ResumeAction:
    """What resuming from a checkpoint does with `traj`:

    - "keep": it is over (done or truncated): its tokens and reward stand;
    - "continue": a turn was being generated: it is generated again from the context
      (the runtime re-prefills it, as it does any in-flight sequence);
    - "reissue": parked on an idempotent call: the call is simply issued again;
    - "replay": parked on a call of a stateful tool (replayable, not idempotent): the
      call is issued again with its history (`replay_history`), the trajectory's earlier
      calls of that tool, which the call's sandbox child re-runs first — as every call of
      that tool does, so the observation is the one an uninterrupted run gets;
    - "drop": parked on a call that is neither, or failed: the trajectory cannot continue
      and its group is resampled (`resume_group`)."""
    if traj.state in ("done", "truncated"):
        return "keep"
    if traj.state == "gen":
        return "continue"
    pending = traj.pending
    if traj.state == "failed" or pending is None:
        return "drop"
    if pending.idempotent:
        return "reissue"
    if pending.replayable:
        return "replay"
    return "drop"


def calls_to_issue(traj: Trajectory) -> list[CallRecord]:
    """The calls resuming `traj` runs, in order (the last one's result is appended): the
    pending call, after its tool's history when it replays (all in one sandbox child)."""
    action = resume_action(traj)
    pending = traj.pending
    if pending is None or action not in ("reissue", "replay"):
        return []
    if action == "reissue":
        return [pending]
    earlier = [c for c in traj.calls[:-1] if c.tool == pending.tool and c.status in ANSWERED]
    return [*earlier, pending]


def replay_history(traj: Trajectory) -> tuple[str, ...]:
    """The history a parked `traj`'s pending call of a stateful tool carries when it is
    issued again on resume (`Trajectory.history`). ValueError, one line, when the saved
    trajectory cannot rebuild it: not parked on such a call, an earlier call's arguments
    that are not a JSON object, or more than a call may carry (tools.MAX_HISTORY_*)."""
    pending = traj.pending
    if pending is None or resume_action(traj) != "replay":
        raise ValueError(f"trajectory {traj.traj_id} is not parked on a replayable call")
    history = traj.history(pending.tool)
    for i, past in enumerate(history):
        try:
            ok = isinstance(json.loads(past), dict)
        except (ValueError, RecursionError):
            ok = False
        if not ok:
            raise ValueError(f"the arguments of its earlier call {i} are not a JSON object")
    why = history_problem(pending.tool, history)
    if why is not None:
        raise ValueError(why)
    return tuple(history)


@dataclass(frozen=True, slots=True)
class GroupResume:
    """`resample`: the group's prompt is sampled again from scratch (a GRPO group's
    advantages need all its samples); `actions`: each trajectory's resume action; `why`:
    the reason, in a few words, when it is resampled."""

    resample: bool
    actions: tuple[ResumeAction, ...]
    why: str | None = None


def resume_group(group: Iterable[Trajectory], *, can_replay: bool = False) -> GroupResume:
    """The resume rule of one GRPO group: resampled when a trajectory of it cannot
    continue — "drop"; "replay" where the runtime cannot replay (`can_replay` False) or
    the saved trajectory cannot rebuild its history (`replay_history`). A group of kept,
    continued, reissued and replayed trajectories stays.

    The live runtime replays (runtime/live_turns.py): no tool process keeps state between
    calls — each call of a stateful tool carries its history and its fresh child re-runs
    it — so a resumed call is issued again exactly as it first was, on any node. A tool
    neither idempotent nor replayable cannot be: re-running its call would repeat its side
    effects, and resampling the group is correct whatever the tool does."""
    trajs = list(group)
    actions = tuple(resume_action(t) for t in trajs)
    for traj, action in zip(trajs, actions, strict=True):
        if action == "drop" or (action == "replay" and not can_replay):
            return GroupResume(True, actions, _why(traj, action))
        if action == "replay":
            try:
                replay_history(traj)
            except ValueError as exc:
                tool = traj.calls[-1].tool
                why = f"trajectory {traj.traj_id} waits on tool {tool!r}, whose state "
                return GroupResume(True, actions, why + f"cannot be rebuilt ({exc})")
    return GroupResume(False, actions)


def _why(traj: Trajectory, action: ResumeAction) -> str:
    pending = traj.pending
    if pending is None:  # failed (or parked without a pending call: malformed)
        return f"trajectory {traj.traj_id} {traj.state} ({traj.end_reason or 'no reason given'})"
    if action == "replay":
        return (
            f"trajectory {traj.traj_id} waits on tool {pending.tool!r}, which is not "
            "idempotent, and this runtime does not replay calls"
        )
    return (
        f"trajectory {traj.traj_id} waits on tool {pending.tool!r}, which is neither "
        "idempotent nor replayable"
    )


# ---------------------------------------------------------------------- observations
@dataclass(frozen=True, slots=True)
class ObservationFormat:
    """How an observation's text becomes tokens: `turn_end` (what the chat template writes
    after an assistant message, for a turn that stopped on a stop string rather than the
    end-of-turn token), `prefix`, the body, `suffix`, each encoded on its own and
    concatenated. "wrapper" mode: a fixed wrapper (the tiny default: <result>…</result>);
    "template" mode: the chat template's own tool-message delta (`observation_format`)."""

    prefix: str
    suffix: str
    turn_end: str = ""
    mode: Literal["wrapper", "template"] = "wrapper"

    def encode(
        self, encode: Encode, body: str, limits: TrajectoryLimits, close_turn: bool = False
    ) -> tuple[list[int], bool]:
        """(the observation's ids, whether the body was cut): the wrapper is kept whole
        and the body cut to fit max_tool_output_tokens from limits.truncation_side."""
        head = _enc(encode, (self.turn_end if close_turn else "") + self.prefix)
        tail = _enc(encode, self.suffix)
        body_ids = _enc(encode, body)
        budget = max(0, limits.max_tool_output_tokens - len(head) - len(tail))
        kept = truncate(body_ids, budget, limits.truncation_side)
        return [*head, *kept, *tail], len(kept) < len(body_ids)


def _enc(encode: Encode, text: str) -> list[int]:
    return list(encode(text)) if text else []


def encoder(tok: Any) -> Encode:
    """A Hugging Face tokenizer's encode, without special tokens added."""
    return lambda text: list(tok.encode(text, add_special_tokens=False))


def preserves_prefix(encode: Encode, context: str, delta: str) -> bool:
    """Whether encode(context + delta) starts with encode(context): appending the delta's
    own ids then gives the same context tokens a text-based server would see."""
    base = encode(context)
    return encode(context + delta)[: len(base)] == base


SENTINEL = "@@OBSERVATION@@"
SAMPLE_CHAT: tuple[dict[str, str], ...] = (
    {"role": "user", "content": "What is 47+38+96?"},
    # reasoning in the assistant message: templates that strip it from earlier turns
    # (Qwen3's) rewrite the history once a message follows, which the check must see
    {"role": "assistant", "content": "<think>add them</think><calc>47+38+96</calc>"},
)


def template_delta(
    tok: Any, messages: Sequence[Mapping[str, str]] = SAMPLE_CHAT, tool_role: str = "tool"
) -> tuple[str, str, str] | None:
    """(turn_end, prefix, suffix) of the tokenizer's chat template around a tool message
    appended to `messages` (ending with an assistant message), or None when the template
    does not preserve prefixes: rendering the longer conversation rewrites the shorter one
    (e.g. templates that strip earlier reasoning), or its tokens differ at the seam."""
    chat = [dict(m) for m in messages]
    try:
        base = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=False)
        full = tok.apply_chat_template(
            [*chat, {"role": tool_role, "content": SENTINEL}],
            tokenize=False,
            add_generation_prompt=True,
        )
    except Exception:  # no template, no tool role, a template error: not usable
        return None
    if not isinstance(base, str) or not isinstance(full, str) or not full.startswith(base):
        return None
    delta = full[len(base) :]
    if delta.count(SENTINEL) != 1:
        return None
    prefix, suffix = delta.split(SENTINEL)
    last = chat[-1]["content"]
    at = base.rfind(last)
    turn_end = base[at + len(last) :] if at >= 0 else ""
    if not preserves_prefix(encoder(tok), base, prefix + "181" + suffix):
        return None
    return turn_end, prefix, suffix


def observation_format(
    tok: Any, fallback: tuple[str, str] = (RESULT_OPEN, RESULT_CLOSE)
) -> ObservationFormat:
    """The format to use with `tok`: its chat template's tool-message delta when it has a
    template that preserves prefixes (checked once, at start), else the fixed `fallback`
    wrapper (the tiny default has no template: <result>…</result>)."""
    if getattr(tok, "chat_template", None):
        found = template_delta(tok)
        if found is not None:
            turn_end, prefix, suffix = found
            return ObservationFormat(prefix, suffix, turn_end, "template")
    return ObservationFormat(*fallback)
