"""The `sglang` InferenceEngine adapter against a fake SGLang engine at the Engine boundary.

SGLang cannot be installed or run on this CPU-only machine (docs/platform.md), so these tests
check the adapter's own logic: request mapping, results, abort/resume, memory sequencing,
weight buckets and versions, stats, and the fixes for what would break a first GPU run
(placement and ports, signals, late idle, memory budget, shared-memory buckets). The fake
(tests/engines/fake_sglang.py) mirrors SGLang 0.5.23's behaviour where the adapter
depends on it. What every engine must do is in test_engine_conformance.py.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pivot_hpc.config.loader import ConfigError, validate_tree
from pivot_hpc.engines.base import InferenceEngine, SamplingParams
from pivot_hpc.engines.config import EnginesConfig, InferenceEngineConfig
from pivot_hpc.engines.factory import make_inference_engine
from pivot_hpc.engines.sglang import engine as sglang_engine_mod
from pivot_hpc.engines.sglang import launch
from pivot_hpc.engines.sglang.engine import SGLangEngine, SGLangUnavailable, load_sglang_api
from pivot_hpc.engines.sglang.weights import plan_buckets, serialized_buckets
from pivot_hpc.job.config import load_config
from pivot_hpc.runtime import devices, stop

from .fake_sglang import (
    EOS,
    GIB,
    NODE,
    FakeFlattenedTensorBucket,
    FakeRankKilled,
    FakeSerializer,
    FakeSGLangEngine,
    close_all,
    drain,
    make_fake,
    step_until,
    weights,
    write_model_dir,
)


# --------------------------------------------------------------- helpers
@pytest.fixture
def model_dir(tmp_path):
    return write_model_dir(tmp_path / "model")


@pytest.fixture
def make(model_dir):
    made: list[SGLangEngine] = []

    def _make(tp: int = 2, kv: int = 1000, **kw: Any) -> tuple[SGLangEngine, FakeSGLangEngine]:
        eng, fake = make_fake(kw.pop("model_dir", model_dir), tp, kv, **kw)
        made.append(eng)
        return eng, fake

    yield _make
    close_all(made)


# ---------------------------------------------------------------- tests
def test_server_args_and_protocol(make):
    eng, fake = make(
        tp=2, kv=900, mem_fraction_static=0.6, server_args={"disable_cuda_graph": True}
    )
    assert isinstance(eng, InferenceEngine)
    sa = fake.server_args
    assert sa["tp_size"] == 2 and sa["base_gpu_id"] == 0 and sa["random_seed"] == 7
    assert sa["skip_tokenizer_init"] is True and sa["enable_memory_saver"] is True
    assert sa["max_total_tokens"] == 900 and sa["max_running_requests"] == 8
    assert sa["context_length"] == 128 and sa["mem_fraction_static"] == 0.6
    assert sa["chunked_prefill_size"] == 4096  # engines.<role>.prefill_chunk_tokens
    assert sa["dist_init_addr"] == f"127.0.0.1:{sa['nccl_port']}" and sa["port"] != sa["nccl_port"]
    assert sa["disable_cuda_graph"] is True and sa["watchdog_timeout"] == 1800.0
    assert eng.kv_capacity == 900 and eng.eos_ids == {EOS} and eng.weights_device == "cpu"


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

    eng.release_memory(weights=True)  # right after the last request: waits for idle first
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
    releases = [c for c in fake.calls if c[0] == "release"]
    assert releases == [("release", ("kv_cache", "cuda_graph"))]
    assert fake.calls[fake.calls.index(releases[0]) - 1] == ("flush",)  # idle was checked
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
            plan=plan_buckets(t, 64),
            tp_size=3,
            bucket_cls=FakeFlattenedTensorBucket,
            serializer=FakeSerializer,
        )
    )
    assert [b.last for b in out] == [False] * (len(out) - 1) + [True]
    seen: dict[str, torch.Tensor] = {}
    for b in out:
        payloads = b.payloads
        assert len(payloads) == 3  # one per TP rank
        assert b.nbytes == b.keepalive.numel()  # the flattened uint8 buffer is the bucket
        data = FakeSerializer.deserialize(payloads[0])
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
    assert [c[1] for c in updates] == [False] * len(updates)  # never inside the update
    assert fake.calls.index(("end",)) < fake.calls.index(("flush",))  # one flush after it
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
    assert fake.calls[0] == ("pause", "retract")  # drains the overlap scheduler's step
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
    eng.add(0, [1, 2], sampling=SamplingParams(max_tokens=20))
    step_until(eng, lambda: fake.credit == 0)
    fake.waiting_reported = 3
    st = eng.stats()
    assert (st.running, st.waiting, st.tokens_in_cache, st.kv_capacity) == (1, 3, 6, 500)
    assert st.steps == 4
    fake.credit = 2
    step_until(eng, lambda: fake.credit == 0)
    st = eng.stats()
    assert st.steps == 6 and st.last_step_s == pytest.approx(1e-3)  # 1000 µs per fake step
    assert (st.last_step_seqs, st.last_step_tokens) == (1, 9)  # the worker's refit uses them
    fake.batch_per_step = 3  # from now on every fake step reports a batch of 3
    fake.credit = 2
    step_until(eng, lambda: fake.credit == 0)
    eng.stats()
    fake.credit = 2
    step_until(eng, lambda: fake.credit == 0)
    st = eng.stats()
    assert st.last_step_seqs == 3 and st.last_step_tokens == st.tokens_in_cache + 3
    fake.publish_loads = False  # no snapshot yet: the adapter's own count
    st = eng.stats()
    assert (st.running, st.waiting, st.tokens_in_cache, st.kv_capacity) == (1, 0, 12, 500)


def test_factory_selects_and_explains_missing_sglang(monkeypatch, model_dir):
    for mod in ("sglang", "sglang.srt", "sglang.srt.entrypoints", "sglang.srt.entrypoints.engine"):
        monkeypatch.setitem(sys.modules, mod, None)  # import fails like on this machine
    with pytest.raises(SGLangUnavailable, match=r"engines\.reward\.engine.*pip install \.\[gpu\]"):
        load_sglang_api("engines.reward.engine")
    cfg = SimpleNamespace(
        engines=SimpleNamespace(rollout=InferenceEngineConfig(engine="sglang")),
        rollout=SimpleNamespace(tp=1, kv_capacity_tokens=100),
    )
    assert "refuses sglang for both roles" not in (sglang_engine_mod.__doc__ or "")
    with pytest.raises(SGLangUnavailable, match=r"engines\.rollout\.engine"):
        make_inference_engine(cfg, "rollout", model_dir, seed=0)


def test_config_validation():
    with pytest.raises(ConfigError, match="mem_fraction_static"):
        InferenceEngineConfig(mem_fraction_static=1.5).validate("engines.rollout")
    with pytest.raises(ConfigError, match="tp_size"):
        InferenceEngineConfig(server_args={"tp_size": 2}).validate("engines.rollout")
    with pytest.raises(ConfigError, match="poll_s"):
        InferenceEngineConfig(poll_s=0).validate("engines.rollout")
    with pytest.raises(ConfigError, match="nccl_port"):  # per replica: the adapter's
        InferenceEngineConfig(server_args={"nccl_port": 1234}).validate("engines.rollout")
    with pytest.raises(ConfigError, match=r"engines\.reward\.idle_timeout_s"):
        InferenceEngineConfig(idle_timeout_s=0).validate("engines.reward")
    with pytest.raises(ConfigError, match="port_base"):
        InferenceEngineConfig(port_base=80).validate("engines.rollout")
    with pytest.raises(ConfigError, match="disable_overlap_schedule"):  # a torn step
        InferenceEngineConfig(pause_mode="in_place").validate("engines.rollout")
    InferenceEngineConfig(
        pause_mode="in_place", server_args={"disable_overlap_schedule": True}
    ).validate("engines.rollout")
    with pytest.raises(ConfigError, match="watchdog_timeout_s"):
        InferenceEngineConfig(watchdog_timeout_s=0).validate("engines.rollout")
    with pytest.raises(ConfigError, match=r"engines\.rollout\.device"):
        load_config(None, ["engines.rollout.device=gpu"])
    both = EnginesConfig(
        rollout=InferenceEngineConfig(engine="sglang"),
        reward=InferenceEngineConfig(engine="sglang"),
    )
    # valid: a worker then holds one SGLang engine at a time (runtime/worker.py builds them
    # lazily, because SGLang keeps its configuration process-wide)
    validate_tree(both, "engines")


# ------------------------------------------- placement, ports (issue: first GPU run)
@pytest.fixture
def bound(monkeypatch):
    """The environment runtime/devices.bind_worker_gpu leaves a worker of an 8-GPU node."""

    def _bind(slot: int, node: str = "0,1,2,3,4,5,6,7") -> None:
        monkeypatch.setenv(devices.NODE_GPUS_ENV, node)
        gpus = node.split(",") if node else ["5"]
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", gpus[slot] if node else "5")

    return _bind


@pytest.fixture
def node_memory():
    saved = dict(NODE.free)
    yield NODE.free
    NODE.free.clear()
    NODE.free.update(saved)


def test_replica_sees_exactly_its_gpus_and_the_env_is_restored(make, bound, monkeypatch):
    bound(2)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,max_split_size_mb:64")
    _, fake = make(tp=2, slot=2)
    assert fake.visible == ["2", "3"] and fake.gpus == ["2", "3"]  # base_gpu_id 0 of those
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2"  # the worker's own view is back
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True,max_split_size_mb:64"
    # what the old placement did: base_gpu_id = slot among a replica-sized visible list
    with launch.scoped_env({"CUDA_VISIBLE_DEVICES": "2,3"}):
        with pytest.raises(RuntimeError, match="invalid device ordinal"):
            FakeSGLangEngine(**{**fake.server_args, "base_gpu_id": 2, "port": 1, "nccl_port": 2})
    # and the memory saver refuses expandable segments when they reach the scheduler
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "CUDA_VISIBLE_DEVICES": "2,3"}
    with launch.scoped_env(env):
        with pytest.raises(RuntimeError, match="expandable"):
            FakeSGLangEngine(**{**fake.server_args, "port": 3, "nccl_port": 4})


def test_per_task_binding_refuses_a_tp2_replica_by_name(make, bound):
    bound(0, node="")  # srun --gpus-per-task=1: the worker sees its GPU only
    with pytest.raises(devices.PlacementError, match=r"rollout\.tp.*--gpu-bind=none"):
        make(tp=2)
    _, fake = make(tp=1)
    assert fake.visible == ["5"]


def test_each_engine_gets_its_own_ports(make):
    a = make(tp=1, slot=1)[1].server_args
    b = make(tp=1, slot=1)[1].server_args  # same slot (a lazily rebuilt engine): skips a's
    c = make(tp=1, slot=2)[1].server_args  # another GPU's block
    ports = [x[k] for x in (a, b, c) for k in ("port", "nccl_port")]
    assert len(set(ports)) == 6
    block = range(30000 + 16, 30000 + 32)
    assert all(x[k] in block for x in (a, b) for k in ("port", "nccl_port"))
    assert all(c[k] in range(30032, 30048) for k in ("port", "nccl_port"))
    with pytest.raises(launch.LaunchError, match=r"engines\.rollout\.port_base"):
        launch.engine_ports(
            30000, 1, config_key="engines.rollout.port_base", is_free=lambda p: False
        )


# --------------------------------------------------------------------- signals
@pytest.fixture
def signal_handlers(monkeypatch):
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)}
    monkeypatch.setattr(stop, "_requested", None)
    monkeypatch.setattr(stop, "_installed", False)
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def test_sglang_sigterm_handler_would_exit(model_dir, signal_handlers):
    """The fake reproduces SGLang: once its handle loop runs, SIGTERM ends the process."""
    fake = FakeSGLangEngine(model_path=str(model_dir), base_gpu_id=0, port=5, nccl_port=6)
    try:
        fake.tokenizer_manager.auto_create_handle_loop()
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(SystemExit):
            fake.loop.run_until_complete(asyncio.sleep(0.05))
    finally:
        fake.shutdown()


def test_sigterm_after_sglang_started_is_a_graceful_stop(make, signal_handlers):
    stop.install()  # checkpoint.on_signal
    eng, fake = make()
    assert fake.handlers_installed  # SGLang's handle loop runs from the start
    fake.credit = 2
    eng.add(0, [1], sampling=SamplingParams(max_tokens=6, ignore_eos=True))
    step_until(eng, lambda: fake.credit == 0)
    os.kill(os.getpid(), signal.SIGTERM)
    fake.credit = None
    out = drain(eng)  # no SystemExit: the adapter took SIGTERM back
    assert stop.requested() == "SIGTERM" and out[0].finish_reason == "length"
    assert signal.getsignal(signal.SIGQUIT) not in (signal.SIG_DFL, None)  # SGLang's


def test_without_on_signal_sigterm_keeps_its_default(make, signal_handlers):
    make()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


# -------------------------------------------------------------------------- idle
def test_release_right_after_the_last_request_waits_for_idle(make):
    eng, fake = make()
    fake.idle_lag = 3
    eng.add(0, [1], sampling=SamplingParams(max_tokens=2))
    drain(eng)
    with pytest.raises(FakeRankKilled):  # what a release now would do to the rank
        fake.release_memory_occupation(tags=["kv_cache"])
    fake.calls.clear()
    eng.release_memory(weights=True)
    assert [c[0] for c in fake.calls] == ["flush"] * 4 + ["release"]


def test_idle_timeout_names_its_key(make):
    eng, fake = make(idle_timeout_s=0.2)
    fake.idle_lag = 10_000
    eng.add(0, [1], sampling=SamplingParams(max_tokens=2))
    drain(eng)
    with pytest.raises(RuntimeError, match=r"engines\.rollout\.idle_timeout_s"):
        eng.release_memory()


def test_weight_update_never_flushes_per_bucket_and_retries_its_flush(make):
    eng, fake = make(weight_bucket_mb=1)
    eng.weight_bucket_bytes = 100
    fake.idle_lag = 2
    eng.add(0, [1], sampling=SamplingParams(max_tokens=2))
    drain(eng)
    fake.calls.clear()
    eng.load_weights(weights(3), 4)  # flush_cache=True per bucket would fail it now
    updates = [c for c in fake.calls if c[0] == "update"]
    assert len(updates) > 2 and all(c[1] is False for c in updates)
    tail = [c[0] for c in fake.calls[fake.calls.index(("end",)) + 1 :]]
    assert tail.count("flush") == 3 and not eng._flush_pending  # 2 busy, then success
    fake.calls.clear()
    fake._lag = 1
    fake.begin_weight_update()
    payload = next(
        serialized_buckets(
            weights(1),
            plan=[["model.layers.0.w"]],
            tp_size=2,
            bucket_cls=FakeFlattenedTensorBucket,
            serializer=FakeSerializer,
        )
    )
    ok, msg = fake.update_weights_from_tensor(payload.payloads, "flattened_bucket", True)
    assert not ok and "not flushed" in msg  # the fake fails a flushing update while busy


def test_a_stale_prefix_cache_is_flushed_before_new_work(make):
    """load_weights with sequences running leaves the flush for later; the worker stops
    calling step() once the engine is empty, so the next add() must do it."""
    eng, fake = make()
    fake.credit = 1
    eng.add(0, [1], sampling=SamplingParams(max_tokens=3, ignore_eos=True))
    step_until(eng, lambda: fake.credit == 0)
    eng.load_weights(weights(1), 2)
    fake.idle_lag = 5  # step()'s one try after the last result fails
    fake.credit = None
    drain(eng)
    assert eng._flush_pending
    fake.calls.clear()
    eng.add(1, [1], sampling=SamplingParams(max_tokens=2))
    names = [c[0] for c in fake.calls]
    assert "flush" in names and not eng._flush_pending
    drain(eng)
    assert [c[0] for c in fake.calls].index("generate") > names.index("flush")


def test_buckets_stay_alive_until_sglang_took_them():
    fake_bucket = FakeFlattenedTensorBucket(named_tensors=[("w", torch.ones(4))])
    token = FakeSerializer.serialize(
        {"flattened_tensor": fake_bucket.flattened_tensor, "metadata": fake_bucket.metadata}
    )
    del fake_bucket  # the producer let go of the shared memory too early
    with pytest.raises(RuntimeError, match="freed"):
        FakeSerializer.deserialize(token)


def test_dev_shm_must_hold_the_largest_bucket(make, monkeypatch, tmp_path):
    eng, fake = make()
    eng.shm_dir = tmp_path
    monkeypatch.setattr(
        sglang_engine_mod.shutil, "disk_usage", lambda _p: SimpleNamespace(free=100)
    )
    with pytest.raises(RuntimeError, match=r"engines\.rollout\.weight_bucket_mb.*shm-size"):
        eng.load_weights(weights(1), 1)  # 160 B embedding in one bucket > 100 B free
    assert not any(c[0] in ("begin", "update") for c in fake.calls)


# ------------------------------------------------------------------------ memory
def test_mem_fraction_is_sized_from_what_is_free(make, bound, tmp_path, node_memory):
    big = write_model_dir(tmp_path / "big", weights_bytes=16 * GIB)  # 8 GiB per GPU at tp 2
    bound(2)
    _, fake = make(tp=2, slot=2, model_dir=big)  # reserve 10 GiB of 80 free
    assert fake.server_args["mem_fraction_static"] == pytest.approx(1 - 10 / 80)
    assert fake.kv_pool_bytes == pytest.approx((80 - 10 - 8) * GIB)
    # a training context still resident on GPUs 2 and 3: 9 GiB free each
    node_memory.update({"2": 9 * GIB, "3": 9 * GIB})
    with pytest.raises(RuntimeError, match="Not enough memory"):  # a fixed fraction
        make(tp=2, slot=2, model_dir=big, mem_fraction_static=0.85)
    with pytest.raises(launch.LaunchError, match=r"engines\.rollout\.memory_reserve_gib"):
        make(tp=2, slot=2, model_dir=big)  # named before SGLang starts, with the fix
    _, fake = make(tp=2, slot=2, model_dir=big, memory_reserve_gib=0.5)
    assert fake.kv_pool_bytes == pytest.approx(0.5 * GIB)
    node_memory.update({"3": 40 * GIB})  # only GPU 2 still holds the training context
    with pytest.raises(launch.LaunchError, match=r"rollout\.tp.*unequal"):
        make(tp=2, slot=2, model_dir=big)


def test_mem_fraction_rule():
    f = launch.mem_fraction_static(100 * GIB, 20 * GIB, 10 * GIB, config_key="k")
    assert f == pytest.approx(0.9)  # SGLang keeps 100·(1-0.9) = 10 GiB out of the pool
    assert launch.mem_fraction_static(100 * GIB, 1, 0, config_key="k") == 0.99
    with pytest.raises(launch.LaunchError, match="'k'"):
        launch.mem_fraction_static(20 * GIB, 15 * GIB, 5 * GIB, config_key="k")
    assert launch.without_expandable_segments("expandable_segments:True") is None
    assert launch.without_expandable_segments("a:1,expandable_segments:True,b:2") == "a:1,b:2"
    assert launch.without_expandable_segments(None) is None


# ------------------------------------------------------------------- snapshots
def test_snapshot_lags_by_less_than_one_stream_interval(make):
    eng, fake = make(stream_interval=4)
    fake.credit = 7
    eng.add(0, [10], generated_ids=[11], generated_logprobs=[-0.25],
            sampling=SamplingParams(max_tokens=20, ignore_eos=True))  # fmt: skip
    step_until(eng, lambda: fake.credit == 0)
    (snap,) = eng.snapshot()
    new = snap.token_ids[1:]
    assert 7 - 3 <= len(new) <= 7 and new == list(range(12, 12 + len(new)))
    assert snap.logprobs == [-0.25] + [-0.5] * len(new) and snap.finish_reason == "abort"
    fake.credit = None
    final = drain(eng)[0]
    assert final.token_ids[: len(snap.token_ids)] == snap.token_ids
