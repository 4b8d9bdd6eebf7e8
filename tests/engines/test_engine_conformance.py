"""One conformance suite over every InferenceEngine: the `hf` engine (a tiny random Qwen2),
the `sglang` adapter over the fake SGLang (tests/engines/fake_sglang.py), the `hf` engine
in a guarded child process (`hf-child`: GuardedEngine over ChildEngine, as the worker
drives it), and the `vllm` adapter over real vLLM (the CPU build; tests/vllm_support.py: a failure in CI when vLLM is
missing), both in this process (`vllm`) and in a child process (`vllm-child`, vLLM's
default `engines.<role>.process`: every call crosses the pipe). One vLLM engine of each
kind serves the whole module: each test gets a fresh adapter over the in-process one, and
the child's engine is put back (aborted, weights reloaded) after each test.

What is checked is the contract of engines/base.py, i.e. everything runtime/worker.py
calls: drain, abort with its tokens and resume, snapshot, seq_lengths, release and resume
of memory, weights and versions, stats, errors, close, the RNG state for checkpoints.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from pivot_hpc.engines.base import InferenceEngine, SamplingParams, SupervisedEngine
from pivot_hpc.engines.config import InferenceEngineConfig
from pivot_hpc.engines.factory import make_inference_engine
from pivot_hpc.engines.hf.engine import HFEngine
from pivot_hpc.engines.process.guard import GuardedEngine
from pivot_hpc.errors import PivotError
from pivot_hpc.models.qwen2 import create_model
from pivot_hpc.models.tokenizer import build_tokenizer
from tests.vllm_support import require_vllm, vllm_model_dir

from .conftest import TINY
from .fake_sglang import FakeSGLangEngine, close_all, drain, make_fake, weights, write_model_dir

KV = 4096
PROMPTS = [[3, 4, 5], [7, 8, 9, 10, 11], [20, 21], [30, 31, 32, 33]]  # < both vocabularies


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@dataclass
class Harness:
    kind: str
    engine: InferenceEngine
    weights: Callable[[], dict[str, torch.Tensor]]  # tensors its load_weights accepts
    fake: FakeSGLangEngine | None = None

    def produce(self, n: int) -> None:
        """About `n` more tokens for every running sequence, none of them finished."""
        if self.fake is None:
            for _ in range(n):
                assert not self.engine.step()
            return
        live = sum(1 for _ in self.engine.seq_lengths())
        self.fake.credit = n * live
        for _ in range(5_000):
            if self.fake.credit == 0 and all(  # streamed as far as the fake went
                r.n_new == len(self.fake.live[r.rid].out)
                for r in self.engine._reqs.values()
                if r.rid in self.fake.live
            ):
                break
            assert not self.engine.step()
        self.fake.credit = None if n == 0 else 0


@pytest.fixture(scope="module")
def vllm_base(tmp_path_factory):
    """One real vLLM engine for the module (startup and import are the cost)."""
    require_vllm()
    from safetensors.torch import load_file

    d = vllm_model_dir(tmp_path_factory.mktemp("vllm"))
    base = make_inference_engine(_vllm_cfg("in_rank"), "rollout", d, seed=0)
    state = load_file(str(d / "model.safetensors"))
    yield base, state
    base.close()


def _vllm_cfg(process: str) -> SimpleNamespace:
    ec = InferenceEngineConfig(engine="vllm", max_batch=8, process=process)
    return SimpleNamespace(
        engines=SimpleNamespace(rollout=ec), rollout=SimpleNamespace(tp=1, kv_capacity_tokens=KV)
    )


@pytest.fixture(scope="module")
def vllm_child(tmp_path_factory):
    """One vLLM engine in a child process for the module (engines.<role>.process: child)."""
    require_vllm()
    from safetensors.torch import load_file

    from pivot_hpc.engines.process.child import ChildEngine

    d = vllm_model_dir(tmp_path_factory.mktemp("vllm-child"))
    child = make_inference_engine(_vllm_cfg("child"), "rollout", d, seed=0)
    assert isinstance(child, GuardedEngine) and isinstance(child.engine, ChildEngine)
    assert isinstance(child, SupervisedEngine)
    yield child, load_file(str(d / "model.safetensors"))
    child.close()


@pytest.fixture(scope="module")
def hf_child(tiny_model, tmp_path_factory):
    """One hf engine in a child process for the module, as the worker drives it: a
    GuardedEngine (engines/process/guard.py) over the child."""
    from pivot_hpc.engines.process.child import ChildEngine

    d = tmp_path_factory.mktemp("hf-child")
    tiny_model.save_pretrained(d)
    build_tokenizer().save_pretrained(d)
    cfg = SimpleNamespace(
        engines=SimpleNamespace(
            rollout=InferenceEngineConfig(
                engine="hf", max_batch=8, max_seq_len=256, process="child"
            )
        ),
        rollout=SimpleNamespace(tp=1, kv_capacity_tokens=KV),
    )
    child = make_inference_engine(cfg, "rollout", d, seed=0)
    assert isinstance(child, GuardedEngine) and isinstance(child.engine, ChildEngine)
    assert isinstance(child, SupervisedEngine)
    yield child, {k: v.clone() for k, v in tiny_model.state_dict().items()}
    child.close()


class KeptChild:
    """The module's child engine for one test: `close` ends the test's use of it (aborts
    what runs, refuses later calls that would reach it) instead of ending its process."""

    def __init__(self, child) -> None:
        self._child, self._closed = child, False

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._child.abort_all()

    def has_unfinished(self) -> bool:
        return False if self._closed else self._child.has_unfinished()

    def __getattr__(self, name: str):
        if self._closed:
            raise RuntimeError(f"{name}: the engine is closed")
        return getattr(self._child, name)


def fresh_vllm_adapter(base):
    """A new adapter over the module's engine, as a just-started one would be."""
    from pivot_hpc.engines.vllm.engine import VLLMEngine

    return VLLMEngine(
        base.engine,
        api=base.api,
        stats=base.step_stats,
        max_batch=base.max_batch,
        max_seq_len=base.max_seq_len,
        kv_capacity=base.kv_capacity,
        eos_token_ids=base.eos_ids,
        weight_names=base.weight_names,
        seed=base.seed,
    )


