"""Live multi-turn trajectories: the `TurnSource` side of `LiveSamples` (coordinator/turns.py).

Token in / token out (agentic/trajectory.py): each turn's generated ids are appended as
the engine returned them; only a tool's observation is encoded, on its own, and appended
as ids. A turn's text is decoded only to read the call it ends with.

Where a turn stops. The engines run without a tokenizer (token ids in and out: sglang and
vllm refuse stop strings), so a turn is not stopped at its call's closing tag by a stop
string. Where a closing tag is one token (a chat model's `</tool_call>`), it is a stop
token id; otherwise (the tiny character-level tokenizer) the turn runs on to its end of
sequence and is cut here, right after the first call's closing tag: the tokens kept are
the ones sampled, in order, so their logprobs stand; what followed is dropped unseen.

A call of a stateful tool (replayable, not idempotent) carries the trajectory's earlier
calls of it (`Trajectory.history`), which its sandbox child re-runs first; one that would
carry more than tools.MAX_HISTORY_* is refused with an observation instead. On resume
such a parked call is issued again with the same history (`resume_call`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from pivot_hpc.agentic.config import ToolsConfig
from pivot_hpc.agentic.messages import ToolResult
from pivot_hpc.agentic.tools import Refusal, build_registry, history_refusal, observation_body
from pivot_hpc.agentic.trajectory import (
    CallRecord,
    Trajectory,
    encoder,
    observation_format,
    replay_history,
    resume_action,
    resume_group,
)
from pivot_hpc.coordinator.rl_state import ConservationError, Sample
from pivot_hpc.coordinator.turns import Turn
from pivot_hpc.engines.base import SamplingParams, SeqResult
from pivot_hpc.runtime.live_payload import LivePayload


class LiveTurns:
    """Mixed into LiveSamples (which provides `tok`, `cfg`, `rollout_sampling`, `text`)."""

    tok: Any
    rollout_sampling: SamplingParams

    def setup_turns(self, tools: ToolsConfig | None) -> None:
        self.tools = tools if tools is not None and tools.enabled else None
        if self.tools is None:
            return
        self.registry = build_registry(self.tools.tools)
        self.limits = self.tools.trajectory_limits()
        self.fmt = observation_format(self.tok)  # checked once: the template's delta or not
        self.encode = encoder(self.tok)
        closes = self.registry.stop_strings()
        # a closing tag that is one token stops the turn in the engine; others are cut here
        single = [ids[0] for c in closes if len(ids := self.encode(c)) == 1]
        self.turn_sampling = dataclasses.replace(
            self.rollout_sampling,
            stop_token_ids=tuple(dict.fromkeys([*self.rollout_sampling.stop_token_ids, *single])),
        )
        opens = [f"<{c[2:]}" for c in closes]
        self._open = re.compile("|".join(re.escape(o) for o in opens))
        self._close = dict(zip(opens, closes, strict=True))

    def new_trajectory(self, sample_id: int, prompt_ids: list[int]) -> Trajectory | None:
        if self.tools is None:
            return None
        return Trajectory(sample_id, list(prompt_ids), self.limits)

    # ------------------------------------------------------------ a turn's sequence
    def rollout_turn(self, s: Sample) -> tuple[list[int], SamplingParams]:
        """The prompt and sampling of `s`'s current rollout turn (LiveCluster.start)."""
        pl: LivePayload = s.payload
        if pl.traj is None:
            return pl.prompt_ids, self.rollout_sampling
        room = pl.traj.room()
        cap = max(1, min(self.rollout_sampling.max_tokens, room))
        return pl.traj.context_ids(), dataclasses.replace(self.turn_sampling, max_tokens=cap)

    # ------------------------------------------------------------ TurnSource
    def turn(self, s: Sample, generated: int, result: SeqResult, call_id: int) -> Turn:
        traj: Trajectory = s.payload.traj
        ids, lps = list(result.token_ids), list(result.logprobs)
        end = self._call_end(ids)
        if end is not None:  # the call closes the turn; what the engine made after it goes
            ids, lps = ids[:end], lps[:end]
        if len(ids) > traj.room():  # (the engine was capped at room(): a guard)
            ids, lps = ids[: traj.room()], lps[: traj.room()]
        traj.add_generation(ids, lps, result.version)
        parsed = self.registry.parse_call(self.text(ids))
        if parsed is None:
            traj.finish(truncated=result.finish_reason == "length")
            return Turn("done")
        history: tuple[str, ...] = ()
        if not isinstance(parsed, Refusal) and parsed.stateful:
            history = tuple(traj.history(parsed.tool))
            parsed = history_refusal(parsed.tool, history) or parsed
        if isinstance(parsed, Refusal):  # the model sees why and goes on
            obs, _ = self.fmt.encode(self.encode, parsed.body, traj.limits, close_turn=True)
            if traj.add_refusal(obs):
                return Turn("again", context=len(traj.context_ids()))
            return Turn("done")  # a limit ended it (truncated)
        call = CallRecord(
            call_id, parsed.tool, parsed.args_json, parsed.idempotent, parsed.replayable
        )
        if not traj.park(call):
            return Turn("done")  # no turn left to read the result: truncated, not run
        return Turn("call", tool=parsed.tool, args_json=parsed.args_json, history=history)

    def observe(self, s: Sample, result: ToolResult) -> int | None:
        traj: Trajectory = s.payload.traj
        body = observation_body(result)
        ids, _ = self.fmt.encode(self.encode, body, traj.limits, close_turn=True)
        if not traj.add_observation(ids, result.status, result.seconds):
            return None
        return len(traj.context_ids())

    def resample_reason(self, group: list[Sample]) -> str | None:
        """Resume from a checkpoint: why the GRPO group `group` (one prompt's samples) must
        be sampled again from scratch, or None when every trajectory of it can go on
        (`resume_group`: a call pending on a tool neither idempotent nor replayable, a
        stateful tool's call whose history the saved trajectory cannot rebuild, or a
        failed trajectory; also a stateful call whose tool this run does not declare
        stateful: there is no program to replay it)."""
        trajs = [x.payload.traj for x in group if x.payload.traj is not None]
        decision = resume_group(trajs, can_replay=True)
        if decision.why is not None:
            return decision.why
        for traj, action in zip(trajs, decision.actions, strict=True):
            if action != "replay":
                continue
            tool = traj.calls[-1].tool
            spec = self.registry.get(tool)
            if spec is None or not spec.stateful:
                now = "does not declare it" if spec is None else "declares it stateless"
                return (
                    f"trajectory {traj.traj_id} waits on tool {tool!r}, whose calls "
                    f"cannot be replayed: this run {now}"
                )
        return None

    def resume_call(self, s: Sample, call_id: int) -> Turn | None:
        """Resume from a checkpoint: the call a parked trajectory issues again, renumbered
        `call_id` (None: not parked): an idempotent call as it was, a stateful tool's with
        its history (`replay_history`), as it first went. The group of any other was
        sampled again before (`resample_reason`), so one here is a bug."""
        traj: Trajectory | None = s.payload.traj
        if traj is None or traj.state != "parked":
            return None
        action = resume_action(traj)
        history: tuple[str, ...] = ()
        try:
            if action == "replay":
                history = replay_history(traj)
            elif action != "reissue":
                raise ValueError("neither idempotent nor replayable")
        except ValueError as exc:
            raise ConservationError(
                f"sample {s.sample_id} resumed waiting on tool {traj.calls[-1].tool!r} "
                f"({action}: {exc}), but its group was not sampled again"
            ) from None
        pending = traj.pending
        assert pending is not None
        pending.call_id = call_id
        return Turn("call", tool=pending.tool, args_json=pending.args_json, history=history)

    def response_len(self, s: Sample) -> int:
        return len(s.payload.traj.response_ids())

    # ------------------------------------------------------------ rewards, training
    def trajectory_result(self, s: Sample) -> SeqResult:
        """The whole trajectory as one response: every token after the prompt, with 0.0
        logprobs at observation tokens (their loss mask is 0)."""
        traj: Trajectory = s.payload.traj
        versions = [g.version for g in traj.segments if g.kind == "gen" and g.version is not None]
        return SeqResult(
            s.sample_id,
            list(traj.prompt_ids),
            traj.response_ids(),
            traj.response_logprobs(),
            "length" if traj.state == "truncated" else "stop",
            versions[-1] if versions else 0,
        )

    def answer_ids(self, pl: LivePayload) -> list[int]:
        """What the verifiable reward reads: the final answer — a trajectory's last turn
        (after its last observation); a one-turn response whole."""
        if pl.traj is None:
            return list(pl.response.token_ids)
        gens = [g for g in pl.traj.segments if g.kind == "gen"]
        return list(gens[-1].token_ids) if gens else []

    def _call_end(self, ids: list[int]) -> int | None:
        """Tokens up to and including the first call's closing tag (None: no closed call)."""
        text = self.text(ids)
        opened = self._open.search(text)
        if opened is None:
            return None
        close = self._close[opened.group(0)]
        at = text.find(close, opened.end())
        if at < 0:
            return None
        need = at + len(close)
        lo, hi = 1, len(ids)  # the fewest tokens whose text reaches past the tag
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self.text(ids[:mid])) >= need:
                hi = mid
            else:
                lo = mid + 1
        return lo
