"""What a cluster reports to the coordinator (events). Actions are `Cluster` method calls.

The live MPI runtime and the simulator produce the same events; the coordinator, its
schedulers and planner cannot tell them apart (docs/design.md §2).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pivot_hpc.agentic.messages import ToolResult


@dataclass(frozen=True)
class SequenceFinished:
    """A rollout or reward sequence completed on replica `rid`.

    `length` is its final context length; `generated` how many tokens it generated in
    total (across aborts). `result` is engine output the RL loop needs (token ids and
    logprobs for rollout; the judgement text or parsed score for reward), opaque here.
    """

    t: float
    role: str
    rid: str
    seq_id: int
    length: int
    generated: int
    result: Any = None


@dataclass(frozen=True)
class ShiftDone:
    """A replica (or the training set, rid "training") finished shifting up or down."""

    t: float
    rid: str
    kind: str  # "up" | "down"
    phases: dict[str, float] = field(default_factory=dict)  # seconds per phase


@dataclass(frozen=True)
class TrainingDone:
    t: float
    step: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class WeightsUpdated:
    """An inference replica loaded policy `version` from GPS."""

    t: float
    rid: str
    version: int


@dataclass(frozen=True)
class ReplicaFailed:
    """An inference engine process died (docs/design.md §5). Serving replica `rid`: its
    sequences come back with the tokens streamed before the death (`tokens_lost` are
    generated again). `rid` "": the engine of a role its GPU was not serving (`where`
    names it); a fresh one starts at that GPU's next shift-up."""

    t: float
    role: str
    rid: str
    where: str
    cause: str
    sequences: int = 0
    tokens_kept: int = 0
    tokens_lost: int = 0


@dataclass(frozen=True)
class ToolReturned:
    """The outcome of a tool call the coordinator made (`Cluster.call_tool`): a node's
    sandbox ran it (live) or its simulated latency passed (simulator). `node`: the index
    of the node whose sandbox service answered (live); -1 where no node's service did
    (the simulator, which models no sandbox placement)."""

    t: float
    result: ToolResult
    node: int = -1


Event = SequenceFinished | ShiftDone | TrainingDone | WeightsUpdated | ReplicaFailed | ToolReturned
