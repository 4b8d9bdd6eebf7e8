"""A worker's inference seats: one engine per inference role (rollout: the policy; reward:
the GenRM), built, shifted, supervised and restarted here.

- **Building.** `hf` engines are built at start for both roles (weights released until a
  shift up reads them from GPS). GPU engines (`sglang`, `vllm`) are built by a replica's
  leader at its first shift up to the role (the other ranks of a tp > 1 replica lend it
  their GPUs); SGLang keeps its configuration process-wide, so a worker holds one SGLang
  engine at a time: shifting up to the other sglang role closes it (a cold start, reported
  in the shift's reload phase).
- **Shifts** (§5.2): down, the KV cache and the weights are discarded (GPS holds them);
  up, memory is resumed and the weights read from GPS straight into the engine's memory.
- **Supervision.** Every engine is a SupervisedEngine (engines/base.py): one in a child
  process that dies becomes a dead engine (engines/process/guard.py). Its death is
  reported once (`EngineFailed`); the coordinator migrates a serving replica's sequences
  with their kept tokens and restarts it through the shift-up path; an idle role's dead
  engine is dropped here and a fresh one starts at its next shift up.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from pivot_hpc.engines.base import SeqResult, SupervisedEngine
from pivot_hpc.runtime import protocol as msg
from pivot_hpc.runtime import stop
from pivot_hpc.runtime.decode_steps import DecodeSteps
from pivot_hpc.runtime.training_world import TP1

ROLES = ("rollout", "reward")
LENGTHS_EVERY_S = 0.5  # how often a serving engine's sequence lengths are reported
MODELS = {"rollout": "policy", "reward": "genrm"}  # each role's model in GPS


class InferenceSeats:
    """The inference engines of world rank `rank`. `role` / `leader`: the role the worker
    serves now (None: none or training) and whether this rank leads its replica (a
    non-leading rank of a tp > 1 replica lends its GPU to the leader's engine)."""

    def __init__(
        self, rank: int, gps, cfg, dirs: dict[str, object], send: Callable[[msg.Event], None]
    ) -> None:
        self.rank = rank
        self.gps = gps
        self.cfg = cfg
        self.dirs = dirs
        self.send = send
        self.engines: dict[str, SupervisedEngine] = {}
        self.role: str | None = None
        self.leader = True
        self._reported: set[str] = set()  # roles whose engine's death was reported
        self._last_lengths = 0.0
        self.steps = DecodeSteps()  # for the monitor's A–D refit
        # GPU engines are built by replica leaders only, at their first shift up
        self.lazy_roles = {r for r in ROLES if getattr(cfg.engines, r).engine != "hf"}

    def prepare(self) -> None:
        for role in ROLES:
            if role not in self.lazy_roles:
                engine = self.engines[role] = self._make_engine(role)
                engine.release_memory(weights=True)

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()

    @property
    def serving(self) -> SupervisedEngine | None:
        """The engine this rank steps now: its role's, where it leads the replica."""
        return self.engines.get(self.role) if self.role in ROLES and self.leader else None

    # ---------------------------------------------------------------- commands
    def add(self, seq_id: int, prompt, generated, logprobs, sampling) -> None:
        self.engines[self.role].add(seq_id, prompt, generated or None, sampling, logprobs or None)
        self.steps.added = True

    def abort(self, seq_id: int) -> SeqResult | None:
        try:
            return self.engines[self.role].abort(seq_id)
        except KeyError:
            return None  # finished before the abort arrived: already reported

    def peek(self) -> list[SeqResult]:
        """Tokens of the running sequences, undisturbed (checkpoints)."""
        engine = self.serving
        return engine.snapshot() if engine is not None else []

    def update_weights(self) -> tuple[int, float]:
        """The rollout engine takes the newest policy (staleness > 0: while serving)."""
        t0 = time.perf_counter()
        engine = self.engines["rollout"]
        tensors, version = self.gps.read("policy", [self.rank], TP1, device=engine.weights_device)
        engine.load_weights(tensors, version)
        return version, time.perf_counter() - t0

    def rng_states(self) -> dict:
        states = {r: e.rng_state() for r, e in self.engines.items()}
        return {r: s for r, s in states.items() if s is not None}

    def set_rng_states(self, states: dict) -> None:
        for role, state in states.items():
            if role in self.engines:
                self.engines[role].set_rng_state(state)

    # ------------------------------------------------------------------ shifts
    def shift_up(self, role: str, version: int, leader: bool, phases: dict[str, float]) -> None:
        t0 = time.perf_counter()
        self.leader = leader  # (a non-leader's GPU serves the replica leader's engine)
        if leader:
            if role not in self.engines:  # lazily built, or restarted after a death
                for other in [r for r in self.engines if r != role and r in self.lazy_roles]:
                    if getattr(self.cfg.engines, other).engine == "sglang":
                        self._drop(other)  # one SGLang engine per process
                if torch.cuda.is_initialized():  # blocks cached here count as used for
                    torch.cuda.empty_cache()  # SGLang, which sizes its pool from what is free
                self.engines[role] = self._make_engine(role, survive_start=True)
                self.engines[role].release_memory(weights=True)
            engine = self.engines[role]
            engine.resume_memory()
            self.steps.reset()
            phases["reload_s"] = time.perf_counter() - t0
            t1 = time.perf_counter()
            if engine.failure is None:  # (a dead one is reported after this)
                model = MODELS[role]
                # straight into the engine's memory (VRAM on GPU)
                tensors, got = self.gps.read(model, [self.rank], TP1, device=engine.weights_device)
                if model == "policy" and got < version:
                    raise RuntimeError(
                        f"rollout read policy v{got} from GPS, expected >= v{version}"
                    )
                engine.load_weights(tensors, got)
            phases["read_s"] = time.perf_counter() - t1
        self.role = role

    def shift_down(self, phases: dict[str, float]) -> None:
        self.steps.reset()
        t0 = time.perf_counter()
        if self.role is not None and self.leader:
            engine = self.engines[self.role]
            if engine.failure is not None:  # the next shift-up starts a fresh process
                self._drop(self.role)
            else:
                engine.release_memory(weights=True)
            phases["discard_s"] = time.perf_counter() - t0
        self.role = None

    # ------------------------------------------------------------ supervision
    def step(self, decode_delay_s: float = 0.0) -> bool:
        """One decode step of the serving engine, if it has work; its finished sequences
        and, every LENGTHS_EVERY_S, the lengths report go to the coordinator. Returns
        whether it stepped. (`decode_delay_s`: a test hook, seconds added to the step.)"""
        engine = self.serving
        if engine is None or not engine.has_unfinished():
            self.steps.idle()
            return False
        before = engine.stats().steps
        done = engine.step()
        if decode_delay_s:
            time.sleep(decode_delay_s)
        if done:
            self.send(msg.Finished(done))
        self.steps.record(engine.stats(), before)
        now = time.monotonic()
        if now - self._last_lengths > LENGTHS_EVERY_S:
            self._last_lengths = now
            engine.stream()  # the tokens a death would keep (engines/process/guard.py)
            self.send(msg.Lengths(engine.seq_lengths(), self.steps.take()))
        return True

    def check(self) -> None:
        """Every engine process, an idle role's too: still there?"""
        for engine in self.engines.values():
            engine.check()

    def report_failures(self) -> None:
        """Engines found dead: tell the coordinator once each. It migrates a serving
        replica's sequences with their kept tokens and restarts it; an idle role's engine
        is dropped here and a fresh one starts at its next shift-up."""
        for role, engine in list(self.engines.items()):
            failure = engine.failure
            if failure is None or role in self._reported:
                continue
            self._reported.add(role)
            self.send(
                msg.EngineFailed(
                    role, failure.cause, failure.sequences, failure.tokens_kept, failure.tokens_lost
                )
            )
            if role != self.role or not self.leader:
                self._drop(role)

    def _drop(self, role: str) -> None:
        self.engines.pop(role).close()
        self._reported.discard(role)

    def _make_engine(self, role: str, survive_start: bool = False) -> SupervisedEngine:
        from pivot_hpc.engines.factory import make_inference_engine

        return make_inference_engine(
            self.cfg,
            role,
            self.dirs[role],
            # a distinct stream per worker; rl.trainer.seed varies the whole run
            seed=getattr(self.cfg.engines, role).seed + self.cfg.rl.trainer.seed + self.rank,
            # the replica's first GPU on this node: the leader's own (runtime/devices.py)
            slot=self.rank % self.cfg.cluster.ranks_per_node - 1,
            reclaim_signals=stop.reinstall,
            survive_start=survive_start,
        )
