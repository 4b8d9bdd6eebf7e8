"""A fake SGLang 0.5.23 at the Engine boundary, for the adapter tests and the conformance
suite (SGLang cannot be installed or run on this CPU-only machine, docs/platform.md).

Same method names and signatures as the real Engine for what the adapter calls, and the
awkward behaviours the adapter must survive, each from the 0.5.23 source:
- aborts match rids by prefix, and an abort of a rid the scheduler has not received yet is
  dropped (tokenizer_manager.abort_request);
- the scheduler is idle `idle_lag` flush attempts after its last request ended (the overlap
  loop keeps the last batch one more step): `flush_cache` fails until then, a
  `release_memory_occupation` meanwhile kills the rank (FakeRankKilled, the SIGQUIT of
  SGLang's failed idle assert), and `update_weights_from_tensor(flush_cache=True)` fails;
- the handle loop installs SIGTERM/SIGQUIT handlers on the event loop, and SGLang's SIGTERM
  handler exits the process (here: raises SystemExit);
- a bucket's shared memory must still exist when the scheduler unpickles it;
- placement: the scheduler's GPU is base_gpu_id + tp_rank among CUDA_VISIBLE_DEVICES as it
  was when Engine() ran, and each engine binds its own port and nccl_port;
- memory (FakeNode): the KV pool is free_before · mem_fraction_static - weights, "Not
  enough memory" when that is not positive; tp > 1 refuses GPUs with unequal free memory;
  the memory saver refuses expandable segments.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import pickle
import signal
import socket
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from pivot_hpc.engines.config import InferenceEngineConfig
from pivot_hpc.engines.sglang.engine import SGLangAPI, SGLangEngine
from pivot_hpc.engines.sglang.launch import make_sglang_engine
from pivot_hpc.runtime import stop

VOCAB = 50
EOS = 49
ALL_TAGS = ("kv_cache", "weights", "cuda_graph")
GIB = 1 << 30
SGLANG_DEFAULT_FRACTION = 0.88  # what SGLang picks on a large GPU when none is given


class FakeRankKilled(BaseException):
    """SGLang's scheduler died on an assertion and SIGQUIT took the rank down."""


class FakeNode:
    """The node's GPUs as SGLang would measure them: free bytes per device id."""

    def __init__(self, gpus: int = 8, free_gib: float = 80.0) -> None:
        self.free = {str(i): int(free_gib * GIB) for i in range(gpus)}
        self.ports_in_use: set[int] = set()

    def free_memory(self, visible: str | None) -> list[int]:
        """Stands in for engines/sglang/launch.py free_gpu_bytes (NVML)."""
        ids = visible.split(",") if visible else list(self.free)
        return [self.free[i] for i in ids]


def _listen(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("", port))
    except OSError as exc:
        sock.close()
        raise RuntimeError(f"Address already in use: {port}") from exc
    sock.listen(1)
    return sock


NODE = FakeNode()
_SHARED: dict[int, weakref.ref] = {}  # FakeSerializer's "shared memory": id -> the tensor
_tokens = itertools.count()


class FakeFlattenedTensorBucket:
    """Stand-in for sglang.srt.weight_sync.tensor_bucket.FlattenedTensorBucket (0.5.23):
    tensors flattened to one uint8 buffer plus (name, shape, dtype, start, end, numel)."""

    def __init__(self, named_tensors=None, flattened_tensor=None, metadata=None):
        if named_tensors is not None:
            if not named_tensors:
                raise ValueError("Cannot create empty tensor bucket")
            parts, self.metadata, idx = [], [], 0
            for name, t in named_tensors:
                flat = t.flatten().view(torch.uint8)
                self.metadata.append(
                    SimpleNamespace(
                        name=name,
                        shape=t.shape,
                        dtype=t.dtype,
                        start_idx=idx,
                        end_idx=idx + flat.numel(),
                        numel=flat.numel(),
                    )
                )
                parts.append(flat)
                idx += flat.numel()
            self.flattened_tensor = torch.cat(parts)
        else:
            self.flattened_tensor, self.metadata = flattened_tensor, metadata

    def get_flattened_tensor(self):
        return self.flattened_tensor

    def get_metadata(self):
        return self.metadata

    def reconstruct_tensors(self):
        return [
            (m.name, self.flattened_tensor[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape))
            for m in self.metadata
        ]


