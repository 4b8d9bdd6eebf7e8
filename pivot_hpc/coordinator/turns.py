"""The coordinator's turn loop for tool-calling rollouts (issue 37, docs/guide/agentic.md).

A trajectory is one sample; each of its turns is an ordinary rollout sequence whose prompt
is the context so far (the engine contract does not change). When a turn finishes, the
sample source — which holds the tokens: `LiveSamples` live, the synthetic workload in the
simulator — appends it to the sample's trajectory and says what it did (`Turn`):

- "done": no call, or a limit ended the trajectory: it goes on to the reward role as a
  one-turn rollout does;
- "again": a call that cannot run (a `Refusal`): its observation is appended at once and
  the next turn is queued;
- "call": the trajectory parks. It leaves the rollout scheduler — no running slot, no KV
  reserved, nothing to abort if replicas shift meanwhile — and its `ToolCall` goes to the
  cluster (a node's sandbox service, or a simulated latency). When the `ToolReturned`
  event comes back, the source appends the observation and the next turn is queued; an
  observation that leaves no room ends the trajectory (truncated).

Prefix affinity: the next turn of a trajectory (after a call or a refusal) prefers the
replica its last turn ran on, which caches its context so far (`SeqState.affinity`, the
scheduler's `affinity_slack`; a full one it waits for up to `affinity_wait_s` from its
submit here): placed there it prefills only the observation. The live vLLM engine reuses
that cache by its automatic prefix caching, the simulator models it; the hf engine has
no prefix cache (the preference then costs nothing and saves nothing).
Moving a parked trajectory needs no abort, only a longer prefill next turn; the planner's
φ counts that prefill for trajectories due back within H (`prefix_due`).

Accounting: the sample is rolled out once, when its trajectory ends (`RLState.rollout_done`
with the whole response, generated and observation tokens: what training sees); each
turn's generated tokens count toward the step's rollout tokens when the turn finishes;
`version_start` is set by the first turn only, so staleness is the trajectory's.

Telemetry: a `tool_calls` row per answered call (its parked wait) and a `turns` row per
finished turn: how long it was queued (submit to first dispatch: the coordinator tells the
loop of both, `queued`/`dispatched`) and generated (first dispatch to finish, migrations
included). The loop holds two times per turn in flight, dropped when the turn finishes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pivot_hpc.agentic.messages import ToolCall, ToolResult
from pivot_hpc.coordinator.events import SequenceFinished, ToolReturned
from pivot_hpc.coordinator.rl_state import ConservationError, Sample
from pivot_hpc.coordinator.tool_waits import ToolWaits
from pivot_hpc.errors import PivotError
from pivot_hpc.scheduler import SeqState

if TYPE_CHECKING:
    from pivot_hpc.coordinator.rl_state import RLState


class TurnHost(Protocol):
    """What the turn loop uses of the coordinator that runs it (a narrow view: the loop
    knows nothing else of it): the role schedulers, the cluster, telemetry, and dispatch."""

    schedulers: dict[str, Any]  # role -> its shift-aware scheduler
    cluster: Any  # the coordinator's Cluster (coordinator/cluster.py)
    telemetry: Any  # the run's telemetry writer

    def dispatch(self, role: str) -> None: ...


TurnKind = Literal["done", "again", "call"]


@dataclass(frozen=True, slots=True)
class Turn:
    """What a finished turn did. `context`: the next turn's context length ("again");
    `tool`/`args_json`: the call to run ("call"), `history` the arguments of the
    trajectory's earlier calls of that tool when it is stateful (`ToolCall.history`)."""

    kind: TurnKind
    context: int = 0
    tool: str = ""
    args_json: str = ""
    history: tuple[str, ...] = ()


class TurnSource(Protocol):
    """What a sample source adds for tool-calling rollouts (LiveSamples, SimWorkload)."""

    def turn(self, s: Sample, generated: int, result: Any, call_id: int) -> Turn:
        """Append the turn that just finished to `s`'s trajectory; a call, if it makes
        one, is `call_id`."""
        ...

    def observe(self, s: Sample, result: ToolResult) -> int | None:
        """Append the pending call's observation; the next turn's context length, or None
        when the trajectory ended (no room left)."""
        ...

    def response_len(self, s: Sample) -> int:
        """Tokens of the trajectory after its prompt (turns and observations)."""
        ...


def check_turn_source(source: object) -> TurnSource:
    missing = [m for m in ("turn", "observe", "response_len") if not hasattr(source, m)]
    if missing:
        raise PivotError(
            f"tools.enabled=true but the sample source {type(source).__name__} cannot run "
            f"multi-turn rollouts (no {', '.join(missing)}); set tools.enabled=false"
        )
    return source  # type: ignore[return-value]


@dataclass(slots=True)
class Parked:
    """A trajectory waiting on a tool call. `rid`: the replica its last turn ran on, `idx`
    its scheduler position then (that incarnation of it; -1: none, e.g. resumed from a
    checkpoint), `prefix`: the context tokens it caches there (the last turn's length at
    its end) — the next turn's soft affinity."""

    sample: Sample
    since: float
    tool: str
    rid: str
    idx: int = -1
    prefix: int = 0


