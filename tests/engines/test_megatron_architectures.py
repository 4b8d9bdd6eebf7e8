"""The trainer trains the dense families users train (issue 46 #4): tiny random-init
directories of Qwen2 tied, Qwen3 (q/k norms, no q/k/v bias, head_dim ≠ hidden/heads) and
Llama 3 (llama3 rope scaling with its own parameters), Mistral — megatron-core's forward after
conversion equals `transformers`' on the same weights, a GRPO step trains, and the weights
it exports load back into `transformers` with equal logits. The trainer's shape comes from
config.json alone (models/trainable.py). The real engine, in this process (tp 1)."""

from __future__ import annotations

import pytest
import torch

from pivot_hpc.engines.base import TrainBatch
from pivot_hpc.errors import PivotError
from pivot_hpc.models.trainable import model_config_of_dir
from pivot_hpc.recipes.tiny_arch_dirs import build_arch_dir
from pivot_hpc.rl.config import TrainerConfig

TRAINED = ["qwen2-tied", "qwen3", "llama3", "mistral"]


def _hf(d):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()


def _batch() -> TrainBatch:
    return TrainBatch(
        prompt_ids=[[3, 4, 5, 6]] * 4,
        response_ids=[[10 + i, 20, 30 + i, 40, 50] for i in range(4)],
        advantages=[1.0, -1.0, 0.5, -0.5],
        old_logprobs=[[-4.0] * 5 for _ in range(4)],
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", TRAINED)
def test_megatron_computes_and_trains_each_family(tmp_path, arch: str) -> None:
    from pivot_hpc.engines.megatron.engine import MegatronTrainEngine

    d = build_arch_dir(arch, tmp_path / arch, initializer_range=0.05)
    shape = model_config_of_dir(d)
    hf = _hf(d)
    e = MegatronTrainEngine(shape, TrainerConfig(tp=1, lr=1e-3, seed=0, dtype="fp32"))
    canonical = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    e.load_weights(canonical)
    ids = torch.randint(3, 99, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(ids).logits.float()
    assert (e.forward_logits(ids) - want).abs().max().item() <= 1e-4
    m = e.train_step(_batch())
    assert m["skipped_nonfinite"] == 0.0 and m["tokens"] == 20
    trained = e.export_weights()
    stored = set(canonical)  # a tied lm_head is the embedding: catalog.as_stored drops it
    assert stored <= set(trained) and any(not torch.equal(trained[k], canonical[k]) for k in stored)
    hf.load_state_dict({k: trained[k] for k in stored}, strict=False)
    if shape.tie_word_embeddings:
        assert torch.equal(trained["lm_head.weight"], trained["model.embed_tokens.weight"])
    with torch.no_grad():
        again = hf(ids).logits.float()
    assert (e.forward_logits(ids) - again).abs().max().item() <= 1e-4
    e.close()


def test_the_shape_comes_from_config_json(tmp_path) -> None:
    qwen3 = model_config_of_dir(build_arch_dir("qwen3", tmp_path / "q3"))
    assert (qwen3.qk_norm, qwen3.qkv_bias, qwen3.head_size()) == (True, False, 16)
    llama = model_config_of_dir(build_arch_dir("llama3", tmp_path / "l3"))
    assert (llama.qk_norm, llama.qkv_bias) == (False, False)
    assert (llama.rope_llama3_factor, llama.rope_llama3_original_max_position) == (8.0, 128)
    qwen2 = model_config_of_dir(build_arch_dir("qwen2-tied", tmp_path / "q2"))
    assert qwen2.qkv_bias and qwen2.tie_word_embeddings and not qwen2.qk_norm


@pytest.mark.parametrize(
    ("arch", "override", "says"),
    [
        ("glm4", {}, "model_type 'glm4'"),
        ("qwen3-moe", {}, "model_type 'qwen3_moe'"),
        ("llama3", {"mlp_bias": True}, "mlp_bias"),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 64}, "use_sliding_window"),
        ("llama3", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ("mistral", {"sliding_window": 64}, "sliding_window 64"),
    ],
)
def test_what_the_trainer_cannot_train_is_refused_by_name(tmp_path, arch, override, says):
    d = build_arch_dir(arch, tmp_path / arch, **override)
    with pytest.raises(PivotError, match=says):
        model_config_of_dir(d)


@pytest.mark.parametrize("arch", TRAINED)
@pytest.mark.parametrize("tp", [2, 4])
def test_conversion_round_trips_at_each_tp(tmp_path, arch: str, tp: int) -> None:
    from pivot_hpc.engines.megatron.convert import hf_to_megatron, megatron_to_hf

    d = build_arch_dir(arch, tmp_path / arch)
    shape = model_config_of_dir(d)
    hf = _hf(d).state_dict()
    shards = [hf_to_megatron(hf, shape, r, tp) for r in range(tp)]
    back = megatron_to_hf(shards, shape)
    assert set(back) == set(hf) | {"lm_head.weight"}
    assert all(torch.equal(back[k], hf[k]) for k in hf)