class FakeSerializer:
    """Stand-in for sglang.srt.utils.MultiprocessingSerializer. Like torch's ForkingPickler
    with shared memory, the bytes only name the producer's tensor: the receiver finds it
    only while the producer still holds it."""

    @staticmethod
    def serialize(obj, output_str: bool = False):
        token = next(_tokens)
        _SHARED[token] = weakref.ref(obj["flattened_tensor"])
        return pickle.dumps({"shared": token, "metadata": obj["metadata"]})

    @staticmethod
    def deserialize(data) -> dict:
        d = pickle.loads(data)
        t = _SHARED.pop(d["shared"])()
        if t is None:
            raise RuntimeError("bucket freed by the producer before the scheduler read it")
        return {"flattened_tensor": t, "metadata": d["metadata"]}


@dataclass
class FakePauseReq:  # io_struct.PauseGenerationReqInput
    mode: str = "abort"


@dataclass
class FakeContinueReq:  # io_struct.ContinueGenerationReqInput
    torch_empty_cache: bool = True


@dataclass
class FakeWeightVersionReq:  # io_struct.UpdateWeightVersionReqInput
    new_version: str
    abort_all_requests: bool = True


@dataclass
class FakeReqState:  # tokenizer_manager.ReqState: the fields the adapter reads
    dispatched: bool = False
    abort_sent: bool = False


@dataclass
class FakeLoad:  # managers/load_snapshot.py LoadSnapshot: the fields the adapter reads
    num_running_reqs: int
    num_waiting_reqs: int
    num_used_tokens: int
    max_total_num_tokens: int
    decode_moments: list[float] | None


@dataclass(eq=False)
class _Live:
    rid: str
    input_ids: list[int]
    params: dict
    out: list[int] = field(default_factory=list)
    aborted: bool = False
    reject: str | None = None


class FakeTokenizerManager:
    """Stand-in for SGLang's TokenizerManager: abort, loads, pause/continue, weight version."""

    def __init__(self, engine: FakeSGLangEngine) -> None:
        self.engine = engine
        self.rid_to_state: dict[str, FakeReqState] = {}

    def abort_request(self, rid: str = "", abort_all: bool = False):
        e = self.engine
        e.calls.append(("abort_request", rid))
        if not abort_all and not rid:
            return
        state = None if abort_all else self.rid_to_state.get(rid)
        if not abort_all:
            if state is None or state.abort_sent:
                return
            state.abort_sent = True
        # The scheduler matches by prefix, and only requests it has received.
        for live in e.live.values():
            if abort_all or live.rid.startswith(rid):
                live.aborted = True
        e.notify()

    async def get_loads(self, include=None, dp_rank=None):
        e = self.engine
        if not e.publish_loads:
            return []
        return [
            FakeLoad(
                num_running_reqs=len(e.live),
                num_waiting_reqs=e.waiting_reported,
                num_used_tokens=sum(len(x.input_ids) + len(x.out) for x in e.live.values()),
                max_total_num_tokens=e.server_args["max_total_tokens"],
                decode_moments=[e.steps, e.steps * e.batch_per_step, e.steps * 1000.0, 0, 0, 0]
                if e.steps
                else None,
            )
        ]

    def auto_create_handle_loop(self):
        """As SGLang's: the first call starts the handle loop and installs SIGTERM and SIGQUIT
        handlers on the event loop (main thread only)."""
        e = self.engine
        if e.handlers_installed:
            return
        e.handlers_installed = True
        e.loop.add_signal_handler(signal.SIGTERM, e.sigterm_exit)
        e.loop.add_signal_handler(signal.SIGQUIT, e.sigquit_seen.append, signal.SIGQUIT)

    async def pause_generation(self, obj):
        self.engine.calls.append(("pause", obj.mode))
        self.engine.paused = True

    async def continue_generation(self, obj):
        self.engine.calls.append(("continue",))
        self.engine.paused = False
        self.engine.notify()

    async def update_weight_version(self, obj):
        self.engine.calls.append(("weight_version", obj.new_version, obj.abort_all_requests))
        self.engine.weight_version = obj.new_version


