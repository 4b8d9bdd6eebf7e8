"""The abstract cluster the coordinator drives (docs/design.md §2: one brain, two clusters).

Replica ids are "<role>:<slot>" (see planner.snapshot); the training set is "training",
its elastic data-parallel extensions "training:<slot>".
All calls are non-blocking requests; completions come back as events from `poll`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from pivot_hpc.agentic.messages import ToolCall
from pivot_hpc.coordinator.events import Event, SequenceFinished
from pivot_hpc.coordinator.rl_state import Sample
from pivot_hpc.scheduler import SeqLengths


class Cluster(Protocol):
    def now(self) -> float:
        """Seconds since the run started (simulated or wall clock)."""
        ...

    def shift_up(self, rid: str, version: int, after: str | None = None) -> None:
        """Bring replica `rid` (or "training") up: read weights from GPS, reload context.

        `after`: a replica on exactly these GPUs whose shift-down is in flight; the shift-up
        starts when that one has finished (its `ShiftDone` comes first), without waiting
        for the coordinator to hear of it."""
        ...

    def shift_down(self, rid: str) -> None:
        """Take `rid` down: discard temporaries and weights, offload stateful context.

        Its sequences must have been aborted first (`abort`)."""
        ...

    def start(self, rid: str, sample: Sample, role: str) -> None:
        """Start (or resume, by re-prefill) the role's sequence of `sample` on `rid`."""
        ...

    def abort(self, where: Mapping[int, str]) -> dict[int, int | None]:
        """Stop running sequences of one role (seq_id → the replica it runs on), all in one
        request; their generated tokens are kept. Returns each one's length, or None where
        it had already finished (its `SequenceFinished` is then held back for
        `take_finished`)."""
        ...

    def take_finished(self, role: str, seq_id: int) -> SequenceFinished:
        """The held-back finish of a sequence whose abort came too late (see `abort`)."""
        ...

    def lengths(self, role: str) -> SeqLengths | Mapping[int, int]:
        """Current context length of every running sequence of `role` (monitor data)."""
        ...

    def step_stats(self, role: str) -> list[tuple[float, int, int]]:
        """Decode steps of the role's engines since the last call, as (seconds, N_seq,
        N_tok), for the monitor's refit of A–D (empty where nothing is measured)."""
        ...

    def update_weights(self, rid: str, version: int) -> None:
        """Make an active rollout replica load policy `version` from GPS."""
        ...

    def train(self, step: int, samples: Sequence[Sample], extensions: Sequence[str] = ()) -> None:
        """Run one training step on the training set and the `extensions` it holds (all
        up): data parallel over all of them."""
        ...

    def prefill_time(self, role: str, tokens: int) -> float:
        """Estimated seconds to (re-)prefill `tokens` of context on one replica of `role`."""
        ...

    def measured_throughput(self, role: str) -> float:
        """Tokens/s the role generated recently (for telemetry)."""
        ...

    def made_tokens(self) -> tuple[float, float]:
        """(rollout, reward) tokens the engines have made so far, unfinished sequences
        included; NaN where the cluster does not count them."""
        ...

    def call_tool(self, call: ToolCall) -> None:
        """Run a tool call off the coordinator (a node's sandbox service, or a simulated
        latency); its outcome comes back from `poll` as a `ToolReturned` event."""
        ...

    def poll(self, until: float) -> list[Event]:
        """Events up to time `until` (the simulator advances its clock; live waits)."""
        ...
