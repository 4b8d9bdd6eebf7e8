"""Tiny model creation (deterministic, cached) and the acceptance run: a short GRPO run on
the synthetic task, in one process, raises the mean verifiable reward, with the GenRM
reward computed by the tiny GenRM."""

from __future__ import annotations

import json

import pytest
import torch

from pivot_hpc.data.arithmetic import problems
from pivot_hpc.models.config import ModelConfig, ModelsConfig, SFTConfig, TinyModelSpec
from pivot_hpc.models.zoo import load_model
from pivot_hpc.recipes.local_grpo import LocalGRPO
from pivot_hpc.recipes.tiny_models import ensure_model, ensure_models
from pivot_hpc.rl.config import GRPOConfig, RLConfig, TrainerConfig

SMALL = ModelConfig(hidden_size=64, num_layers=2, intermediate_size=192)


def test_creation_is_deterministic_and_cached(tmp_path):
    spec = TinyModelSpec(arch=SMALL, sft=SFTConfig(steps=4, batch_size=8))
    a = ModelsConfig(cache_dir=tmp_path / "a", policy=spec, seed=3)
    b = ModelsConfig(cache_dir=tmp_path / "b", policy=spec, seed=3)
    pa, pb = ensure_model(a, "policy", progress=False), ensure_model(b, "policy", progress=False)
    ma, tok = load_model(pa)
    mb, _ = load_model(pb)
    sa, sb = ma.state_dict(), mb.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    # SFT changed the random init
    from pivot_hpc.models.qwen2 import create_model

    init = create_model(SMALL, seed=3).state_dict()
    assert any(not torch.equal(sa[k], init[k]) for k in sa)
    # reuse: same directory, not rebuilt
    stamp = (pa / "meta.json").stat().st_mtime_ns
    assert ensure_model(a, "policy", progress=False) == pa
    assert (pa / "meta.json").stat().st_mtime_ns == stamp
    assert json.loads((pa / "meta.json").read_text())["sft_steps"] == 4
    assert tok.decode(tok.encode("12+3=?\n", add_special_tokens=False)) == "12+3=?\n"
    # another seed gives another model
    c = ModelsConfig(cache_dir=tmp_path / "a", policy=spec, seed=4)
    assert ensure_model(c, "policy", progress=False) != pa


STEPS = 50  # GRPO steps of 16 prompts x 8 samples
# Measured (trainer seed 0 / 1): -0.355 → -0.081 / -0.355 → -0.116. The held-out
# evaluation samples 4 responses per problem with the same random numbers before and
# after, so the difference is not sampling noise.
MARGIN = 0.1


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_grpo_raises_verifiable_reward(request):
    torch.set_num_threads(1)
    cache = request.config.cache.mkdir("pivot_hpc_models")
    cfg = ModelsConfig(cache_dir=cache)  # the embedded default's policy and GenRM
    pol_dir, genrm_dir = ensure_models(cfg, progress=False)
    policy, tok = load_model(pol_dir)
    genrm, _ = load_model(genrm_dir)
    rl = RLConfig(trainer=TrainerConfig(lr=5e-4, seed=0), grpo=GRPOConfig(kl_coef=0.1))
    loop = LocalGRPO(policy, genrm, tok, rl)
    held_out = problems(384, seed=123)
    before = loop.evaluate(held_out, temperature=1.0, samples=4)
    report = loop.train(problems(2000, seed=7), steps=STEPS, prompts_per_step=16)
    after = loop.evaluate(held_out, temperature=1.0, samples=4)
    curve = [round(s.mean_verifiable, 3) for s in report.steps]
    print(
        f"\nGRPO: sampled mean verifiable reward {before.mean_verifiable:.3f} → "
        f"{after.mean_verifiable:.3f} (accuracy {before.accuracy:.3f} → {after.accuracy:.3f}); "
        f"train curve {curve}; GenRM unparsable {report.genrm.unparsable}/{report.genrm.judged}"
    )
    assert report.genrm.judged == STEPS * 16 * 8
    assert report.genrm.unparsable <= 0.2 * report.genrm.judged
    kl = [s.metrics["kl"] for s in report.steps]
    assert min(kl) > -1e-6 and max(kl) > 0  # k3 KL: non-negative, and the policy moved
    assert after.mean_verifiable >= before.mean_verifiable + MARGIN