class FakeSGLangEngine:
    """Stand-in for sglang.srt.entrypoints.engine.Engine 0.5.23 (module docstring).
    Generation is deterministic and runs on `self.loop`: the next token is (last + 1) %
    VOCAB with logprob -0.5, one token per loop iteration while `credit` (None = unlimited)
    allows; EOS ends a request unless ignore_eos."""

    node = NODE

    def __init__(self, **kwargs):
        self.server_args = kwargs
        self._start_gpus(kwargs)
        self.loop = asyncio.new_event_loop()
        self.tokenizer_manager = FakeTokenizerManager(self)
        self.calls: list[tuple] = []
        self.requests: list[dict] = []  # what async_generate received
        self.live: dict[str, _Live] = {}  # requests inside the "scheduler"
        self._credit: int | None = None
        self.paused = False
        self.released: set[str] = set()
        self.session = False
        self.weights_valid = True
        self.weight_version = "default"
        self.loaded: list[dict[str, torch.Tensor]] = [{} for _ in range(kwargs.get("tp_size", 1))]
        self.buckets: list[list[tuple[str, torch.dtype, int]]] = []
        self.steps = 0
        self.publish_loads = True
        self.waiting_reported = 0
        self.dispatch_delay = 1  # loop iterations between registering a rid and dispatching
        self.reject_next: str | None = None
        self.n_finished = 0
        self._changed = asyncio.Event()
        self.idle_lag = 1  # flush attempts that still find the scheduler busy (one step)
        self._lag = 0
        self.batch_per_step = 1  # what decode_moments report as each step's batch size
        self.handlers_installed = False
        self.sigquit_seen: list[int] = []
        self.closed = False

    def _start_gpus(self, kw: dict) -> None:
        """Placement, ports and the KV pool, as SGLang checks them at its start."""
        node = self.node
        raw = os.environ.get("CUDA_VISIBLE_DEVICES")
        # as CUDA: unset = every GPU of the node, "" = none
        self.visible = [d for d in raw.split(",") if d] if raw is not None else list(node.free)
        tp, base = kw.get("tp_size", 1), kw["base_gpu_id"]
        if base + tp > len(self.visible):
            raise RuntimeError(
                f"CUDA error: invalid device ordinal (base_gpu_id {base} + tp {tp} > "
                f"{len(self.visible)} visible)"
            )
        self.gpus = self.visible[base : base + tp]
        ports = {kw.get("port", 30000), kw.get("nccl_port")} - {None}
        if ports & node.ports_in_use:
            raise RuntimeError(f"Address already in use: {sorted(ports & node.ports_in_use)}")
        # held for real, as SGLang's scheduler holds its torch.distributed store port
        self._sockets = [_listen(port) for port in sorted(ports)]
        if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
            raise RuntimeError("torch_memory_saver does not support expandable segments")
        free = [node.free[g] for g in self.gpus]
        if tp > 1 and min(free) < 0.9 * max(free):
            raise RuntimeError("The memory capacity is unbalanced. Some GPUs may be occupied")
        weights = sum(f.stat().st_size for f in Path(kw["model_path"]).glob("*.safetensors"))
        frac = kw.get("mem_fraction_static") or SGLANG_DEFAULT_FRACTION
        self.kv_pool_bytes = min(free) * frac - weights / tp
        if self.kv_pool_bytes <= 0:
            raise RuntimeError(
                "Not enough memory. Please try to increase --mem-fraction-static. "
                f"Current value: mem_fraction_static={frac}"
            )
        self.ports = ports
        node.ports_in_use |= ports

    def sigterm_exit(self) -> None:
        raise SystemExit(0)  # SGLang's handler: drain, then sys.exit(0)

    @property
    def busy(self) -> bool:
        return bool(self.live) or self._lag > 0

    @property
    def credit(self) -> int | None:
        """Tokens the fake may still generate (None = unlimited); setting it wakes decoding."""
        return self._credit

    @credit.setter
    def credit(self, value: int | None) -> None:
        self._credit = value
        self.notify()

    def notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def async_generate(
        self,
        prompt=None,
        sampling_params=None,
        input_ids=None,
        image_data=None,
        audio_data=None,
        video_data=None,
        mm_hashes=None,
        mm_content_hashes=None,
        return_logprob=False,
        logprob_start_len=None,
        top_logprobs_num=None,
        token_ids_logprob=None,
        lora_path=None,
        custom_logit_processor=None,
        require_reasoning=False,
        return_hidden_states=False,
        return_routed_experts=False,
        routed_experts_start_len=0,
        stream=False,
        bootstrap_host=None,
        bootstrap_port=None,
        bootstrap_room=None,
        routed_dp_rank=None,
        disagg_prefill_dp_rank=None,
        kv_hints=None,
        data_parallel_rank=None,
        external_trace_header=None,
        rid=None,
        session_params=None,
        priority=None,
        session_id=None,
        *,
        cache_salt=None,
    ):
        assert stream, "the adapter streams"
        self.tokenizer_manager.auto_create_handle_loop()
        self.calls.append(("generate", rid))
        self.requests.append(
            {
                "input_ids": list(input_ids),
                "sampling_params": dict(sampling_params),
                "return_logprob": return_logprob,
                "stream": stream,
                "rid": rid,
            }
        )
        live = _Live(rid, list(input_ids), dict(sampling_params), reject=self.reject_next)
        self.reject_next = None
        return self._stream(live)

    async def _stream(self, live: _Live):
        tm = self.tokenizer_manager
        assert live.rid not in tm.rid_to_state, "SGLang refuses a duplicate rid"
        state = tm.rid_to_state[live.rid] = FakeReqState()
        for _ in range(self.dispatch_delay):  # locks, tokenization before the scheduler
            await asyncio.sleep(0)
        state.dispatched = True
        self.live[live.rid] = live
        p = live.params
        interval, sent = p.get("stream_interval", 1), 0
        try:
            while True:
                if live.reject is not None:
                    yield self._chunk(
                        live, {"type": "abort", "message": live.reject, "status_code": 400}
                    )
                    return
                if live.aborted:
                    msg = "Abort in waiting queue" if not live.out else None
                    yield self._chunk(live, {"type": "abort", "message": msg})
                    return
                if self.paused or self.credit == 0:
                    await self._changed.wait()
                    continue
                assert self.weights_valid and "weights" not in self.released, "no weights"
                await asyncio.sleep(0)  # one decode step
                if live.aborted or self.paused or self.credit == 0:
                    continue  # re-check: other requests ran meanwhile
                tok = ((live.input_ids + live.out)[-1] + 1) % VOCAB
                live.out.append(tok)
                self.steps += 1
                if self._credit is not None:
                    self._credit -= 1
                if tok in p.get("stop_token_ids", ()) or (tok == EOS and not p["ignore_eos"]):
                    yield self._chunk(live, {"type": "stop", "matched": tok})
                    return
                if len(live.out) >= p["max_new_tokens"]:
                    yield self._chunk(live, {"type": "length", "length": len(live.out)})
                    return
                if len(live.out) - sent >= interval or sent == 0:
                    sent = len(live.out)
                    yield self._chunk(live, None)
        finally:
            self.n_finished += 1
            self._lag = self.idle_lag  # the overlap loop keeps the batch one more step
            self.live.pop(live.rid, None)
            tm.rid_to_state.pop(live.rid, None)

    def _chunk(self, live: _Live, finish: dict | None) -> dict:
        return {
            "output_ids": list(live.out),
            "meta_info": {
                "id": live.rid,
                "finish_reason": finish,
                "prompt_tokens": len(live.input_ids),
                "completion_tokens": len(live.out),
                "output_token_logprobs": [(-0.5, t, None) for t in live.out],
                "weight_version": self.weight_version,
                "num_retractions": 0,
            },
        }

    async def until_finished(self, n: int) -> None:
        """Test helper: let the fake scheduler run until `n` requests have ended."""
        while self.n_finished < n:
            await asyncio.sleep(0)

    def release_memory_occupation(self, tags=None):
        if self.busy:  # the scheduler's assert fails and SIGQUIT kills the rank
            raise FakeRankKilled("SIGQUIT: release_memory_occupation while not idle")
        tags = list(tags or ALL_TAGS)
        for t in tags:
            assert t not in self.released, f"{t} released twice"
        self.released.update(tags)
        self.calls.append(("release", tuple(tags)))

    def resume_memory_occupation(self, tags=None):
        tags = list(tags or ALL_TAGS)
        for t in tags:
            self.released.remove(t)  # KeyError, as SGLang's offload_tags.remove
        if "weights" in tags:
            self.weights_valid = False  # memory is back, contents are not
        self.calls.append(("resume", tuple(tags)))

    def begin_weight_update(self, selector: str = "all"):
        if self.session:
            return False, "a weight-update session is already open"
        self.session = True
        self.session_names: list[set[str]] = [set() for _ in self.loaded]
        self.calls.append(("begin",))
        return True, "Success"

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        if not self.session:
            return False, "update_weights_from_tensor must run between begin/end_weight_update()"
        assert "weights" not in self.released, "weights are released"
        assert self.paused or not self.live, "unpaused with running requests: would block"
        assert load_format == "flattened_bucket"
        assert len(named_tensors) == len(self.loaded), "one payload per TP rank"
        for rank, payload in enumerate(named_tensors):
            data = FakeSerializer.deserialize(payload)
            bucket = FakeFlattenedTensorBucket(
                flattened_tensor=data["flattened_tensor"], metadata=data["metadata"]
            )
            rebuilt = bucket.reconstruct_tensors()
            if rank == 0:
                self.buckets.append(
                    [(n, t.dtype, t.numel() * t.element_size()) for n, t in rebuilt]
                )
            for name, t in rebuilt:
                assert name not in self.session_names[rank], f"{name} sent twice"
                self.session_names[rank].add(name)
                self.loaded[rank][name] = t.clone()
        self.calls.append(("update", flush_cache))
        if flush_cache and self.busy:
            return False, "Weights were updated, but the cache was not flushed"
        return True, "Success"

    def end_weight_update(self):
        if not self.session:
            return False, "no weight-update session is open"
        self.session = False
        self.weights_valid = True
        self.calls.append(("end",))
        return True, "Success"

    def flush_cache(self):
        self.calls.append(("flush",))
        if not self.live and self._lag > 0:
            self._lag -= 1  # the scheduler takes its last step
            return SimpleNamespace(success=False, message="not idle")
        return SimpleNamespace(success=not self.live, message="")

    def get_server_info(self):
        cap = self.server_args["max_total_tokens"]
        return {
            **self.server_args,
            "max_total_num_tokens": cap,
            "max_req_input_len": min(self.server_args["context_length"] - 1, cap - 1) - 5,
            "version": "0.5.23",
        }

    def shutdown(self):
        self.calls.append(("shutdown",))
        self.closed = True
        self.node.ports_in_use -= self.ports
        for sock in self._sockets:
            sock.close()
        self.loop.close()  # also removes its signal handlers


