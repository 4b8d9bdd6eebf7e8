"""An engine process that dies is an unplanned shift-down, not a lost rank (docs/design.md §5).

`GuardedEngine` is the SupervisedEngine (engines/base.py) over an engine that runs in a
child process of its worker rank (`engines.<role>.process: child`,
engines/process/child.py). It keeps, for every sequence
it runs, the tokens streamed so far: those a sequence came with (`add`), refreshed from
the engine's `snapshot` at each length report (`stream`, every 0.5 s). When a call finds
the process gone (`EngineProcessError`), the guard becomes a dead engine: it answers the
coordinator's aborts with those tokens, runs nothing, and records the failure for the
worker to report (`EngineFailed`). The coordinator then migrates the replica's sequences
with their tokens (Alg. 3) and restarts the engine through the shift-up path, which reads
the current policy from GPS before the replica serves (coordinator/shifts.py).

At most the tokens decoded since the last refresh are generated again; they are counted
(`tokens_lost`: decode steps since the refresh × the sequences running then, an upper
bound). An engine in the rank's own process cannot die alone: it is not guarded.
"""

from __future__ import annotations

from typing import Any

from pivot_hpc.engines.base import EngineFailure, EngineStats, SamplingParams, SeqResult, Tensors
from pivot_hpc.engines.process.child import ChildEngine, EngineProcessError


class GuardedEngine:
    """A SupervisedEngine over `engine` (a ChildEngine; None: a process that died while
    starting) that survives its process's death."""

    failure: EngineFailure | None  # set once the process is found gone

    def __init__(self, engine: ChildEngine | None) -> None:
        self.engine = engine
        self.failure: EngineFailure | None = None
        self._streamed: dict[int, SeqResult] = {}
        self._steps_at_refresh = 0  # decode steps counted when `_streamed` was refreshed
        self._steps = 0
        self._version = engine.version if engine is not None else 0
        # where the dead engine would have wanted its weights: nothing reads them then
        self._weights_device = engine.weights_device if engine is not None else "cpu"

    @classmethod
    def failed_start(cls, exc: EngineProcessError) -> GuardedEngine:
        """The dead engine of a process that died while starting (a restart included): the
        replica comes up dead, is reported and is shifted down again (or excluded)."""
        guard = cls(None)
        guard._died(exc)
        return guard

    @property
    def version(self) -> int:
        return self._version

    @property
    def weights_device(self) -> str:
        return self._weights_device

    @property
    def dead(self) -> bool:
        return self.failure is not None

    def _died(self, exc: EngineProcessError) -> None:
        if self.failure is None:
            running = len(self._streamed)
            lost = (self._steps - self._steps_at_refresh) * running
            self.failure = EngineFailure(
                cause=str(exc),
                sequences=running,
                tokens_kept=sum(len(r.token_ids) for r in self._streamed.values()),
                tokens_lost=lost,
            )

    def check(self) -> None:
        """Between calls: is the process still there? (An idle role's engine is called
        by no one; its death would otherwise be found only at its next shift-up.)"""
        if self.dead or self.engine is None:
            return
        code = self.engine.exit_code()
        if code is not None:
            how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
            what = f"{self.engine.kind} engine process {self.engine.pid}"
            self._died(EngineProcessError(f"{what} {how} (health check)"))

    def _guard(self, name: str, *args: Any, default: Any = None) -> Any:
        if self.dead:
            return default
        try:
            return getattr(self.engine, name)(*args)
        except EngineProcessError as exc:
            self._died(exc)
            return default

    # ---- InferenceEngine ------------------------------------------------------------------
    def add(
        self,
        seq_id: int,
        prompt_ids: list[int],
        generated_ids: list[int] | None = None,
        sampling: SamplingParams | None = None,
        generated_logprobs: list[float] | None = None,
    ) -> None:
        # what it comes with is kept even if the engine dies before the next refresh (or
        # during this call); a sequence the engine refuses (a bad add) is not kept
        kept = SeqResult(
            seq_id,
            list(prompt_ids),
            list(generated_ids or []),
            list(generated_logprobs or []),
            "abort",
            self._version,
        )
        self._guard("add", seq_id, prompt_ids, generated_ids, sampling, generated_logprobs)
        self._streamed[seq_id] = kept

    def can_admit(self, n_tokens: int) -> bool:
        return self._guard("can_admit", n_tokens, default=False)

    def step(self) -> list[SeqResult]:
        done = self._guard("step", default=[])
        if not self.dead:
            self._steps += 1
        for r in done:
            self._streamed.pop(r.seq_id, None)
        return done

    def abort(self, seq_id: int) -> SeqResult:
        if not self.dead:
            try:
                res = self.engine.abort(seq_id)
                self._streamed.pop(seq_id, None)
                return res
            except EngineProcessError as exc:
                self._died(exc)
        kept = self._streamed.pop(seq_id, None)
        if kept is None:
            raise KeyError(f"abort: sequence {seq_id} is not in this engine")
        return kept

    def abort_all(self) -> list[SeqResult]:
        return [self.abort(i) for i in list(self._streamed)]

    def snapshot(self) -> list[SeqResult]:
        if not self.dead:
            snap = self._guard("snapshot", default=None)
            if snap is not None:
                return snap
        return list(self._streamed.values())

    def stream(self) -> None:
        """Refresh the kept tokens of every unfinished sequence (at each length report)."""
        snap = self._guard("snapshot", default=None)
        if snap is None:
            return
        for r in snap:
            if r.seq_id in self._streamed:
                self._streamed[r.seq_id] = r
        self._steps_at_refresh = self._steps

    def seq_lengths(self) -> dict[int, int]:
        return self._guard("seq_lengths", default={})

    def has_unfinished(self) -> bool:
        return self._guard("has_unfinished", default=False)

    def stats(self) -> EngineStats:
        zero = EngineStats(running=0, waiting=0, tokens_in_cache=0, kv_capacity=0, last_step_s=0)
        return self._guard("stats", default=zero)

    def load_weights(self, tensors: Tensors, version: int) -> None:
        self._guard("load_weights", tensors, version)
        self._version = version

    def release_memory(self, weights: bool = False) -> None:
        self._guard("release_memory", weights)

    def resume_memory(self) -> None:
        self._guard("resume_memory")

    def rng_state(self) -> Any:
        return self._guard("rng_state")

    def set_rng_state(self, state: Any) -> None:
        self._guard("set_rng_state", state)

    def close(self) -> None:
        if self.engine is None:
            return
        try:
            self.engine.close()
        except EngineProcessError:
            pass
