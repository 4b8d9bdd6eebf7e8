"""The coordinator's turn loop for tool-calling rollouts (issue 37, docs/agentic.md).

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

Accounting: the sample is rolled out once, when its trajectory ends (`RLState.rollout_done`
with the whole response, generated and observation tokens: what training sees); each
turn's generated tokens count toward the step's rollout tokens when the turn finishes;
`version_start` is set by the first turn only, so staleness is the trajectory's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pivot_hpc.agentic.messages import ToolCall, ToolResult
from pivot_hpc.coordinator.events import SequenceFinished, ToolReturned
from pivot_hpc.coordinator.rl_state import ConservationError, Sample
from pivot_hpc.errors import PivotError
from pivot_hpc.scheduler import SeqState

if TYPE_CHECKING:
    from pivot_hpc.coordinator.coordinator import Coordinator

TurnKind = Literal["done", "again", "call"]


@dataclass(frozen=True, slots=True)
class Turn:
    """What a finished turn did. `context`: the next turn's context length ("again");
    `tool`/`args_json`: the call to run ("call")."""

    kind: TurnKind
    context: int = 0
    tool: str = ""
    args_json: str = ""


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
    """A trajectory waiting on a tool call. `rid`: the replica its last turn ran on (its
    prefix is cached there: a soft affinity the scheduler does not use yet)."""

    sample: Sample
    since: float
    tool: str
    rid: str


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
        coord: Coordinator,
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
        self._waits: dict[str, tuple[float, int]] = {}  # tool -> (summed wait s, calls)

    @property
    def n_parked(self) -> int:
        return len(self.parked)

    def expected_wait(self, tool: str) -> float:
        """Seconds a call of `tool` is expected to take: the mean of its answered calls
        (of every tool's before it has one; 0 before any: due at once, so a first wave of
        calls is not mistaken for idle rollout GPUs)."""
        s, n = self._waits.get(tool, (0.0, 0))
        if n:
            return s / n
        return self.stats.wait_s / self.stats.results if self.stats.results else 0.0

    def due_within(self, now: float, horizon_s: float) -> int:
        """Parked trajectories whose call is expected back within `horizon_s` of `now`:
        rollout demand the planner counts (Snapshot.parked_due)."""
        return sum(
            p.since + self.expected_wait(p.tool) - now <= horizon_s for p in self.parked.values()
        )

    def on_turn(self, s: Sample, ev: SequenceFinished) -> bool:
        """A rollout turn of `s` finished (the scheduler has let it go): True when its
        trajectory is over (the caller rolls it out), False when it goes on."""
        s.turn += 1
        self.stats.turns += 1
        turn = self.source.turn(s, ev.generated, ev.result, self._next_call)
        if turn.kind == "done":
            self._ended(s)
            return True
        if turn.kind == "again":
            self.stats.refusals += 1
            self._queue(s, turn.context)
            return False
        if turn.kind != "call":
            raise ConservationError(f"sample {s.sample_id}: unknown turn kind {turn.kind!r}")
        s.tool_calls += 1
        self._park(s, turn.tool, turn.args_json, ev.rid)
        return False

    def _park(self, s: Sample, tool: str, args_json: str, rid: str) -> None:
        call_id, self._next_call = self._next_call, self._next_call + 1
        self.parked[call_id] = Parked(s, self.coord.cluster.now(), tool, rid)
        self.stats.calls += 1
        self.coord.cluster.call_tool(
            ToolCall(call_id, s.sample_id, tool, args_json, self.call_timeout_s)
        )

    def resume(self, s: Sample) -> bool:
        """Resume from a checkpoint: when `s` was parked, its pending call is issued again
        (the source renumbers it; an idempotent call is simply re-run) and True."""
        resume_call = getattr(self.source, "resume_call", None)
        call = None if resume_call is None else resume_call(s, self._next_call)
        if call is None:
            return False
        tool, args_json = call
        self._park(s, tool, args_json, rid="")
        return True

    def on_result(self, ev: ToolReturned) -> None:
        res = ev.result
        p = self.parked.pop(res.call_id, None)
        if p is None:
            raise ConservationError(f"tool call {res.call_id} answered but nothing waits on it")
        s = p.sample
        wait = max(0.0, ev.t - p.since)
        self.stats.results += 1
        self.stats.wait_s += wait
        s_w, n_w = self._waits.get(p.tool, (0.0, 0))
        self._waits[p.tool] = (s_w + wait, n_w + 1)
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
        )
        context = self.source.observe(s, res)
        if context is None:  # the observation left no room: the trajectory ends here
            self._ended(s)
            self.rolled_out(s, self.source.response_len(s), None)
        else:
            self._queue(s, context)

    def _queue(self, s: Sample, context: int) -> None:
        """The next turn: an ordinary rollout sequence from the context so far."""
        s.context_len = context
        self.coord.schedulers["rollout"].submit(SeqState(s.sample_id, context, s))
        self.coord.dispatch("rollout")

    def _ended(self, s: Sample) -> None:
        self.stats.trajectories += 1
        self.stats.with_calls += s.tool_calls > 0

    def describe(self) -> str:
        return f"{self.n_parked} parked on tool calls"