@dataclass
class ToolStats:
    """Counters for the summaries (`pivot-hpc simulate`; the report reads telemetry)."""

    turns: int = 0  # rollout turns finished
    calls: int = 0  # tool calls issued
    results: int = 0  # … and answered
    refusals: int = 0  # calls that could not run (their observation appended at once)
    wait_s: float = 0.0  # summed seconds from a call's issue to its result
    statuses: dict[str, int] = field(default_factory=dict)  # results by ToolResult status
    trajectories: int = 0  # trajectories whose rollout ended
    with_calls: int = 0  # … of which called a tool at least once

    @property
    def wait_s_mean(self) -> float | None:
        return self.wait_s / self.results if self.results else None

    @property
    def trajectory_share(self) -> float | None:
        return self.with_calls / self.trajectories if self.trajectories else None


class TurnLoop:
    """The coordinator's part of multi-turn rollouts (see the module docstring).
    `rolled_out(s, response_len, result)` is the coordinator's path for a finished
    rollout (reward next)."""

    def __init__(
        self,
        coord: TurnHost,
        source: object,
        *,
        call_timeout_s: float,
        rolled_out: Callable[[Sample, int, Any], None],
        horizon_s: float = 0.0,
    ) -> None:
        self.coord = coord
        self.source = check_turn_source(source)
        self.call_timeout_s = call_timeout_s
        self.rolled_out = rolled_out
        self.parked: dict[int, Parked] = {}  # call id -> the trajectory waiting on it
        self.stats = ToolStats()
        self._next_call = 0
        self.horizon_s = horizon_s  # the planner's H: parked work due back within it
        self.waits = ToolWaits()  # answered calls' waits: what a call still out is due
        # sample id -> [submit time, first dispatch time (-1: not yet)] of its turn in
        # flight (queued or running): the `turns` row's split; dropped when it finishes
        self._turn_t: dict[int, list[float]] = {}

    @property
    def n_parked(self) -> int:
        return len(self.parked)

    def _due(self, p: Parked, now: float, horizon_s: float) -> bool:
        """Whether `p`'s call is expected back within `horizon_s` of `now`, given how long
        it has waited already (tool_waits.py)."""
        return self.waits.remaining(p.tool, now - p.since) <= horizon_s

    def due_within(self, now: float, horizon_s: float) -> int:
        """Parked trajectories whose call is expected back within `horizon_s` of `now`:
        rollout demand the planner counts (Snapshot.parked_due)."""
        return sum(self._due(p, now, horizon_s) for p in self.parked.values())

    def prefix_due(self, now: float, horizon_s: float) -> dict[str, tuple[int, int]]:
        """Replica -> (trajectories, context tokens it caches for them) of those parked
        with affinity to it and due back within `horizon_s` (Snapshot.parked_prefix: what
        a shift-down of it makes them re-prefill). Only for the incarnation they ran on,
        and empty when the scheduler has no affinity (every returning turn re-prefills
        anyway)."""
        sched = self.coord.schedulers["rollout"]
        if sched.affinity_slack <= 0:
            return {}
        out: dict[str, tuple[int, int]] = {}
        for p in self.parked.values():
            if p.idx < 0 or sched.replicas.get(p.rid) != p.idx:
                continue
            if self._due(p, now, horizon_s):
                n, tok = out.get(p.rid, (0, 0))
                out[p.rid] = (n + 1, tok + p.prefix)
        return out

    def _affinity(self, ev: SequenceFinished) -> int:
        """The scheduler position of the replica a turn ran on (-1: gone by now)."""
        return self.coord.schedulers["rollout"].replicas.get(ev.rid, -1)

    def queued(self, sample_id: int) -> None:
        """A turn's sequence was submitted to the rollout scheduler (the coordinator's
        release, resample and restore; `_queue`): its queued time starts now."""
        self._turn_t[sample_id] = [self.coord.cluster.now(), -1.0]

    def dispatched(self, sample_id: int) -> None:
        """A rollout sequence was started on a replica: the first start of its turn ends
        the queued time (a migration's restart does not)."""
        t = self._turn_t.get(sample_id)
        if t is not None and t[1] < 0:
            t[1] = self.coord.cluster.now()

    def _turn_row(self, s: Sample, ev: SequenceFinished) -> None:
        """The `turns` row of the turn of `s` that `ev` finished (none when its submit or
        dispatch went unseen)."""
        t = self._turn_t.pop(s.sample_id, None)
        if t is None or t[1] < 0:
            return
        self.coord.telemetry.turn(
            ev.t,
            sample_id=s.sample_id,
            turn=s.turn,
            replica=ev.rid,
            queued_s=max(0.0, t[1] - t[0]),
            gen_s=max(0.0, ev.t - t[1]),
            tokens=ev.generated,
            context=s.turn_context,
        )

    def on_turn(self, s: Sample, ev: SequenceFinished) -> bool:
        """A rollout turn of `s` finished (the scheduler has let it go): True when its
        trajectory is over (the caller rolls it out), False when it goes on."""
        self._turn_row(s, ev)
        s.turn += 1
        self.stats.turns += 1
        turn = self.source.turn(s, ev.generated, ev.result, self._next_call)
        if turn.kind == "done":
            self._ended(s)
            return True
        if turn.kind == "again":
            self.stats.refusals += 1
            self._queue(s, turn.context, self._affinity(ev))
            return False
        if turn.kind != "call":
            raise ConservationError(f"sample {s.sample_id}: unknown turn kind {turn.kind!r}")
        s.tool_calls += 1
        self._park(s, turn, ev.rid, self._affinity(ev), ev.length)
        return False

    def _park(self, s: Sample, turn: Turn, rid: str, idx: int = -1, prefix: int = 0) -> None:
        call_id, self._next_call = self._next_call, self._next_call + 1
        self.parked[call_id] = Parked(s, self.coord.cluster.now(), turn.tool, rid, idx, prefix)
        self.stats.calls += 1
        self.coord.cluster.call_tool(
            ToolCall(
                call_id, s.sample_id, turn.tool, turn.args_json, self.call_timeout_s, turn.history
            )
        )

    def resume(self, s: Sample) -> bool:
        """Resume from a checkpoint: when `s` was parked, its pending call is issued again
        (the source's `resume_call`, a "call" Turn, renumbered: an idempotent call is
        simply re-run, a stateful tool's carries its history as it first did) and True."""
        resume_call = getattr(self.source, "resume_call", None)
        call = None if resume_call is None else resume_call(s, self._next_call)
        if call is None:
            return False
        if call.kind != "call":
            raise ConservationError(f"sample {s.sample_id}: resumed with a {call.kind!r} turn")
        self._park(s, call, rid="")
        return True

    def resample_on_resume(self, rl: RLState) -> list[Sample]:
        """Resume from a checkpoint, before `resume`: every GRPO group a trajectory of
        which cannot continue (the source's `resample_reason`: a call pending on a tool
        neither idempotent nor replayable, a stateful tool's call whose history the saved
        trajectory cannot rebuild, or a failed trajectory) is sampled again from scratch
        (`RLState.resample_group`), with one line saying why. Returns the samples dropped:
        none of them is queued, rewarded or trained."""
        reason = getattr(self.source, "resample_reason", None)
        dropped: list[Sample] = []
        if reason is None:  # a source without checkpointed trajectories (the simulator)
            return dropped
        for step in sorted(rl.batches):
            groups: dict[int, list[Sample]] = {}
            for x in rl.batches[step]:
                groups.setdefault(x.prompt_index, []).append(x)
            for prompt_index, group in groups.items():
                why = reason(group)
                if why is None:
                    continue
                old, fresh = rl.resample_group(step, prompt_index)
                dropped += old
                print(
                    f"pivot-hpc: resume: the group of prompt {prompt_index} (step {step}, "
                    f"samples {[x.sample_id for x in old]}) is sampled again as samples "
                    f"{[x.sample_id for x in fresh]}: {why}",
                    flush=True,
                )
        return dropped

    def on_result(self, ev: ToolReturned) -> None:
        res = ev.result
        p = self.parked.pop(res.call_id, None)
        if p is None:
            raise ConservationError(f"tool call {res.call_id} answered but nothing waits on it")
        s = p.sample
        wait = max(0.0, ev.t - p.since)
        self.stats.results += 1
        self.stats.wait_s += wait
        self.waits.add(p.tool, wait)
        self.stats.statuses[res.status] = self.stats.statuses.get(res.status, 0) + 1
        self.coord.telemetry.tool_call(
            ev.t,
            sample_id=s.sample_id,
            call_id=res.call_id,
            turn=s.turn,
            tool=p.tool,
            status=res.status,
            wait_s=wait,
            tool_s=res.seconds,
            node=ev.node,
        )
        context = self.source.observe(s, res)
        if context is None:  # the observation left no room: the trajectory ends here
            self._ended(s)
            self.rolled_out(s, self.source.response_len(s), None)
        else:
            self._queue(s, context, p.idx)

    def _queue(self, s: Sample, context: int, affinity: int = -1) -> None:
        """The next turn: an ordinary rollout sequence from the context so far, preferring
        the replica (position) that caches its prefix."""
        s.context_len = context
        seq = SeqState(s.sample_id, context, s, affinity=affinity)
        self.coord.schedulers["rollout"].submit(seq)
        self.queued(s.sample_id)
        self.coord.dispatch("rollout")

    def _ended(self, s: Sample) -> None:
        self.stats.trajectories += 1
        self.stats.with_calls += s.tool_calls > 0

    def describe(self) -> str:
        return f"{self.n_parked} parked on tool calls"