FAKE_API = SGLangAPI(
    engine_cls=FakeSGLangEngine,
    bucket_cls=FakeFlattenedTensorBucket,
    serializer=FakeSerializer,
    pause_req=FakePauseReq,
    continue_req=FakeContinueReq,
    weight_version_req=FakeWeightVersionReq,
)


def write_model_dir(path: Path, max_pos: int = 128, weights_bytes: int = 0) -> Path:
    """What the adapter reads from a model directory (config.json, safetensors sizes)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(
        json.dumps({"max_position_embeddings": max_pos, "eos_token_id": EOS})
    )
    if weights_bytes:  # sparse: only its size is read
        with open(path / "model.safetensors", "wb") as f:
            f.truncate(weights_bytes)
    return path


def make_fake(
    model_dir: Path,
    tp: int = 2,
    kv: int = 1000,
    *,
    slot: int = 1,
    free_memory: Any = None,
    reclaim_signals: Any = stop.reinstall,
    **ec_kw: Any,
) -> tuple[SGLangEngine, FakeSGLangEngine]:
    """The adapter over a fresh fake, built by the real factory (given our stop handler
    back as the worker gives it)."""
    ec_kw = {"max_batch": 8, "stream_interval": 2, "poll_s": 0.001, **ec_kw}
    ec = InferenceEngineConfig(engine="sglang", **ec_kw)
    eng = make_sglang_engine(
        ec,
        model_dir,
        role="rollout",
        tp=tp,
        kv_capacity_tokens=kv,
        slot=slot,
        seed=7,
        api=FAKE_API,
        free_memory=free_memory or NODE.free_memory,
        reclaim_signals=reclaim_signals,
    )
    return eng, eng.engine


def close_all(engines: list[SGLangEngine]) -> None:
    for eng in engines:
        if eng.engine.closed:
            continue
        if eng.has_unfinished():
            eng.abort_all()
        eng.close()


def drain(eng, limit: int = 20_000) -> dict:
    out = {}
    for _ in range(limit):
        if not eng.has_unfinished():
            return out
        for r in eng.step():
            assert r.seq_id not in out, "reported twice"
            out[r.seq_id] = r
    raise AssertionError("engine did not drain")


def step_until(eng, cond, limit: int = 2_000) -> list:
    done = []
    for _ in range(limit):
        if cond():
            return done
        done.extend(eng.step())
    raise AssertionError("condition never held")


def weights(n: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for i in range(n):
        out[f"model.layers.{i}.w"] = torch.randn(5, 3, generator=g).to(torch.bfloat16)
        out[f"model.layers.{i}.norm"] = torch.randn(7, generator=g)  # float32
    out["model.embed_tokens.weight"] = torch.randn(40, 8, generator=g).to(torch.bfloat16)
    return out