@pytest.fixture(
    params=[
        "hf",
        "sglang",
        pytest.param("vllm", marks=pytest.mark.slow),  # import and start of vLLM: 10-25 s
        pytest.param("vllm-child", marks=pytest.mark.slow),
        pytest.param("hf-child", marks=pytest.mark.slow),  # a guarded engine process
    ]
)
def h(request, tiny_model, tmp_path):
    if request.param in ("vllm-child", "hf-child"):
        child, state = request.getfixturevalue(request.param.replace("-", "_"))
        yield Harness(request.param, KeptChild(child), lambda: state)
        child.abort_all()
        child.resume_memory()  # a test that released memory and stopped there
        child.load_weights(state, 0)  # (released weights have no contents)
    elif request.param == "vllm":
        base, state = request.getfixturevalue("vllm_base")
        eng = fresh_vllm_adapter(base)
        yield Harness("vllm", eng, lambda: state)
        eng.close()  # aborts what is left (no on_close: the engine stays the module's)
        if base.engine.is_sleeping():  # a test that released memory and stopped there
            base.engine.wake_up(["scheduling"])
    elif request.param == "hf":
        model = copy.deepcopy(tiny_model)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        eng = HFEngine(model, kv_capacity_tokens=KV, max_batch=8, max_seq_len=256)
        yield Harness("hf", eng, lambda: state)
        eng.close()
    else:
        eng, fake = make_fake(write_model_dir(tmp_path / "m", max_pos=256), tp=1, kv=KV)
        yield Harness("sglang", eng, lambda: weights(2), fake)
        close_all([eng])


def unleash(h: Harness) -> None:
    if h.fake is not None:
        h.fake.credit = None


def test_protocol(h):
    assert isinstance(h.engine, InferenceEngine)
    assert isinstance(h.engine, SupervisedEngine) or h.kind.endswith("-child")  # (KeptChild)
    assert h.engine.weights_device == "cpu"  # on this machine


def test_drain_reports_each_sequence_once(h):
    for i, p in enumerate(PROMPTS):
        h.engine.add(i, p, sampling=greedy(5))
    out = drain(h.engine)
    assert sorted(out) == list(range(len(PROMPTS)))
    for i, r in out.items():
        assert r.prompt_ids == PROMPTS[i] and len(r.token_ids) == len(r.logprobs) == 5
        assert r.finish_reason == "length" and all(lp <= 0 for lp in r.logprobs)
    assert not h.engine.has_unfinished() and h.engine.seq_lengths() == {}


def test_abort_keeps_tokens_and_resume_continues(h):
    e = h.engine
    e.add(0, PROMPTS[1], sampling=greedy(8))
    e.add(1, PROMPTS[1], sampling=greedy(8))  # the same sequence, never interrupted
    h.produce(3)
    part = e.abort(0)
    assert part.finish_reason == "abort" and 1 <= len(part.token_ids) < 8
    assert len(part.logprobs) == len(part.token_ids)
    e.add(0, PROMPTS[1], part.token_ids, greedy(8), part.logprobs)  # "elsewhere"
    unleash(h)
    out = drain(e)
    assert out[0].token_ids[: len(part.token_ids)] == part.token_ids
    assert out[0].logprobs[: len(part.logprobs)] == part.logprobs
    assert out[0].token_ids == out[1].token_ids and out[0].finish_reason == "length"


