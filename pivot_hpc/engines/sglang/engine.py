"""The `sglang` InferenceEngine: one SGLang Engine per replica leader, token-in/token-out.

Targets SGLang 0.5.23 (pinned by the `gpu` extra). Every call below was read from that
release's source (paths under python/sglang/srt/):

- `Engine(**ServerArgs fields)` (entrypoints/engine.py): model_path, tp_size (= the
  replica's GPUs), base_gpu_id 0 over CUDA_VISIBLE_DEVICES = the replica's GPUs, ports,
  skip_tokenizer_init=True (input_ids in, output_ids out), enable_memory_saver=True
  (release/resume), context_length, max_total_tokens (= the role's kv_capacity_tokens),
  max_running_requests, chunked_prefill_size, mem_fraction_static, random_seed. Placement,
  ports and the memory budget are chosen around the start (engines/sglang/launch.py, factory.py).
- Generation: `await engine.async_generate(input_ids=, sampling_params=, return_logprob=True,
  stream=True, rid=)` yields cumulative chunks `{"output_ids", "meta_info": {"finish_reason":
  {"type": "stop"|"length"|"abort", ...}, "output_token_logprobs": [(logprob, id, None)]}}`.
  The stop token is part of `output_ids` (`Req.output_ids_through_stop`). Streaming, every
  `stream_interval` tokens, feeds `seq_lengths` and `snapshot`. Logprobs are SGLang's
  default, log softmax(logits / T), T = 1 for greedy; do not set
  SGLANG_RETURN_ORIGINAL_LOGPROB.
- Abort: `engine.tokenizer_manager.abort_request(rid=)` (Engine has no abort method). A
  running request ends after one more forward pass with its partial output and finish
  reason "abort"; a queued one with no new tokens. The scheduler matches rids by prefix
  (`req.rid.startswith(rid)`), so every rid ends with "/". An abort that reaches the
  scheduler before the request is lost, so abort first waits for
  `tokenizer_manager.rid_to_state[rid].dispatched`.
- Signals: the tokenizer manager's handle loop installs SIGTERM and SIGQUIT handlers on
  the event loop (`auto_create_handle_loop`, managers/tokenizer_manager.py:2440-2459); its
  SIGTERM handler drains and exits the process, which would skip the checkpoint a
  preempted job owes (runtime/stop.py). The adapter creates that loop at once and takes
  SIGTERM back (`loop.remove_signal_handler`, then `reclaim_signals`: the worker passes
  `stop.reinstall`); SIGQUIT stays
  SGLang's: it is how a dying scheduler child takes the rank down.
- Idle: "every request finished" is not "the scheduler is idle" (the overlap loop keeps the
  last batch one more step, managers/scheduler.py:2061-2131), and
  `release_memory_occupation` asserts idle (scheduler_components/weight_updater.py:337-340;
  a failed assert SIGQUITs the rank). `flush_cache()` succeeds only when idle, so before
  every release, after a weight update and before new work on a stale prefix cache, the
  adapter retries it until it succeeds (slime: 60 × 1 s), up to `idle_timeout_s`.
- Memory: `release_memory_occupation(tags)` / `resume_memory_occupation(tags)`, tags
  "weights", "kv_cache", "cuda_graph". A tag can only be resumed after it was released. As
  in slime, weights come back first and the KV cache and CUDA graphs only after the new
  weights are loaded, so the staging buffers of the update never compete with the KV pool.
- Weights: `begin_weight_update()`, then per bucket `update_weights_from_tensor(payloads,
  load_format="flattened_bucket", flush_cache=False)`, then `end_weight_update()` (0.5.23
  refuses tensor updates outside that session), then one flush with retry
  (`flush_cache=True` on a bucket fails the whole update when the scheduler is not idle
  yet, weight_updater.py:118-131); see engines/sglang/weights.py. Buckets travel through /dev/shm,
  which must hold the largest one. The version is also given to SGLang
  (`tokenizer_manager.update_weight_version`, shown as meta_info["weight_version"]), but
  SeqResult.version comes from the adapter: SGLang keeps that field in process-wide
  config. With requests running, the update pauses the scheduler
  (`pause_generation(mode=engines.<role>.pause_mode)` ... `continue_generation`).
  `retract` (the default) drains the batch in flight and retracts the running requests:
  with SGLang's overlap scheduler an in-place pause leaves the last launched decode step
  running while the weights are overwritten (one torn step per update); retracted
  requests keep their tokens and are prefilled again under the new weights. `in_place`
  keeps their KV cache (no re-prefill) and is accepted only with
  `server_args.disable_overlap_schedule: true`.
  The prefix cache from the old weights is flushed once the engine is idle.
- Stats: `tokenizer_manager.get_loads()` returns the LoadSnapshot the scheduler publishes for
  /v1/loads (num_running_reqs, num_waiting_reqs, num_used_tokens, max_total_num_tokens,
  decode_moments = [steps, Σ batch size, Σ step µs, ...]). It is read from shared memory
  with no round trip, and is a few steps stale. The decode steps between two `stats` calls
  give the mean step latency and batch size (`last_step_*`). `/get_load` no longer exists.
- Checkpoints: `snapshot` is built from the streamed chunks the adapter already holds
  (output_ids and their logprobs): it disturbs nothing, and misses at most the
  `stream_interval - 1` newest tokens of each sequence, which are generated again after a
  resume. The sampling RNG lives in the scheduler process (seeded by random_seed) and is
  not exported (`rng_state` is None).

Concurrency: single-threaded. SGLang's own event loop (`engine.loop`, the thread's loop;
importing sglang's engine module makes uvloop the process's loop policy) runs only inside
the adapter's calls: step() runs it until a request finishes or `poll_s` passes, while the
scheduler process keeps decoding regardless. No thread and no lock are needed, and Engine's
synchronous methods (which call `loop.run_until_complete`) stay usable.

One SGLang Engine per process: Engine.__init__ publishes its ServerArgs process-wide
(`runtime_context.publish`, "replaces whatever was published before it"). Both roles may
use sglang; a worker then holds one SGLang engine at a time and closes it before it starts
the other role's (runtime/worker.py).
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pivot_hpc.engines.base import (
    EngineStats,
    InRank,
    SamplingParams,
    SeqResult,
    Tensors,
    check_new_sequence,
)
from pivot_hpc.engines.sglang.weights import bucket_nbytes, plan_buckets, serialized_buckets
from pivot_hpc.errors import PivotError

SGLANG_VERSION = "0.5.23"
WEIGHTS, KV_CACHE, CUDA_GRAPH = "weights", "kv_cache", "cuda_graph"


class SGLangUnavailable(PivotError, ImportError):
    """SGLang is not installed (it is the `gpu` extra): one line, not a traceback."""


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
    # the latest stream chunk's output_ids and output_token_logprobs (for `snapshot`)
    out_ids: list[int] = field(default_factory=list)
    out_lps: list = field(default_factory=list)
    abort_sent: bool = False
    done_version: int = 0  # adapter version when the request completed
    result: SeqResult | None = None

    def context_len(self) -> int:
        return len(self.prompt) + len(self.prior_ids) + self.n_new


class SGLangEngine(InRank):
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
        idle_timeout_s: float = 60.0,
        pause_mode: str = "retract",
        config_key: str = "engines.<role>",
        shm_dir: str | Path = "/dev/shm",
        reclaim_signals: Callable[[], object] | None = None,
    ) -> None:
        self.engine = engine
        self.reclaim_signals = reclaim_signals  # our SIGTERM handler back (runtime/stop.py)
        self.api = api
        self.tp_size = tp_size
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self.eos_ids = frozenset(eos_token_ids)
        self.weight_bucket_bytes = weight_bucket_bytes
        self.stream_interval = stream_interval
        self.poll_s = poll_s
        self.abort_timeout_s = abort_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.pause_mode = pause_mode  # how a weight update pauses running requests
        self.config_key = config_key
        self.shm_dir = Path(shm_dir)
        self.weights_device = "cpu"  # buckets go to SGLang through host shared memory
        self.version = 0
        self._loop: asyncio.AbstractEventLoop = engine.loop
        self._reqs: dict[int, _Req] = {}
        self._rids = itertools.count()
        self._released: set[str] = set()
        self._weights_stale = False  # weights released: contents undefined until load_weights
        self._resume_after_load: list[str] = []  # KV cache / CUDA graphs held back (slime order)
        self._flush_pending = False  # prefix cache holds KV computed with old weights
        # (decode steps, Σ batch size, Σ step µs) of the load snapshot seen last
        self._moments: tuple[float, float, float] | None = None
        self._last_step_s = 0.0
        self._last_step_seqs = 0
        self._last_step_tokens = 0
        self._closed = False
        self._retractions = 0
        info = engine.get_server_info()
        self.kv_capacity = int(info["max_total_num_tokens"])
        # SGLang rejects an input of max_req_input_len tokens or more (scheduler-side abort)
        self.max_input_len = int(info["max_req_input_len"])
        # SGLang's handle loop (and with it its SIGTERM handler) now rather than at the
        # first request: SIGTERM is ours again before any request can run
        engine.tokenizer_manager.auto_create_handle_loop()
        self._reclaim_sigterm()

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
        if self._flush_pending and not any(r.result is None for r in self._reqs.values()):
            # the prefix cache holds KV from old weights and nothing runs: drop it before
            # new work can match it (step() stops being called once the engine is empty)
            self._until_idle("add")
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

    def snapshot(self) -> list[SeqResult]:
        """Every sequence's tokens so far, from the chunks already streamed (see the module
        docstring: up to stream_interval - 1 of the newest tokens are not in it yet)."""
        out = []
        for rec in self._reqs.values():
            if rec.result is not None:  # finished, not yet reported by step
                r = rec.result
                ids, lps, version = r.token_ids[len(rec.prior_ids) :], r.logprobs, r.version
                lps = lps[len(rec.prior_lps) :]
            else:
                ids, lps = [], []
                for t, e in zip(rec.out_ids, rec.out_lps, strict=False):
                    if e[0] is None or int(e[1]) != int(t):
                        break  # keep the prefix whose logprobs are known
                    ids.append(int(t))
                    lps.append(float(e[0]))
                version = self.version
            snap = self._result(rec, list(ids), list(lps), "abort")
            snap.version = version
            out.append(snap)
        return out

    def rng_state(self) -> None:
        return None  # SGLang samples in its scheduler process (seeded by random_seed)

    def set_rng_state(self, state: Any) -> None:
        pass  # nothing to restore (see rng_state)

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
            steps, batch, step_us = (float(x) for x in snap.decode_moments[:3])
            if self._moments is not None and steps > self._moments[0]:
                d = steps - self._moments[0]
                # the decode steps since the last call: mean latency and batch size, what
                # the monitor refits the throughput model on (N_tok: the cache + one each)
                self._last_step_s = (step_us - self._moments[2]) / d / 1e6
                self._last_step_seqs = max(1, round((batch - self._moments[1]) / d))
                self._last_step_tokens = snap.num_used_tokens + self._last_step_seqs
            self._moments = (steps, batch, step_us)
        return EngineStats(
            running=snap.num_running_reqs,
            waiting=snap.num_waiting_reqs,
            tokens_in_cache=snap.num_used_tokens,
            kv_capacity=snap.max_total_num_tokens or self.kv_capacity,
            last_step_s=self._last_step_s,
            last_step_seqs=self._last_step_seqs,
            last_step_tokens=self._last_step_tokens,
            steps=int(steps),
            preemptions=self._retractions,
        )

    def load_weights(self, tensors: Tensors, version: int) -> None:
        """Send canonical HF tensors to SGLang in flattened buckets; later tokens record
        `version`. Running sequences are paused (pause_mode) and continue afterwards."""
        if WEIGHTS in self._released:
            raise RuntimeError("load_weights: call resume_memory() first")
        plan = plan_buckets(tensors, self.weight_bucket_bytes)
        self._check_shm(tensors, plan)
        self._collect()  # results finished so far belong to the old version
        running = any(r.result is None for r in self._reqs.values())
        tm = self.engine.tokenizer_manager
        if running:
            self._run(tm.pause_generation(self.api.pause_req(mode=self.pause_mode)))
        try:
            self._check("begin_weight_update", self.engine.begin_weight_update())
            try:
                self._send_buckets(tensors, plan)
            finally:
                self._check("end_weight_update", self.engine.end_weight_update())
            req = self.api.weight_version_req(new_version=str(version), abort_all_requests=False)
            self._run(tm.update_weight_version(req))
        finally:
            if running:
                self._run(tm.continue_generation(self.api.continue_req()))
        self.version = version
        self._weights_stale = False
        if KV_CACHE not in self._released:
            # the prefix cache holds KV of the old weights: one flush now if nothing runs
            # (with retry: idle comes a step late), else once the engine is idle
            self._flush_pending = True
            if not running:
                self._until_idle("load_weights")
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
            if KV_CACHE not in self._released:
                self._until_idle("release_memory")  # release asserts idle; failing kills
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
        if not self._closed:
            self._closed = True
            self._reqs.clear()
            self.engine.shutdown()

    # ------------------------------------------------------------ internals
    def _run(self, aw: Any) -> Any:
        try:
            return self._loop.run_until_complete(aw)
        finally:
            self._reclaim_sigterm()

    def _reclaim_sigterm(self) -> None:
        """Take SIGTERM back from SGLang's event loop if it holds it (module docstring)."""
        if self._loop.remove_signal_handler(signal.SIGTERM):
            if self.reclaim_signals is not None:
                self.reclaim_signals()
            else:  # nobody to give it to: the default action (the process ends)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def _until_idle(self, why: str) -> None:
        """Retry flush_cache() until the scheduler is idle (it succeeds only then); the
        loop keeps running meanwhile, so SGLang's tokenizer side is served."""
        deadline = time.monotonic() + self.idle_timeout_s
        delay = 0.05
        while not self.engine.flush_cache().success:
            if time.monotonic() + delay > deadline:
                raise RuntimeError(
                    f"config key '{self.config_key}.idle_timeout_s' = {self.idle_timeout_s}: "
                    f"SGLang's scheduler was still busy that long after its last request "
                    f"({why}); raise it if the scheduler is slow to settle"
                )
            self._run(asyncio.sleep(delay))
            delay = min(1.0, delay * 2)
        self._flush_pending = False

    def _check_shm(self, tensors: Tensors, plan: list[list[str]]) -> None:
        """Each bucket crosses to SGLang in /dev/shm: refuse before any byte moves if the
        largest cannot fit (a full /dev/shm fails inside SGLang with SIGBUS or ENOSPC)."""
        if not plan or not self.shm_dir.is_dir():
            return
        largest = max(bucket_nbytes(tensors, names) for names in plan)
        free = shutil.disk_usage(self.shm_dir).free
        if largest > free:
            raise RuntimeError(
                f"config key '{self.config_key}.weight_bucket_mb' = "
                f"{self.weight_bucket_bytes >> 20}: a weight bucket of {largest / 2**20:.0f} "
                f"MiB does not fit in {self.shm_dir} ({free / 2**20:.0f} MiB free); lower "
                "weight_bucket_mb (a single tensor larger than it travels alone) or give the "
                "job more shared memory (a container's --shm-size)"
            )

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
            rec.out_ids = chunk["output_ids"]
            rec.out_lps = chunk["meta_info"].get("output_token_logprobs") or []
            rec.n_new = len(rec.out_ids)
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

    def _send_buckets(self, tensors: Tensors, plan: list[list[str]]) -> None:
        for bucket in serialized_buckets(
            tensors,
            plan=plan,
            tp_size=self.tp_size,
            bucket_cls=self.api.bucket_cls,
            serializer=self.api.serializer,
        ):
            # `bucket` (its shared memory) stays referenced until SGLang has taken it;
            # no flush here: it would fail the update while the scheduler settles
            res = self.engine.update_weights_from_tensor(
                named_tensors=bucket.payloads, load_format="flattened_bucket", flush_cache=False
            )
            self._check("update_weights_from_tensor", res)
            del bucket

    @staticmethod
    def _check(what: str, res: Any) -> None:
        ok, msg = res[0], res[1]
        if not ok:
            raise RuntimeError(f"sglang {what} failed: {msg}")
