"""The two engine protocols (docs/design.md §5) and the plain data they exchange.

InferenceEngine — what the shift-aware scheduler drives on one replica; the whole contract
the worker (runtime/worker.py) uses, and what tests/engines/test_engine_conformance.py
checks for every engine:
    add(seq_id, prompt_ids, generated_ids, sampling)   admit a sequence; `generated_ids`
        (and their `generated_logprobs`) are tokens it already produced elsewhere: the
        engine re-prefills prompt+generated and continues, so an aborted sequence resumes
        without loss. Admission is bounded by the KV capacity in tokens (`can_admit`); a
        sequence that does not fit yet waits inside the engine (FIFO).
    step() -> list[SeqResult]      one decode iteration over every running sequence
        (continuous batching: waiting sequences are prefilled as capacity frees); returns
        the sequences that finished in this step.
    abort(seq_id) -> SeqResult     remove a sequence now; its result carries every token
        generated so far (including ones given to `add`) and their logprobs. KeyError for a
        sequence the engine does not hold (unknown, or already reported by `step`).
    abort_all() -> list[SeqResult] `abort` of every sequence.
    snapshot() -> list[SeqResult]  tokens of every sequence so far, without disturbing any
        (checkpoints); each is a prefix of what the sequence will finally return.
    seq_lengths() -> {seq_id: context length}   for the monitor.
    stats() -> EngineStats         running / waiting sequences, tokens in the KV cache,
        KV capacity, latency and shape of the last decode step(s).
    load_weights(tensors, version) copy canonical HF tensors into the model in place;
        sequences generated afterwards record `version`. `weights_device` is where the
        tensors should be ("cpu", "cuda"): GPS reads them straight there.
    release_memory(weights=False) / resume_memory()   drop the KV cache (and weights, which
        then come back through `load_weights`); the engine must be idle.
    rng_state() / set_rng_state(state)   the sampling RNG for checkpoints (None: the engine
        cannot export it, e.g. SGLang samples in its scheduler process).
    close()                        free everything; the engine is unusable afterwards.

TrainEngine — the training role; the whole contract the worker and elastic training
(runtime/worker.py, runtime/training_world.py) use, built by `engines.factory` from
`rl.trainer.engine`, checked by tests/unit/test_train_engine_contract.py (the runtime calls
nothing else) and tests/engines/test_megatron_engine.py (the engine has all of it):
    load_weights(tensors)          canonical HF tensors → this rank's shard.
    train_step(batch) -> metrics   one optimizer step on a TrainBatch (GRPO or SFT loss).
    compute_logprobs(batch)        per-token logprobs of the responses under the current weights.
    export_weights() -> tensors    canonical HF tensors (gathered over tensor parallelism).
    offload_optimizer() / reload_optimizer() / optimizer_offloaded   optimizer state to host
        memory and back (a shift down keeps it: offloadable context).
    discard_optimizer()            drop it (a replica that leaves elastic training).
    release_memory() / resume_memory() / memory_released   parameters and gradient
        buffers off the device and back (contents come back through load_weights).
    use_data_parallel(group, size, rank) / dp / dp_rank   the data-parallel set of the
        next steps (elastic training: groups formed once per member set).
    optimizer_kinds() / optimizer_state() / load_optimizer_state(state, step, version) /
        optimizer_step   the optimizer state as canonical tensors, for GPS (a joining
        replica reads it there).
    optimizer_shard() / load_optimizer_shard(shard, version)   the sharded optimizer's
        range of this rank, on the host (a rank keeps it for the trainer it restarts).
    save(dir) / load(dir)          distributed checkpoint (model + optimizer).
    close()                        free the engine (a trainer child's process ends).
    version, steps, device         weights version, steps taken, where the model lives.

What supervision adds (the runtime drives engines only through these, never probing):
    SupervisedEngine = InferenceEngine + `failure` (EngineFailure | None: the engine's
        process died; its kept tokens), `check()` (between calls: is the process still
        there?) and `stream()` (refresh the tokens a death would keep). An engine in the
        worker's own process cannot die alone (`InRank`: never fails); one in a child
        process is guarded (engines/process/guard.py).
    SupervisedTrainer = TrainEngine without `use_data_parallel` (its process groups live
        where the engine runs) + `form_groups(members)` / `use_members(members)` (elastic
        training's step groups, engines/step_groups.py), `dead` / `death()` / `kill()`
        (a trainer child's life; a trainer in the rank is never dead).
engines/factory.py builds both and decides where each runs (`engines.<role>.process`,
`rl.trainer.process`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from pivot_hpc.rl.batch import TrainBatch  # the RL side owns the batch; engines train on it

Tensors = dict[str, torch.Tensor]
# The file the training world's ranks meet through on one node (set by the runtime,
# runtime/training_world.py; read by the trainer's init_distributed; kept from an
# inference engine's child): no TCP store listening on every interface, no port race.
STORE_ENV = "PIVOT_HPC_STORE"
FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """temperature 0 = greedy. `stop_token_ids` end a sequence (the stop token is kept);
    `stop` strings need a tokenizer on the engine and end the sequence once the decoded
    response ends with one of them. `max_tokens` counts every generated token, including
    those already generated before an abort."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature={self.temperature}: must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p={self.top_p}: must be in (0, 1]")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens={self.max_tokens}: must be >= 1")


