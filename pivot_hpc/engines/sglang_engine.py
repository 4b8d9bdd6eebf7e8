"""The `sglang` InferenceEngine: one SGLang Engine per replica leader, token-in/token-out.

Targets SGLang 0.5.23 (pinned by the `gpu` extra). Every call below was read from that
release's source (paths under python/sglang/srt/):

- `Engine(**ServerArgs fields)` (entrypoints/engine.py): model_path, tp_size (= the
  replica's GPUs), base_gpu_id, skip_tokenizer_init=True (input_ids in, output_ids out),
  enable_memory_saver=True (release/resume), context_length, max_total_tokens (= the role's
  kv_capacity_tokens), max_running_requests, mem_fraction_static, random_seed.
- Generation: `await engine.async_generate(input_ids=, sampling_params=, return_logprob=True,
  stream=True, rid=)` yields cumulative chunks `{"output_ids", "meta_info": {"finish_reason":
  {"type": "stop"|"length"|"abort", ...}, "output_token_logprobs": [(logprob, id, None)]}}`.
  The stop token is part of `output_ids` (`Req.output_ids_through_stop`). Streaming, every
  `stream_interval` tokens, only feeds `seq_lengths`. Logprobs are SGLang's default,
  log softmax(logits / T), T = 1 for greedy; do not set SGLANG_RETURN_ORIGINAL_LOGPROB.
- Abort: `engine.tokenizer_manager.abort_request(rid=)` (Engine has no abort method). A
  running request ends after one more forward pass with its partial output and finish
  reason "abort"; a queued one with no new tokens. The scheduler matches rids by prefix
  (`req.rid.startswith(rid)`), so every rid ends with "/". An abort that reaches the
  scheduler before the request is lost, so abort first waits for
  `tokenizer_manager.rid_to_state[rid].dispatched`.
- Memory: `release_memory_occupation(tags)` / `resume_memory_occupation(tags)`, tags
  "weights", "kv_cache", "cuda_graph". The scheduler asserts it is idle on release, and a
  tag can only be resumed after it was released. As in slime, weights come back first and
  the KV cache and CUDA graphs only after the new weights are loaded, so the staging
  buffers of the update never compete with the KV pool.
- Weights: `begin_weight_update()`, then per bucket `update_weights_from_tensor(payloads,
  load_format="flattened_bucket", flush_cache=...)`, then `end_weight_update()` (0.5.23
  refuses tensor updates outside that session); see sglang_weights.py. The version is also
  given to SGLang (`tokenizer_manager.update_weight_version`, shown as
  meta_info["weight_version"]), but SeqResult.version comes from the adapter: SGLang keeps
  that field in process-wide config. With requests running, the update pauses the
  scheduler in place (`pause_generation(mode="in_place")` ... `continue_generation`), so the
  running sequences keep their KV cache and continue under the new weights, as in the `hf`
  engine. The prefix cache from the old weights is flushed once the engine is idle.
- Stats: `tokenizer_manager.get_loads()` returns the LoadSnapshot the scheduler publishes for
  /v1/loads (num_running_reqs, num_waiting_reqs, num_used_tokens, max_total_num_tokens,
  decode_moments). It is read from shared memory with no round trip, and is a few steps
  stale. `/get_load` no longer exists in 0.5.23.

Concurrency: single-threaded. SGLang's own event loop (`engine.loop`, the thread's loop;
importing sglang's engine module makes uvloop the process's loop policy) runs only inside
the adapter's calls: step() runs it until a request finishes or `poll_s` passes, while the
scheduler process keeps decoding regardless. No thread and no lock are needed, and Engine's
synchronous methods (which call `loop.run_until_complete`) stay usable.

One SGLang Engine per process: Engine.__init__ publishes its ServerArgs process-wide
(`runtime_context.publish`, "replaces whatever was published before it"), so
EnginesConfig.validate refuses sglang for both roles of a worker.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pivot_hpc.engines.base import (
    EngineStats,
    SamplingParams,
    SeqResult,
    Tensors,
    check_new_sequence,
)
from pivot_hpc.engines.sglang_weights import serialized_buckets

SGLANG_VERSION = "0.5.23"
WEIGHTS, KV_CACHE, CUDA_GRAPH = "weights", "kv_cache", "cuda_graph"


class SGLangUnavailable(ImportError):
    pass


@dataclass(frozen=True)
class SGLangAPI:
    """The parts of sglang the adapter touches beyond the Engine object. Tests pass fakes."""

    engine_cls: Any  # sglang.srt.entrypoints.engine.Engine
    bucket_cls: Any  # sglang.srt.weight_sync.tensor_bucket.FlattenedTensorBucket
    serializer: Any  # sglang.srt.utils.MultiprocessingSerializer
    pause_req: Any  # io_struct.PauseGenerationReqInput
    continue_req: Any  # io_struct.ContinueGenerationReqInput
    weight_version_req: Any  # io_struct.UpdateWeightVersionReqInput


def load_sglang_api(config_path: str = "engines.<role>.engine") -> SGLangAPI:
    """Import sglang lazily; a missing install names the config key and the fix."""
    try:
        from sglang.srt.entrypoints.engine import Engine
        from sglang.srt.managers.io_struct import (
            ContinueGenerationReqInput,
            PauseGenerationReqInput,
            UpdateWeightVersionReqInput,
        )
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
    except ImportError as exc:
        raise SGLangUnavailable(
            f"config key '{config_path}' = 'sglang' but sglang cannot be imported ({exc}); "
            f"install the GPU extra on a GPU node (`pip install .[gpu]`, sglang=={SGLANG_VERSION}) "
            "or set the engine to 'hf'"
        ) from exc
    return SGLangAPI(
        engine_cls=Engine,
        bucket_cls=FlattenedTensorBucket,
        serializer=MultiprocessingSerializer,
        pause_req=PauseGenerationReqInput,
        continue_req=ContinueGenerationReqInput,
        weight_version_req=UpdateWeightVersionReqInput,
    )


def to_sglang_sampling(sp: SamplingParams, max_new_tokens: int, stream_interval: int) -> dict:
    """Our SamplingParams → SGLang's sampling_params dict (sampling/sampling_params.py).

    temperature 0 is greedy in SGLang too (it becomes top_k=1)."""
    if sp.stop:
        # skip_tokenizer_init: SGLang has no tokenizer to match strings (it raises).
        raise ValueError(
            f"SamplingParams.stop={sp.stop!r}: stop strings need a tokenizer, which the sglang "
            "engine runs without (token-in/token-out); use stop_token_ids"
        )
    out: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "temperature": sp.temperature,
        "top_p": sp.top_p,
        "ignore_eos": sp.ignore_eos,
        "stream_interval": stream_interval,
    }
    if sp.stop_token_ids:
        out["stop_token_ids"] = list(sp.stop_token_ids)
    return out


@dataclass(eq=False)
class _Req:
    seq_id: int
    rid: str
    prompt: list[int]
    prior_ids: list[int]  # generated elsewhere, given to add()
    prior_lps: list[float]
    sampling: SamplingParams
    task: asyncio.Task | None = None
    started: bool = False  # the task has entered SGLang (its rid is registered)
    n_new: int = 0  # tokens generated here so far (from stream chunks)
    abort_sent: bool = False
    done_version: int = 0  # adapter version when the request completed
    result: SeqResult | None = None

    def context_len(self) -> int:
        return len(self.prompt) + len(self.prior_ids) + self.n_new


class SGLangEngine:
    """InferenceEngine over an SGLang Engine (see module docstring)."""

    def __init__(
        self,
        engine: Any,
        *,
        api: SGLangAPI,
        tp_size: int = 1,
        max_batch: int = 256,
        max_seq_len: int,
        eos_token_ids: Iterable[int] = (),
        weight_bucket_bytes: int = 512 << 20,
        stream_interval: int = 16,
        poll_s: float = 0.005,
        abort_timeout_s: float = 60.0,
    ) -> None:
        self.engine = engine
        self.api = api
        self.tp_size = tp_size
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self.eos_ids = frozenset(eos_token_ids)
        self.weight_bucket_bytes = weight_bucket_bytes
        self.stream_interval = stream_interval
        self.poll_s = poll_s
        self.abort_timeout_s = abort_timeout_s
        self.version = 0
        self._loop: asyncio.AbstractEventLoop = engine.loop
        self._reqs: dict[int, _Req] = {}
        self._rids = itertools.count()
        self._released: set[str] = set()
        self._weights_stale = False  # weights released: contents undefined until load_weights
        self._resume_after_load: list[str] = []  # KV cache / CUDA graphs held back (slime order)
        self._flush_pending = False  # prefix cache holds KV computed with old weights
        self._moments: tuple[float, float] | None = None  # (decode steps, step µs) seen last
        self._last_step_s = 0.0
        self._retractions = 0
        info = engine.get_server_info()
        self.kv_capacity = int(info["max_total_num_tokens"])
        # SGLang rejects an input of max_req_input_len tokens or more (scheduler-side abort)
        self.max_input_len = int(info["max_req_input_len"])

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
        if self._weights_stale:
            raise RuntimeError("add: weights were released; call resume_memory + load_weights")
        if self._released:
            raise RuntimeError(f"add: {sorted(self._released)} released; call resume_memory")
        sp = sampling or SamplingParams()
        n_ctx = len(prompt_ids) + len(gen)
        if not gen and not self._fits(n_ctx):
            raise ValueError(
                f"add: sequence {seq_id} needs {n_ctx + 1} tokens; max_seq_len="
                f"{self.max_seq_len}, kv_capacity={self.kv_capacity}, SGLang's input limit "
                f"max_req_input_len={self.max_input_len}"
            )
        rec = _Req(seq_id, f"pivot/{seq_id}/{next(self._rids)}/", list(prompt_ids), gen, lps, sp)
        done = self._already_done(rec, n_ctx)
        if done is not None:  # resumed at its end: nothing to generate
            rec.done_version = self.version
            rec.result = self._result(rec, [], [], done)
            self._reqs[seq_id] = rec
            return
        max_new = min(sp.max_tokens - len(gen), self.max_seq_len - n_ctx)
        params = to_sglang_sampling(sp, max_new, self.stream_interval)  # may refuse `stop`
        self._reqs[seq_id] = rec
        rec.task = self._loop.create_task(self._generate(rec, params))
        rec.task.add_done_callback(lambda _t, rec=rec: self._mark_done(rec))

    def can_admit(self, n_tokens: int) -> bool:
        """Whether a sequence with `n_tokens` of context fits next to the live ones (the same
        rule as the `hf` engine, on the adapter's own count: SGLang's snapshot lags)."""
        live = [r for r in self._reqs.values() if r.result is None]
        used = sum(r.context_len() for r in live)
        return len(live) < self.max_batch and used + len(live) + n_tokens + 1 <= self.kv_capacity

    def has_unfinished(self) -> bool:
        return bool(self._reqs)

    def step(self) -> list[SeqResult]:
        """Sequences finished since the last call; waits up to `poll_s` for one."""
        if WEIGHTS in self._released:
            raise RuntimeError("step: weights were released; call resume_memory + load_weights")
        self._collect()
        if not any(r.result is not None for r in self._reqs.values()):
            pending = [r.task for r in self._reqs.values() if r.task is not None]
            if pending:
                self._run(
                    asyncio.wait(pending, timeout=self.poll_s, return_when=asyncio.FIRST_COMPLETED)
                )
                self._collect()
        out = [r.result for r in self._reqs.values() if r.result is not None]
        for r in out:
            del self._reqs[r.seq_id]
        if self._flush_pending and not self._reqs and KV_CACHE not in self._released:
            self._flush_pending = not self.engine.flush_cache().success
        return out

    def abort(self, seq_id: int) -> SeqResult:
        """Stop a sequence; its result holds every token so far. If it finished before the
        abort took effect (and was not reported by step yet), that finished result is
        returned instead; a sequence step already reported raises KeyError (as `hf`)."""
        rec = self._reqs.get(seq_id)
        if rec is None:
            raise KeyError(f"abort: sequence {seq_id} is not in this engine")
        if rec.result is None:
            task = rec.task
            assert task is not None
            if not task.done() and not rec.started:
                task.cancel()  # never reached SGLang: nothing to abort there
                self._run(asyncio.wait([task]))
            elif not task.done():
                self._wait_dispatched(rec)
                if not task.done():
                    rec.abort_sent = True
                    self.engine.tokenizer_manager.abort_request(rid=rec.rid)
                    self._run(asyncio.wait([task], timeout=self.abort_timeout_s))
                    if not task.done():
                        raise RuntimeError(
                            f"abort: SGLang did not end sequence {seq_id} (rid {rec.rid}) "
                            f"within {self.abort_timeout_s} s"
                        )
            self._collect_one(rec)
        del self._reqs[seq_id]
        assert rec.result is not None
        return rec.result

    def abort_all(self) -> list[SeqResult]:
        return [self.abort(i) for i in list(self._reqs)]

    def seq_lengths(self) -> dict[int, int]:
        """Context length (prompt + generated) of every sequence in the engine."""
        return {r.seq_id: r.context_len() for r in self._reqs.values()}

    def stats(self) -> EngineStats:
        """From SGLang's load snapshot; the adapter's own count until one is published."""
        loads = self._run(self.engine.tokenizer_manager.get_loads())
        if not loads:
            live = [r for r in self._reqs.values() if r.result is None]
            return EngineStats(
                running=len(live),
                waiting=0,
                tokens_in_cache=sum(r.context_len() for r in live),
                kv_capacity=self.kv_capacity,
                last_step_s=self._last_step_s,
                preemptions=self._retractions,
            )
        snap = loads[0]  # one scheduler: the adapter never enables data parallelism
        steps = 0
        if snap.decode_moments:  # [steps, Σ batch, Σ step µs, ...] (scheduler.py)
            steps, step_us = snap.decode_moments[0], snap.decode_moments[2]
            if self._moments is not None and steps > self._moments[0]:
                d_us = step_us - self._moments[1]
                self._last_step_s = d_us / (steps - self._moments[0]) / 1e6
            self._moments = (steps, step_us)
        return EngineStats(
            running=snap.num_running_reqs,
            waiting=snap.num_waiting_reqs,
            tokens_in_cache=snap.num_used_tokens,
            kv_capacity=snap.max_total_num_tokens or self.kv_capacity,
            last_step_s=self._last_step_s,
            steps=int(steps),
            preemptions=self._retractions,
        )

    def load_weights(self, tensors: Tensors, version: int) -> None:
        """Send canonical HF tensors to SGLang in flattened buckets; later tokens record
        `version`. Running sequences are paused in place and continue afterwards."""
        if WEIGHTS in self._released:
            raise RuntimeError("load_weights: call resume_memory() first")
        self._collect()  # results finished so far belong to the old version
        running = any(r.result is None for r in self._reqs.values())
        tm = self.engine.tokenizer_manager
        if running:
            self._run(tm.pause_generation(self.api.pause_req(mode="in_place")))
        try:
            self._check("begin_weight_update", self.engine.begin_weight_update())
            try:
                self._send_buckets(tensors, flush=not running and KV_CACHE not in self._released)
            finally:
                self._check("end_weight_update", self.engine.end_weight_update())
            req = self.api.weight_version_req(new_version=str(version), abort_all_requests=False)
            self._run(tm.update_weight_version(req))
        finally:
            if running:
                self._run(tm.continue_generation(self.api.continue_req()))
        self.version = version
        self._weights_stale = False
        self._flush_pending = self._flush_pending or running
        # slime's order: KV cache and CUDA graphs only after the weights are in place
        if self._resume_after_load:
            self.engine.resume_memory_occupation(tags=self._resume_after_load)
            self._released.difference_update(self._resume_after_load)
            self._resume_after_load = []

    def release_memory(self, weights: bool = False) -> None:
        """Free the KV cache and CUDA graphs (and the weights if asked); must be idle."""
        if self.has_unfinished():
            raise RuntimeError("release_memory: abort the engine's sequences first")
        wanted = [KV_CACHE, CUDA_GRAPH, *([WEIGHTS] if weights else [])]
        tags = [t for t in wanted if t not in self._released]  # SGLang cannot pause twice
        if tags:
            self.engine.release_memory_occupation(tags=tags)
            self._released.update(tags)
        if KV_CACHE in tags:
            self._flush_pending = False  # releasing the KV cache flushes it
        self._resume_after_load = []
        if weights:
            self._weights_stale = True

    def resume_memory(self) -> None:
        """Weights first; with weights released, the KV cache and CUDA graphs wait for
        `load_weights` (which must follow anyway: released weights have no contents)."""
        if WEIGHTS in self._released:
            self.engine.resume_memory_occupation(tags=[WEIGHTS])
            self._released.discard(WEIGHTS)
            self._resume_after_load = [t for t in (KV_CACHE, CUDA_GRAPH) if t in self._released]
            return
        rest = [t for t in (KV_CACHE, CUDA_GRAPH) if t in self._released]
        if rest:
            self.engine.resume_memory_occupation(tags=rest)
            self._released.difference_update(rest)

    def close(self) -> None:
        """Shut SGLang's processes down (also registered by Engine with atexit)."""
        self.engine.shutdown()

    # ------------------------------------------------------------ internals
    def _run(self, aw: Any) -> Any:
        return self._loop.run_until_complete(aw)

    async def _generate(self, rec: _Req, params: dict) -> dict | None:
        rec.started = True
        chunks = await self.engine.async_generate(
            input_ids=rec.prompt + rec.prior_ids,
            sampling_params=params,
            return_logprob=True,
            stream=True,
            rid=rec.rid,
        )
        last = None
        async for chunk in chunks:  # cumulative chunks (incremental_streaming_output off)
            last = chunk
            rec.n_new = len(chunk["output_ids"])
        return last

    def _mark_done(self, rec: _Req) -> None:
        # Runs inside the loop as the request completes: a weight update in progress has not
        # switched `self.version` yet, so its last token came from the old weights.
        rec.done_version = self.version

    def _wait_dispatched(self, rec: _Req) -> None:
        """Run the loop until SGLang has sent the request to its scheduler (or it ended)."""
        tm = self.engine.tokenizer_manager
        assert rec.task is not None
        deadline = self._loop.time() + self.abort_timeout_s
        while not rec.task.done():
            state = tm.rid_to_state.get(rec.rid)
            if state is not None and state.dispatched:
                return
            if self._loop.time() > deadline:
                raise RuntimeError(f"abort: SGLang never dispatched {rec.rid} to its scheduler")
            self._run(asyncio.sleep(0.001))

    def _collect(self) -> None:
        for rec in list(self._reqs.values()):
            if rec.result is None and rec.task is not None and rec.task.done():
                self._collect_one(rec)

    def _collect_one(self, rec: _Req) -> None:
        task = rec.task
        assert task is not None and task.done()
        try:
            rec.result = self._parse(rec, task)
        except BaseException:
            self._reqs.pop(rec.seq_id, None)  # a failed sequence is not retried here
            raise

    def _parse(self, rec: _Req, task: asyncio.Task) -> SeqResult:
        if task.cancelled():
            return self._result(rec, [], [], "abort")
        exc = task.exception()
        if exc is not None:
            raise RuntimeError(
                f"sglang: sequence {rec.seq_id} (rid {rec.rid}) failed: {exc!r}"
            ) from exc
        out = task.result()
        if out is None:
            raise RuntimeError(f"sglang: sequence {rec.seq_id} ended without output")
        meta = out["meta_info"]
        reason = (meta.get("finish_reason") or {}).get("type")
        if reason not in ("stop", "length", "abort"):
            raise RuntimeError(f"sglang: sequence {rec.seq_id} ended with {meta!r}")
        if reason == "abort" and not rec.abort_sent:
            # SGLang ended it on its own (input too long, timeout, ...): not a preemption.
            raise RuntimeError(
                f"sglang aborted sequence {rec.seq_id}: {meta['finish_reason'].get('message')}"
            )
        ids = [int(t) for t in out["output_ids"]]
        entries = meta.get("output_token_logprobs") or []
        lps = [e[0] for e in entries]
        if [int(e[1]) for e in entries] != ids or any(lp is None for lp in lps):
            raise RuntimeError(
                f"sglang: sequence {rec.seq_id}: output_token_logprobs do not cover "
                f"output_ids ({len(entries)} logprobs for {len(ids)} tokens)"
            )
        self._retractions += int(meta.get("num_retractions") or 0)
        return self._result(rec, ids, [float(lp) for lp in lps], reason)

    def _already_done(self, rec: _Req, n_ctx: int) -> str | None:
        """Finish reason of a resumed sequence that cannot generate more."""
        sp, gen = rec.sampling, rec.prior_ids
        if gen and (
            gen[-1] in sp.stop_token_ids or (not sp.ignore_eos and gen[-1] in self.eos_ids)
        ):
            return "stop"  # e.g. aborted just after it finished elsewhere
        if len(gen) >= sp.max_tokens or not self._fits(n_ctx):
            return "length"  # as `hf`: a sequence ends with "length" at the context limit
        return None

    def _fits(self, n_ctx: int) -> bool:
        """Room for `n_ctx` tokens of input plus one new token."""
        return n_ctx < self.max_input_len and n_ctx + 1 <= min(self.max_seq_len, self.kv_capacity)

    def _result(self, rec: _Req, ids: list[int], lps: list[float], reason: str) -> SeqResult:
        return SeqResult(
            seq_id=rec.seq_id,
            prompt_ids=list(rec.prompt),
            token_ids=rec.prior_ids + ids,
            logprobs=rec.prior_lps + lps,
            finish_reason=reason,  # type: ignore[arg-type]
            version=rec.done_version,
        )

    def _send_buckets(self, tensors: Tensors, flush: bool) -> None:
        for payloads, last in serialized_buckets(
            tensors,
            max_bytes=self.weight_bucket_bytes,
            tp_size=self.tp_size,
            bucket_cls=self.api.bucket_cls,
            serializer=self.api.serializer,
        ):
            res = self.engine.update_weights_from_tensor(
                named_tensors=payloads,
                load_format="flattened_bucket",
                flush_cache=flush and last,  # one flush, after the last bucket
            )
            self._check("update_weights_from_tensor", res)

    @staticmethod
    def _check(what: str, res: Any) -> None:
        ok, msg = res[0], res[1]
        if not ok:
            raise RuntimeError(f"sglang {what} failed: {msg}")
