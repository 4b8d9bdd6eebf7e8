"""Architectures issue 46 does not name, on the `hf` engine: each either runs with the
logprobs of a plain `transformers` forward, or is refused before launch in one line that
says what the engine's loop does not do — never a crash in a rank, never silently other
numbers. Tiny random-init models from `transformers`' own config classes; biases and norm
weights drawn at random too (a freshly built model has zero biases and unit norms, which
would hide a bias or a norm the loop skipped)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as tf

from pivot_hpc.engines.base import SamplingParams
from pivot_hpc.engines.hf.engine import generate_all, make_hf_engine
from pivot_hpc.errors import ConfigError
from pivot_hpc.job.config import load_config
from pivot_hpc.models.role_check import check_dir
from pivot_hpc.models.tokenizer import build_tokenizer
from pivot_hpc.recipes.tiny_arch_dirs import BASE

B: dict[str, Any] = BASE  # the tiny stand-ins' sizes (head_dim 16 = hidden / heads)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)

RUNS: dict[str, Callable[[], tuple[Any, Any]]] = {
    "mistral": lambda: (tf.MistralForCausalLM, tf.MistralConfig(**B, sliding_window=None)),
    "qwen2-moe": lambda: (
        tf.Qwen2MoeForCausalLM,
        tf.Qwen2MoeConfig(**B, **MOE, num_experts=4, shared_expert_intermediate_size=32),
    ),
    "gemma": lambda: (tf.GemmaForCausalLM, tf.GemmaConfig(**B)),
    "starcoder2": lambda: (tf.Starcoder2ForCausalLM, tf.Starcoder2Config(**B, sliding_window=None)),
    # MLP biases (InternLM-style Llama): the fused MLP would drop them
    "llama-mlp-bias": lambda: (
        tf.LlamaForCausalLM,
        tf.LlamaConfig(**B, attention_bias=True, mlp_bias=True),
    ),
    # partial rotary (a quarter of each head turns)
    "stablelm": lambda: (tf.StableLmForCausalLM, tf.StableLmConfig(**B)),
    # every fourth layer without rotary embeddings (NoPE)
    "smollm3": lambda: (tf.SmolLM3ForCausalLM, tf.SmolLM3Config(**{**B, "num_hidden_layers": 4})),
    # a sigmoid router with a persistent correction-bias buffer (GLM-4.5's MoE)
    "glm4-moe": lambda: (
        tf.Glm4MoeForCausalLM,
        tf.Glm4MoeConfig(
            **B, **MOE, n_routed_experts=4, first_k_dense_replace=1, n_group=1, topk_group=1
        ),
    ),
}
REFUSED: dict[str, tuple[Callable[[], tuple[Any, Any]], str]] = {
    "olmo2": (lambda: (tf.Olmo2ForCausalLM, tf.Olmo2Config(**B)), "not pre-norm blocks"),
    "cohere": (lambda: (tf.CohereForCausalLM, tf.CohereConfig(**B)), "not pre-norm blocks"),
    "olmoe": (
        lambda: (tf.OlmoeForCausalLM, tf.OlmoeConfig(**B, num_experts=4, num_experts_per_tok=2)),
        "q_norm spans 128 features",
    ),
    "granite-mup": (
        lambda: (
            tf.GraniteForCausalLM,
            tf.GraniteConfig(
                **B,
                embedding_multiplier=12.0,
                residual_multiplier=0.22,
                attention_multiplier=0.0078,
                logits_scaling=8.0,
            ),
        ),
        "scales its embeddings, residuals or logits",
    ),
    "gemma2": (
        lambda: (tf.Gemma2ForCausalLM, tf.Gemma2Config(**B)),
        "sliding_attention",
    ),
    "deepseek-v3": (
        lambda: (
            tf.DeepseekV3ForCausalLM,
            tf.DeepseekV3Config(
                **B,
                **MOE,
                n_routed_experts=4,
                first_k_dense_replace=1,
                kv_lora_rank=32,
                q_lora_rank=64,
                qk_rope_head_dim=16,
                qk_nope_head_dim=16,
                v_head_dim=16,
                n_group=1,
                topk_group=1,
            ),
        ),
        "neither q/k/v_proj",
    ),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [[1, 20, 21, 22, 30], [1, 40, 41, 50, 60, 70]]


def build(make, out: Path):
    cls, config = make()
    torch.manual_seed(3)
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # biases and norm weights away from their initial 0 and 1
                p.normal_(1.0 if "norm" in name else 0.0, 0.2)
        for name, b in model.named_buffers():
            if "correction_bias" in name:
                b.normal_(0.0, 0.2)
    model.save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    return model


@pytest.fixture(scope="module")
def cfg():
    return load_config("configs/tiny.yaml", [])


@pytest.mark.parametrize("arch", sorted(RUNS))
def test_runs_with_the_logprobs_of_a_transformers_forward(tmp_path, cfg, arch):
    model = build(RUNS[arch], tmp_path / arch)
    check_dir(cfg, "models.genrm_path", tmp_path / arch, [("reward", 2)], False)
    engine = make_hf_engine(str(tmp_path / arch), kv_capacity_tokens=2048)
    for r, p in zip(generate_all(engine, PROMPTS, GREEDY), PROMPTS, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([p + r.token_ids])).logits[0].float()
        lp = torch.log_softmax(logits, -1)[len(p) - 1 : -1]
        want = lp.gather(1, torch.tensor(r.token_ids)[:, None])[:, 0]
        assert (want - torch.tensor(r.logprobs)).abs().max().item() <= 1e-4, arch


@pytest.mark.parametrize("arch", sorted(REFUSED))
def test_what_the_loop_cannot_run_is_refused_before_launch(tmp_path, cfg, arch):
    make, why = REFUSED[arch]
    build(make, tmp_path / arch)
    with pytest.raises(ConfigError) as err:
        check_dir(cfg, "models.genrm_path", tmp_path / arch, [("reward", 1)], False)
    msg = str(err.value)
    assert "\n" not in msg and why in msg and "engines.reward.engine" in msg, msg
