"""The `sglang` InferenceEngine adapter against a fake SGLang engine at the Engine boundary.

SGLang cannot be installed or run on this CPU-only machine (PLATFORM.md), so these tests
check the adapter's own logic: request mapping, results, abort/resume, memory sequencing,
weight buckets and versions, stats. The fake mirrors SGLang 0.5.23's behaviour where the
adapter depends on it (prefix-matched aborts, aborts lost before dispatch, idle-only
release, resume only of released tags, weight-update sessions, in-place pause).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import pickle
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pivot_hpc.config.loader import ConfigError, validate_tree
from pivot_hpc.engines.base import InferenceEngine, SamplingParams
from pivot_hpc.engines.config import EnginesConfig, InferenceEngineConfig
from pivot_hpc.engines.factory import make_inference_engine, make_sglang_engine
from pivot_hpc.engines.sglang_engine import (
    SGLangAPI,
    SGLangEngine,
    SGLangUnavailable,
    load_sglang_api,
)
from pivot_hpc.engines.sglang_weights import plan_buckets, serialized_buckets

VOCAB = 50
EOS = 49
ALL_TAGS = ("kv_cache", "weights", "cuda_graph")


# ---------------------------------------------------------------- the fake
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
    """Stand-in for sglang.srt.utils.MultiprocessingSerializer (plain pickle here)."""

    @staticmethod
    def serialize(obj, output_str: bool = False):
        return pickle.dumps(obj)


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
                decode_moments=[e.steps, e.steps, e.steps * 1000.0, 0, 0, e.steps]
                if e.steps
                else None,
            )
        ]

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
    """Stand-in for sglang.srt.entrypoints.engine.Engine 0.5.23, because SGLang cannot run
    on this CPU-only machine. Same method names and signatures as the real Engine for what
    the adapter calls. Generation is deterministic and runs on `self.loop`: the next token is
    (last + 1) % VOCAB with logprob -0.5, one token per loop iteration while `credit` (None =
    unlimited) allows; EOS ends a request unless ignore_eos."""

    def __init__(self, **kwargs):
        self.server_args = kwargs
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
        assert not self.live, "release_memory_occupation should be called only when server is idle."
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
            data = pickle.loads(payload)
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
        if flush_cache and self.live:
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
        self.loop.close()


FAKE_API = SGLangAPI(
    engine_cls=FakeSGLangEngine,
    bucket_cls=FakeFlattenedTensorBucket,
    serializer=FakeSerializer,
    pause_req=FakePauseReq,
    continue_req=FakeContinueReq,
    weight_version_req=FakeWeightVersionReq,
)


# --------------------------------------------------------------- helpers
@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"max_position_embeddings": 128, "eos_token_id": EOS})
    )
    return tmp_path


@pytest.fixture
def make(model_dir):
    made: list[SGLangEngine] = []

    def _make(tp: int = 2, kv: int = 1000, **ec_kw: Any) -> tuple[SGLangEngine, FakeSGLangEngine]:
        ec_kw = {"max_batch": 8, "stream_interval": 2, "poll_s": 0.001, **ec_kw}
        ec = InferenceEngineConfig(engine="sglang", **ec_kw)
        eng = make_sglang_engine(
            ec,
            model_dir,
            role="rollout",
            tp=tp,
            kv_capacity_tokens=kv,
            base_gpu_id=1,
            seed=7,
            api=FAKE_API,
        )
        made.append(eng)
        return eng, eng.engine

    yield _make
    for eng in made:
        if eng.has_unfinished():
            eng.abort_all()
        eng.close()


def drain(eng: SGLangEngine, limit: int = 20_000) -> dict:
    out = {}
    for _ in range(limit):
        if not eng.has_unfinished():
            return out
        for r in eng.step():
            assert r.seq_id not in out, "reported twice"
            out[r.seq_id] = r
    raise AssertionError("engine did not drain")


def step_until(eng: SGLangEngine, cond, limit: int = 2_000) -> list:
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


# ---------------------------------------------------------------- tests
def test_server_args_and_protocol(make):
    eng, fake = make(
        tp=2, kv=900, mem_fraction_static=0.6, server_args={"disable_cuda_graph": True}
    )
    assert isinstance(eng, InferenceEngine)
    sa = fake.server_args
    assert sa["tp_size"] == 2 and sa["base_gpu_id"] == 1 and sa["random_seed"] == 7
    assert sa["skip_tokenizer_init"] is True and sa["enable_memory_saver"] is True
    assert sa["max_total_tokens"] == 900 and sa["max_running_requests"] == 8
    assert sa["context_length"] == 128 and sa["mem_fraction_static"] == 0.6
    assert sa["disable_cuda_graph"] is True
    assert eng.kv_capacity == 900 and eng.eos_ids == {EOS}


def test_request_mapping_and_results(make):
    eng, fake = make()
    sp = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=5, stop_token_ids=(7,))
    eng.add(3, [1, 2, 3], sampling=sp)
    res = drain(eng)[3]
    req = fake.requests[0]
    assert req["input_ids"] == [1, 2, 3]
    assert req["sampling_params"] == {
        "max_new_tokens": 5,
        "temperature": 0.7,
        "top_p": 0.9,
        "ignore_eos": False,
        "stream_interval": 2,
        "stop_token_ids": [7],
    }
    assert req["return_logprob"] is True and req["stream"] is True
    assert req["rid"].startswith("pivot/3/") and req["rid"].endswith("/")
    assert res.prompt_ids == [1, 2, 3]
    assert res.token_ids == [4, 5, 6, 7] and res.logprobs == [-0.5] * 4  # stop token kept
    assert res.finish_reason == "stop"
    assert not eng.has_unfinished()


def test_length_eos_and_greedy(make):
    eng, fake = make()
    eng.add(0, [10], sampling=SamplingParams(temperature=0.0, max_tokens=3))
    eng.add(1, [46], sampling=SamplingParams(max_tokens=10))
    eng.add(2, [46], sampling=SamplingParams(max_tokens=5, ignore_eos=True))
    out = drain(eng)
    assert out[0].token_ids == [11, 12, 13] and out[0].finish_reason == "length"
    assert fake.requests[0]["sampling_params"]["temperature"] == 0.0  # greedy in SGLang too
    assert out[1].token_ids == [47, 48, EOS] and out[1].finish_reason == "stop"
    assert out[2].token_ids == [47, 48, 49, 0, 1] and out[2].finish_reason == "length"


def test_bad_requests_are_refused(make):
    eng, _ = make()
    with pytest.raises(ValueError, match="stop_token_ids"):
        eng.add(0, [1], sampling=SamplingParams(stop=("</s>",)))
    with pytest.raises(ValueError, match="max_seq_len"):
        eng.add(1, list(range(130)) * 1)
    eng.add(2, [1])
    with pytest.raises(ValueError, match="already"):
        eng.add(2, [1])
    with pytest.raises(ValueError, match="generated_logprobs"):
        eng.add(3, [1], generated_ids=[2, 3], generated_logprobs=[-1.0])


def test_seq_lengths_and_can_admit(make):
    eng, fake = make(kv=40)
    fake.credit = 3
    eng.add(0, [1, 2, 3, 4], sampling=SamplingParams(max_tokens=20))
    step_until(eng, lambda: fake.credit == 0 and eng.seq_lengths()[0] == 7)
    # 7 tokens held + 1 for its next one; a new context of n needs n + 1: n <= 31
    assert eng.can_admit(31) and not eng.can_admit(32)
    eng.abort(0)
    assert eng.seq_lengths() == {}
    eng2, _ = make(max_batch=1)
    eng2.engine.credit = 0
    eng2.add(0, [1])
    assert not eng2.can_admit(1)


def test_abort_mid_generation_then_resume_keeps_tokens(make):
    eng, fake = make()
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    fake.credit = 3
    eng.add(1, [10], sampling=sp)
    step_until(eng, lambda: fake.credit == 0)
    part = eng.abort(1)
    assert part.token_ids == [11, 12, 13] and part.logprobs == [-0.5] * 3
    assert part.finish_reason == "abort" and not eng.has_unfinished()

    fake.credit = None
    lps = [-0.1, -0.2, -0.3]  # distinct, so the concatenation is visible
    eng.add(1, [10], generated_ids=part.token_ids, sampling=sp, generated_logprobs=lps)
    final = drain(eng)[1]
    again = fake.requests[1]
    assert again["input_ids"] == [10, 11, 12, 13]
    assert again["sampling_params"]["max_new_tokens"] == 5  # 8 minus the 3 already generated
    assert again["rid"] != fake.requests[0]["rid"]
    assert final.token_ids == [11, 12, 13, 14, 15, 16, 17, 18]
    assert final.logprobs == lps + [-0.5] * 5
    assert final.finish_reason == "length"


def test_abort_matches_only_its_own_rid(make):
    """SGLang aborts every rid that starts with the given one: seq 1 must not hit seq 10."""
    eng, fake = make()
    fake.credit = 2
    for s in (1, 10, 11):
        eng.add(s, [0], sampling=SamplingParams(max_tokens=4, ignore_eos=True))
    step_until(eng, lambda: fake.credit == 0 and len(fake.live) == 3)
    assert eng.abort(1).finish_reason == "abort"
    fake.credit = None
    out = drain(eng)
    assert {s: r.finish_reason for s, r in out.items()} == {10: "length", 11: "length"}


def test_abort_before_sglang_saw_the_request(make):
    eng, fake = make()
    eng.add(0, [5], generated_ids=[6], sampling=SamplingParams(max_tokens=4))
    res = eng.abort(0)  # the task never ran: nothing reached SGLang
    assert res.token_ids == [6] and res.finish_reason == "abort"
    assert fake.requests == [] and not any(c[0] == "abort_request" for c in fake.calls)


def test_abort_waits_for_dispatch(make):
    """An abort that reaches SGLang's scheduler before the request is lost; the adapter
    must wait until the request is dispatched."""
    eng, fake = make(abort_timeout_s=2.0)
    fake.dispatch_delay = 50
    fake.credit = 0  # nothing is generated: a lost abort would leave the request hanging
    eng.add(0, [5], sampling=SamplingParams(max_tokens=30))
    fake.loop.run_until_complete(asyncio.sleep(0))  # registered, not yet dispatched
    state = fake.tokenizer_manager.rid_to_state[fake.requests[0]["rid"]]
    assert not state.dispatched
    res = eng.abort(0)
    assert (res.finish_reason, res.token_ids) == ("abort", [])


def test_abort_racing_a_finish_returns_the_finished_result(make):
    eng, fake = make()
    eng.add(0, [1], sampling=SamplingParams(max_tokens=4, ignore_eos=True))
    eng.add(1, [1], sampling=SamplingParams(max_tokens=4, ignore_eos=True))
    fake.loop.run_until_complete(fake.until_finished(2))  # finished in SGLang, unreported
    res = eng.abort(0)
    assert res.finish_reason == "length" and res.token_ids == [2, 3, 4, 5]
    assert [r.seq_id for r in eng.step()] == [1]  # seq 0 is not reported a second time
    with pytest.raises(KeyError):  # already reported: same as the hf engine
        eng.abort(1)
    assert eng.abort_all() == []


def test_resumed_sequence_already_at_its_end(make):
    eng, fake = make()
    eng.add(0, [1], generated_ids=[2, 7], sampling=SamplingParams(stop_token_ids=(7,)))
    eng.add(1, [1], generated_ids=[2, EOS], generated_logprobs=[-1.0, -2.0])
    eng.add(2, [1], generated_ids=[2, 3], sampling=SamplingParams(max_tokens=2))
    out = drain(eng)
    assert fake.requests == []
    assert (out[0].finish_reason, out[0].token_ids) == ("stop", [2, 7])
    assert (out[1].finish_reason, out[1].logprobs) == ("stop", [-1.0, -2.0])
    assert (out[2].finish_reason, out[2].token_ids) == ("length", [2, 3])


def test_sglang_side_abort_is_an_error(make):
    eng, fake = make()
    fake.reject_next = "Input length exceeds the maximum allowed length"
    eng.add(0, [1])
    with pytest.raises(RuntimeError, match="maximum allowed length"):
        drain(eng)


def test_memory_release_resume_sequencing(make):
    eng, fake = make()
    fake.credit = 1
    eng.add(0, [1], sampling=SamplingParams(max_tokens=3))
    with pytest.raises(RuntimeError, match="abort"):
        eng.release_memory(weights=True)
    assert not any(c[0] == "release" for c in fake.calls)
    fake.credit = None
    drain(eng)

    eng.release_memory(weights=True)
    assert fake.calls[-1] == ("release", ("kv_cache", "cuda_graph", "weights"))
    eng.release_memory(weights=True)  # idempotent: SGLang cannot pause a tag twice
    with pytest.raises(RuntimeError, match="load_weights"):
        eng.add(1, [1])
    with pytest.raises(RuntimeError, match="resume_memory"):
        eng.load_weights(weights(), 1)

    fake.calls.clear()
    eng.resume_memory()
    assert fake.calls == [("resume", ("weights",))]  # KV cache waits for the weights
    with pytest.raises(RuntimeError, match="load_weights"):
        eng.add(1, [1])
    eng.load_weights(weights(), 1)
    names = [c[0] for c in fake.calls]
    assert names.index("begin") < names.index("end") < len(names) - 1
    assert fake.calls[-1] == ("resume", ("kv_cache", "cuda_graph"))
    assert fake.released == set()
    eng.add(1, [1], sampling=SamplingParams(max_tokens=2))
    assert drain(eng)[1].token_ids == [2, 3]

    fake.calls.clear()
    eng.release_memory()  # KV cache only
    with pytest.raises(RuntimeError, match="kv_cache"):
        eng.add(2, [1])
    eng.load_weights(weights(), 2)  # weights stay resident: no resume as a side effect
    assert not any(c[0] == "resume" for c in fake.calls)
    eng.resume_memory()
    assert fake.calls[0] == ("release", ("kv_cache", "cuda_graph"))
    assert fake.calls[-1] == ("resume", ("kv_cache", "cuda_graph"))
    eng.add(2, [1], sampling=SamplingParams(max_tokens=1))
    assert drain(eng)[2].version == 2


def test_weight_bucket_plan():
    t = {
        "a": torch.zeros(10, dtype=torch.bfloat16),  # 20 B
        "b": torch.zeros(3, dtype=torch.float32),  # 12 B
        "c": torch.zeros(15, dtype=torch.bfloat16),  # 30 B
        "d": torch.zeros(40, dtype=torch.bfloat16),  # 80 B: larger than a bucket
        "e": torch.zeros(5, dtype=torch.float32),  # 20 B
        "f": torch.zeros(1, dtype=torch.bfloat16),  # 2 B
    }
    plan = plan_buckets(t, max_bytes=50)
    assert sorted(n for b in plan for n in b) == sorted(t)  # each tensor exactly once
    for b in plan:
        assert len({t[n].dtype for n in b}) == 1
        size = sum(t[n].numel() * t[n].element_size() for n in b)
        assert size <= 50 or len(b) == 1
    assert ["d"] in plan
    assert plan == [["a", "c"], ["d"], ["f"], ["b", "e"]]  # dtype groups in order of appearance
    with pytest.raises(ValueError):
        plan_buckets(t, 0)


def test_serialized_buckets_metadata():
    t = weights(2)
    out = list(
        serialized_buckets(
            t,
            max_bytes=64,
            tp_size=3,
            bucket_cls=FakeFlattenedTensorBucket,
            serializer=FakeSerializer,
        )
    )
    assert [last for _, last in out] == [False] * (len(out) - 1) + [True]
    seen: dict[str, torch.Tensor] = {}
    for payloads, _ in out:
        assert len(payloads) == 3  # one per TP rank
        data = pickle.loads(payloads[0])
        assert set(data) == {"flattened_tensor", "metadata"}
        flat, meta = data["flattened_tensor"], data["metadata"]
        assert flat.dtype == torch.uint8 and flat.numel() == meta[-1].end_idx
        assert meta[0].start_idx == 0
        assert all(m.end_idx == n.start_idx for m, n in itertools.pairwise(meta))
        for m in meta:
            assert m.numel == m.end_idx - m.start_idx
            assert (tuple(m.shape), m.dtype) == (tuple(t[m.name].shape), t[m.name].dtype)
        for name, x in FakeFlattenedTensorBucket(
            flattened_tensor=flat, metadata=meta
        ).reconstruct_tensors():
            seen[name] = x
    assert seen.keys() == t.keys()
    assert all(torch.equal(seen[n], t[n]) for n in t)


def test_load_weights_buckets_and_versions(make):
    eng, fake = make(tp=2, weight_bucket_mb=1)
    eng.weight_bucket_bytes = 100  # small buckets for the test
    w = weights(3)
    eng.load_weights(w, 5)
    for rank in range(2):
        assert fake.loaded[rank].keys() == w.keys()
        assert all(torch.equal(fake.loaded[rank][n], w[n]) for n in w)
    assert len(fake.buckets) > 2
    for b in fake.buckets:
        assert len({dt for _, dt, _ in b}) == 1
        assert sum(nb for _, _, nb in b) <= 100 or len(b) == 1
    updates = [c for c in fake.calls if c[0] == "update"]
    assert [c[1] for c in updates] == [False] * (len(updates) - 1) + [True]  # flush once
    assert ("weight_version", "5", False) in fake.calls
    assert not any(c[0] == "pause" for c in fake.calls)  # idle: no pause needed
    eng.add(0, [1], sampling=SamplingParams(max_tokens=2))
    assert drain(eng)[0].version == 5


def test_load_weights_while_sequences_run(make):
    eng, fake = make()
    eng.load_weights(weights(1), 1)
    fake.credit = 2
    eng.add(1, [20], sampling=SamplingParams(max_tokens=6, ignore_eos=True))
    step_until(eng, lambda: fake.credit == 0)
    fake.calls.clear()
    eng.load_weights(weights(1), 2)
    names = [c[0] for c in fake.calls]
    assert fake.calls[0] == ("pause", "in_place")
    assert names.index("end") < names.index("weight_version") < names.index("continue")
    assert all(c[1] is False for c in fake.calls if c[0] == "update")  # no flush while running
    fake.credit = None
    res = drain(eng)[1]
    assert res.token_ids == [21, 22, 23, 24, 25, 26] and res.logprobs == [-0.5] * 6
    assert res.version == 2  # its last tokens came from the new weights
    assert ("flush",) in fake.calls  # the prefix cache from v1 is dropped once idle


def test_result_finished_before_an_update_keeps_the_old_version(make):
    eng, fake = make()
    eng.load_weights(weights(1), 1)
    eng.add(0, [1], sampling=SamplingParams(max_tokens=2))
    fake.loop.run_until_complete(fake.until_finished(1))  # done in SGLang, not yet reported
    eng.load_weights(weights(1), 2)
    assert drain(eng)[0].version == 1


def test_stats_mapping(make):
    eng, fake = make(kv=500, stream_interval=1)
    fake.credit = 4
    eng.add(0, [1, 2], sampling=SamplingParams(max_tokens=10))
    step_until(eng, lambda: fake.credit == 0)
    fake.waiting_reported = 3
    st = eng.stats()
    assert (st.running, st.waiting, st.tokens_in_cache, st.kv_capacity) == (1, 3, 6, 500)
    assert st.steps == 4
    fake.credit = 2
    step_until(eng, lambda: fake.credit == 0)
    st = eng.stats()
    assert st.steps == 6 and st.last_step_s == pytest.approx(1e-3)  # 1000 µs per fake step
    fake.publish_loads = False  # no snapshot yet: the adapter's own count
    st = eng.stats()
    assert (st.running, st.waiting, st.tokens_in_cache, st.kv_capacity) == (1, 0, 8, 500)


def test_factory_selects_and_explains_missing_sglang(monkeypatch, model_dir):
    for mod in ("sglang", "sglang.srt", "sglang.srt.entrypoints", "sglang.srt.entrypoints.engine"):
        monkeypatch.setitem(sys.modules, mod, None)  # import fails like on this machine
    with pytest.raises(SGLangUnavailable, match=r"engines\.reward\.engine.*pip install \.\[gpu\]"):
        load_sglang_api("engines.reward.engine")
    cfg = SimpleNamespace(
        engines=SimpleNamespace(rollout=InferenceEngineConfig(engine="sglang")),
        rollout=SimpleNamespace(tp=1, kv_capacity_tokens=100),
    )
    with pytest.raises(SGLangUnavailable, match=r"engines\.rollout\.engine"):
        make_inference_engine(cfg, "rollout", model_dir, seed=0)


def test_config_validation():
    with pytest.raises(ConfigError, match="mem_fraction_static"):
        InferenceEngineConfig(mem_fraction_static=1.5).validate("engines.rollout")
    with pytest.raises(ConfigError, match="tp_size"):
        InferenceEngineConfig(server_args={"tp_size": 2}).validate("engines.rollout")
    with pytest.raises(ConfigError, match="poll_s"):
        InferenceEngineConfig(poll_s=0).validate("engines.rollout")
    both = EnginesConfig(
        rollout=InferenceEngineConfig(engine="sglang"),
        reward=InferenceEngineConfig(engine="sglang"),
    )
    # valid: a worker then holds one SGLang engine at a time (runtime/worker.py builds them
    # lazily, because SGLang keeps its configuration process-wide)
    validate_tree(both, "engines")
