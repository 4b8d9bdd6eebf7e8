"""The messages between the coordinator (world rank 0) and the other ranks: one frozen
dataclass per message, the only place the protocol is written down.

They travel as MPI messages between ranks of one job (pickled by mpi4py, never read from
disk), on two tags: commands on CMD (coordinator → worker or host rank), events on EVT
(worker or host rank → coordinator). A worker handles commands in order and replies in
order, so an `Aborted` reply follows any `Finished` report the worker sent before it —
which is how the coordinator tells an abort that came too late (the sequence is in
`Finished`, and `Aborted` says None for it). The tool-call pair `ToolCall`/`ToolResult`
is defined beside the sandbox that runs it (agentic/messages.py) and imported here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

# A tool call: coordinator → a node's host rank (CMD), its outcome: host rank → coordinator
# (EVT). Defined with the sandbox that runs them (agentic/messages.py), carried as they are.
from pivot_hpc.agentic.messages import ToolCall, ToolResult

if TYPE_CHECKING:
    from pivot_hpc.engines.base import SamplingParams, SeqResult, TrainBatch

CMD = 11
EVT = 12


# ------------------------------------------------------- coordinator → worker (CMD)
@dataclass(frozen=True, slots=True)
class ShiftUp:
    """Take `role` ("rollout", "reward" or "training") at policy `version`. `leader`: this
    rank runs the replica's engine (a tp > 1 sglang replica's other ranks only lend their
    GPUs; every training rank trains)."""

    role: str
    version: int
    leader: bool = True


@dataclass(frozen=True, slots=True)
class ShiftDown:
    """Leave the current role (its sequences were aborted first)."""


@dataclass(frozen=True, slots=True)
class Start:
    """Start a sequence, or resume an aborted one from its `generated` tokens (re-prefill)."""

    seq_id: int
    prompt: list[int]
    generated: list[int]
    logprobs: list[float]
    sampling: SamplingParams


@dataclass(frozen=True, slots=True)
class Abort:
    """Stop these running sequences, keeping their tokens (one reply for all of them)."""

    seq_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class UpdateWeights:
    """An active rollout replica reads policy `version` from GPS."""

    version: int


@dataclass(frozen=True, slots=True)
class Train:
    """One training step on `batch` (each data-parallel rank takes its share). `members`:
    with elastic training, the world ranks of the step's replicas in order (the training
    set's, then the extensions'); empty: the training set's fixed data parallelism."""

    step: int
    batch: TrainBatch
    members: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class FormGroups:
    """Elastic training: every rank that may train creates the data-parallel process groups
    of a new step member set, in the order these arrive (engines/step_groups.py)."""

    members: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PublishOptimizer:
    """Elastic training: the training set's first replica writes its optimizer state to
    GPS at policy `version`, for extensions about to join (runtime/training_world.py)."""

    version: int


@dataclass(frozen=True, slots=True)
class Peek:
    """Checkpoint: report the tokens of the running sequences without disturbing them."""


@dataclass(frozen=True, slots=True)
class Save:
    """Checkpoint: this rank's RNG states; training ranks write `path`/train (or nothing
    when `path` is None)."""

    path: str | None


@dataclass(frozen=True, slots=True)
class Restore:
    """Resume from the checkpoint at `path`."""

    path: str


# Trainer children (`rl.trainer.process: child`), before every step, save and restore, to
# every rank that may train (runtime/live_cluster.py `_replace_lost_trainers`): is each
# child alive; if one is not, all close theirs, then all start new ones in a new world.
@dataclass(frozen=True, slots=True)
class CheckTrainer:
    """Reply whether this rank's trainer child lives (`TrainerChecked`)."""


@dataclass(frozen=True, slots=True)
class CloseTrainer:
    """Close this rank's trainer child, dead or alive in a world that lost a member."""


@dataclass(frozen=True, slots=True)
class StartTrainer:
    """Start a new trainer child in the training world of `generation` (it meets at that
    generation's file store: runtime/training_world.py), refit from GPS as this rank's
    role needs it."""

    generation: int


@dataclass(frozen=True, slots=True)
class Stop:
    """End the rank's loop; it exits with `code`."""

    code: int


Command = (
    ShiftUp
    | ShiftDown
    | Start
    | Abort
    | UpdateWeights
    | Train
    | FormGroups
    | PublishOptimizer
    | Peek
    | Save
    | Restore
    | CheckTrainer
    | CloseTrainer
    | StartTrainer
    | Stop
    | ToolCall  # to a host rank (runtime/host_tools.py)
)


# ------------------------------------------------------- worker → coordinator (EVT)
@dataclass(frozen=True, slots=True)
class Ready:
    """The worker built its preserved context (engines, trainer) and serves commands."""

    seconds: float


@dataclass(frozen=True, slots=True)
class Shifted:
    """A shift finished; `phases` are its timed parts (discard_s, read_s, offload_s,
    reload_s), seconds."""

    kind: str  # "up" | "down"
    phases: Mapping[str, float]


@dataclass(frozen=True, slots=True)
class Finished:
    results: list[SeqResult]


@dataclass(frozen=True, slots=True)
class Aborted:
    """Reply to `Abort`: each sequence's tokens so far, or None where it had finished
    before the abort arrived (its result was in an earlier `Finished`)."""

    results: Mapping[int, SeqResult | None]


@dataclass(frozen=True, slots=True)
class Lengths:
    """Monitor data (every 0.5 s): the context length of every running sequence, and the
    decode steps since the last report as (seconds, N_seq, N_tok) for the online refit of
    the role's throughput constants."""

    lengths: Mapping[int, int]
    steps: list[tuple[float, int, int]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class WeightsLoaded:
    version: int
    seconds: float


@dataclass(frozen=True, slots=True)
class Trained:
    """One training rank's part of step `step`; the rank that published has `version` in
    its metrics (the others None)."""

    step: int
    metrics: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Peeked:
    role: str | None
    results: list[SeqResult]


@dataclass(frozen=True, slots=True)
class Saved:
    rng_states: Mapping[str, Any]
    seconds: float


@dataclass(frozen=True, slots=True)
class Restored:
    seconds: float


@dataclass(frozen=True, slots=True)
class TrainerChecked:
    alive: bool


@dataclass(frozen=True, slots=True)
class TrainerClosed:
    """This rank's trainer child is gone (the next generation may start)."""


@dataclass(frozen=True, slots=True)
class TrainerStarted:
    seconds: float


@dataclass(frozen=True, slots=True)
class Stopped:
    """The worker's last message, after `Stop`: everything it sent before has arrived."""


@dataclass(frozen=True, slots=True)
class EngineFailed:
    """The worker's engine process died while serving (engines/process/guard.py); the worker
    lives on and answers aborts with the tokens it kept. `tokens_lost`: decoded after the
    last refresh (an upper bound), to be generated again. `role`: the engine's role (an
    idle role's engine may die too: nothing of it runs)."""

    role: str
    cause: str
    sequences: int
    tokens_kept: int
    tokens_lost: int


@dataclass(frozen=True, slots=True)
class Failed:
    """The rank raised; `text` names it and holds its traceback (it aborts the world)."""

    text: str = field(default="")


Event = (
    Shifted
    | Finished
    | Aborted
    | Lengths
    | WeightsLoaded
    | Trained
    | Peeked
    | Saved
    | Restored
    | TrainerChecked
    | TrainerClosed
    | TrainerStarted
    | Stopped
    | EngineFailed
    | Failed
    | ToolResult  # from a host rank, one per ToolCall
)