@dataclass(slots=True)
class SeqResult:
    """A finished (or aborted) sequence. `logprobs[i]` is the log-probability of
    `token_ids[i]` under the distribution it was sampled from (softmax(logits / T);
    T = 1 for greedy), before top-p truncation."""

    seq_id: int
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    version: int = 0  # weights version that produced the last token


@dataclass(frozen=True, slots=True)
class EngineStats:
    running: int  # sequences in the decode batch
    waiting: int  # admitted by `add` but not yet prefilled (KV capacity)
    tokens_in_cache: int  # KV-cache tokens held by running sequences
    kv_capacity: int  # tokens
    last_step_s: float  # wall time of the last decode step (engines that decode on their
    # own, like SGLang's scheduler: the mean over the steps since the previous `stats`)
    last_step_seqs: int = 0  # N_seq of that step (0: not reported)
    last_step_tokens: int = 0  # N_tok (KV tokens attended) of that step
    steps: int = 0  # decode steps so far
    preemptions: int = 0  # running sequences pushed back to waiting under KV pressure


def check_new_sequence(
    seq_id: int,
    prompt_ids: list[int],
    generated_ids: list[int] | None,
    generated_logprobs: list[float] | None,
    known,
) -> tuple[list[int], list[float]]:
    """The checks every engine's `add` makes; returns (generated ids, their logprobs)."""
    if seq_id in known:
        raise ValueError(f"add: sequence {seq_id} is already in this engine")
    if not prompt_ids:
        raise ValueError(f"add: sequence {seq_id} has an empty prompt")
    gen = list(generated_ids or [])
    lps = list(generated_logprobs) if generated_logprobs is not None else [0.0] * len(gen)
    if len(lps) != len(gen):
        raise ValueError("add: generated_logprobs must match generated_ids in length")
    return gen, lps


@runtime_checkable
class InferenceEngine(Protocol):
    version: int  # weights version of the last load_weights
    weights_device: str  # where load_weights wants its tensors

    def add(
        self,
        seq_id: int,
        prompt_ids: list[int],
        generated_ids: list[int] | None = None,
        sampling: SamplingParams | None = None,
        generated_logprobs: list[float] | None = None,
    ) -> None: ...

    def can_admit(self, n_tokens: int) -> bool: ...

    def step(self) -> list[SeqResult]: ...

    def abort(self, seq_id: int) -> SeqResult: ...

    def abort_all(self) -> list[SeqResult]: ...

    def snapshot(self) -> list[SeqResult]: ...

    def seq_lengths(self) -> dict[int, int]: ...

    def has_unfinished(self) -> bool: ...

    def stats(self) -> EngineStats: ...

    def load_weights(self, tensors: Tensors, version: int) -> None: ...

    def release_memory(self, weights: bool = False) -> None: ...

    def resume_memory(self) -> None: ...

    def rng_state(self) -> Any: ...

    def set_rng_state(self, state: Any) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class EngineFailure:
    """An inference engine whose process died (engines/process/guard.py)."""

    cause: str  # the process's exit, as EngineProcessError words it
    sequences: int  # unfinished sequences whose streamed tokens were kept
    tokens_kept: int  # their generated tokens, as last streamed
    tokens_lost: int  # decoded after the last refresh: generated again elsewhere