@pytest.mark.slow  # [sglang]: produce() runs its 5000-step cap (~10 s, asleep)
def test_snapshot_leaves_sequences_alone_and_is_a_prefix(h):
    e = h.engine
    for i in range(2):
        e.add(i, PROMPTS[i], sampling=greedy(10))
    h.produce(4)
    before = e.seq_lengths()
    snap = {r.seq_id: r for r in e.snapshot()}
    assert e.seq_lengths() == before and e.has_unfinished()
    assert sorted(snap) == [0, 1]
    for i, r in snap.items():
        assert r.prompt_ids == PROMPTS[i] and len(r.logprobs) == len(r.token_ids)
        assert before[i] == len(PROMPTS[i]) + len(r.token_ids)  # what seq_lengths counts
    unleash(h)
    out = drain(e)
    for i, r in snap.items():
        assert out[i].token_ids[: len(r.token_ids)] == r.token_ids
        assert out[i].logprobs[: len(r.logprobs)] == r.logprobs


def test_release_while_busy_is_refused(h):
    h.engine.add(0, PROMPTS[0], sampling=greedy(6))
    h.produce(1)
    with pytest.raises(RuntimeError, match="abort"):
        h.engine.release_memory(weights=True)
    h.engine.abort_all()
    h.engine.release_memory(weights=True)


def test_release_resume_load_weights_and_versions(h):
    e = h.engine
    e.release_memory(weights=True)
    e.release_memory(weights=True)  # idempotent
    with pytest.raises(RuntimeError):
        e.step()  # the weights are gone
    e.resume_memory()
    e.load_weights(h.weights(), 3)
    assert e.version == 3
    e.add(0, PROMPTS[0], sampling=greedy(3))
    assert drain(e)[0].version == 3
    e.release_memory()  # KV cache only
    e.resume_memory()
    e.add(1, PROMPTS[0], sampling=greedy(2))
    assert drain(e)[1].version == 3


def test_stats(h):
    e = h.engine
    e.add(0, PROMPTS[2], sampling=greedy(12))
    h.produce(3)
    st = e.stats()
    assert st.running == 1 and st.waiting == 0 and st.kv_capacity == KV
    assert st.tokens_in_cache >= len(PROMPTS[2]) and st.steps >= 1 and st.last_step_s >= 0
    assert st.preemptions == 0


def test_abort_of_a_sequence_it_does_not_hold_is_a_key_error(h):
    e = h.engine
    with pytest.raises(KeyError):
        e.abort(99)
    e.add(0, PROMPTS[0], sampling=greedy(2))
    drain(e)
    with pytest.raises(KeyError):  # finished and reported: the worker's Abort gets None
        e.abort(0)
    assert e.abort_all() == []


def test_bad_adds_are_refused(h):
    e = h.engine
    e.add(0, PROMPTS[0], sampling=greedy(2))
    with pytest.raises(ValueError, match="already"):
        e.add(0, PROMPTS[0])
    with pytest.raises(ValueError, match="empty prompt"):
        e.add(1, [])
    with pytest.raises(ValueError, match="max_seq_len"):
        e.add(2, [3] * 300)


def test_rng_state_round_trip(h):
    e = h.engine
    state = e.rng_state()
    sampled = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    e.add(0, PROMPTS[3], sampling=sampled)
    first = drain(e)[0]
    e.set_rng_state(state)
    e.add(1, PROMPTS[3], sampling=sampled)
    assert drain(e)[1].token_ids == first.token_ids


def test_close_is_final_and_idempotent(h):
    h.engine.add(0, PROMPTS[0], sampling=greedy(4))
    h.engine.close()
    h.engine.close()
    assert not h.engine.has_unfinished()


# ------------------------------------------------------- factory: the hf config keys
@pytest.fixture(scope="module")
def hf_model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    create_model(TINY, seed=1).save_pretrained(d)
    build_tokenizer().save_pretrained(d)
    return d


def _cfg(**kw) -> SimpleNamespace:
    return SimpleNamespace(
        engines=SimpleNamespace(rollout=InferenceEngineConfig(**kw)),
        rollout=SimpleNamespace(tp=1, kv_capacity_tokens=333),
    )


def test_factory_wires_every_hf_key(hf_model_dir):
    cfg = _cfg(max_batch=5, max_seq_len=100, prefill_chunk_tokens=77, num_threads=1, device="cpu")
    torch.set_num_threads(2)
    e = make_inference_engine(cfg, "rollout", hf_model_dir, seed=5)
    assert isinstance(e, HFEngine)
    assert (e.max_batch, e.max_len, e.prefill_chunk_tokens, e.kv_capacity) == (5, 100, 77, 333)
    assert torch.get_num_threads() == 1
    assert torch.equal(e.rng_state(), torch.Generator().manual_seed(5).get_state())
    assert e.weights_device == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_factory_refuses_cuda_without_a_gpu(hf_model_dir):
    with pytest.raises(PivotError, match=r"engines\.rollout\.device"):
        make_inference_engine(_cfg(device="cuda"), "rollout", hf_model_dir, seed=0)
    e = make_inference_engine(_cfg(device="auto"), "rollout", hf_model_dir, seed=0)
    assert e.weights_device == "cpu"