@runtime_checkable
class Supervised(Protocol):
    """What supervision adds to an engine: its death as data, never an exception."""

    @property
    def failure(self) -> EngineFailure | None: ...

    def check(self) -> None: ...

    def stream(self) -> None: ...


@runtime_checkable
class SupervisedEngine(InferenceEngine, Supervised, Protocol):
    """The inference engine the worker drives (engines/factory.py builds it)."""


class InRank:
    """Supervision of an engine in the worker's own process: it cannot die alone (the rank
    would die with it), so it never fails and has nothing to stream."""

    failure: EngineFailure | None = None

    def check(self) -> None:
        pass

    def stream(self) -> None:
        pass


class Trainer(Protocol):
    """What every trainer has, wherever it runs (TrainEngine and SupervisedTrainer)."""

    version: int  # weights version (the policy version its weights are)
    steps: int  # optimizer steps taken
    device: Any  # torch.device the model lives on
    dp: int  # data-parallel size of the current step set
    dp_rank: int

    # masters=False: the parameters only — a trainer that holds the current version keeps
    # its own fp32 masters (a bf16 policy in GPS would round every update that did not move
    # the bf16 value away: DESIGN.md §3, the optimizer state is preserved context)
    def load_weights(self, tensors: Tensors, *, masters: bool = True) -> None: ...

    def train_step(self, batch: TrainBatch, loss: str = "grpo") -> dict[str, float]: ...

    def compute_logprobs(self, batch: TrainBatch) -> list[list[float]]: ...

    def export_weights(self) -> Tensors: ...

    def offload_optimizer(self) -> None: ...

    def reload_optimizer(self) -> None: ...

    @property
    def optimizer_offloaded(self) -> bool: ...

    def discard_optimizer(self) -> None: ...

    def release_memory(self) -> None: ...

    def resume_memory(self) -> None: ...

    @property
    def memory_released(self) -> bool: ...

    def optimizer_kinds(self) -> tuple[str, ...]: ...

    def optimizer_state(self) -> dict[str, Tensors]: ...

    def load_optimizer_state(
        self, state: dict[str, Tensors], *, step: int, version: int
    ) -> None: ...

    @property
    def optimizer_step(self) -> int: ...

    def optimizer_shard(self) -> dict[str, Any]: ...

    def load_optimizer_shard(self, shard: dict[str, Any], *, version: int) -> None: ...

    def save(self, path: str | Path) -> None: ...

    def load(self, path: str | Path) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class TrainEngine(Trainer, Protocol):
    """A training engine (engines/megatron/engine.py), in the process that drives it."""

    def use_data_parallel(self, group: Any, size: int, rank: int) -> None: ...


@runtime_checkable
class SupervisedTrainer(Trainer, Protocol):
    """The trainer the worker's training seat drives (engines/factory.py `make_trainer`): a
    TrainEngine where it runs — in the rank or in a child process — with elastic
    training's step groups beside it and its process's life. Every TrainEngine member
    except `use_data_parallel` (the groups live where the engine runs: `form_groups`,
    then `use_members`)."""

    def form_groups(self, members: tuple[int, ...]) -> None: ...

    def use_members(self, members: tuple[int, ...]) -> None: ...

    @property
    def dead(self) -> bool: ...

    def death(self) -> Exception: ...

    def kill(self) -> None: ...


def protocol_members(proto: type) -> dict[str, str]:
    """name -> "method", "property" or "attribute" for every public member a protocol
    declares, with its bases'."""
    found: dict[str, str] = {}
    for klass in reversed(proto.__mro__):
        if klass in (object, Protocol) or klass.__module__ == "typing":
            continue
        for name in vars(klass).get("__annotations__", {}):
            if not name.startswith("_"):
                found.setdefault(name, "attribute")
        for name, value in vars(klass).items():
            if name.startswith("_"):
                continue
            found[name] = "property" if isinstance(value, property) else "method"
    return found
