"""Tiny random-init Hugging Face directories of real architectures, built offline.

Each is `transformers`' own model class and config class at toy sizes (hidden 128, 2
layers, 8 heads / 4 KV heads of 16, vocab 128 so the char tokenizer fits; heads, KV heads
and MLP widths divisible by 4 so tp 1, 2 and 4 all cut them), saved with `save_pretrained`
(safetensors, config.json, generation_config.json with the tokenizer's EOS) plus the char
tokenizer of models/tokenizer.py. `initializer_range` 0.3: with the default 0.02 greedy
decoding of a random tiny model repeats one token. Deterministic per seed. They stand in
for the paper's models in tests, benchmarks and `plan` checks:

    qwen2        Qwen2ForCausalLM, untied (q/k/v biases)      Qwen2.5-7B and larger
    qwen2-tied   Qwen2ForCausalLM, tie_word_embeddings        Qwen2.5-0.5B/1.5B/3B
    qwen3        Qwen3ForCausalLM (q/k norms, no qkv bias)    Qwen3-8B/32B
    llama3       LlamaForCausalLM with llama3 rope scaling    Llama 3.x
    mistral      MistralForCausalLM, no sliding window        Mistral Small/Nemo, Ministral
    qwen3-moe    Qwen3MoeForCausalLM (4 experts, top 2)       Qwen3-30B-A3B
    glm4         Glm4ForCausalLM (fused gate_up_proj)         GLM-Z1-9B, GLM-4-9B
    phi3         Phi3ForCausalLM (fused qkv_proj, gate_up_proj)  Phi-3 / Phi-4-mini
    qwen3.5-moe  Qwen3_5MoeForCausalLM, the text model (linear + full attention layers,
                 shared expert)                               Qwen3.5-122B-A10B's decoder
    qwen3.5-moe-vl  Qwen3_5MoeForConditionalGeneration: the same decoder nested under
                 `text_config`, a one-block vision tower      Qwen3.5-122B-A10B as shipped

`python -m pivot_hpc.recipes.tiny_arch_dirs ARCH OUT [--dtype bfloat16] [--seed 0]
[--tokenizer char|chatml|llama3]` (the tokenizer: recipes/tiny_tokenizers.py).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pivot_hpc.recipes.tiny_tokenizers import KINDS

DTYPES = ("float32", "bfloat16")
PAD, BOS, EOS = 0, 1, 2  # the char tokenizer's ids (models/tokenizer.py)

BASE: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=16,
    intermediate_size=128,
    max_position_embeddings=512,
    initializer_range=0.3,
    pad_token_id=PAD,
    bos_token_id=BOS,
    eos_token_id=EOS,
)
MOE: dict[str, Any] = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
QWEN35_TEXT: dict[str, Any] = dict(
    **MOE,
    shared_expert_intermediate_size=32,
    layer_types=["linear_attention", "full_attention"],
    linear_num_key_heads=4,
    linear_key_head_dim=16,
    linear_num_value_heads=4,
    linear_value_head_dim=16,
)


def _model(arch: str, overrides: dict[str, Any]):
    """(model class, config) of one architecture, `overrides` applied to the text sizes."""
    import transformers as tf

    base = {**BASE, **overrides}
    dense = {k: v for k, v in base.items() if k != "intermediate_size"}
    makers: dict[str, Callable[[], tuple[Any, Any]]] = {
        "qwen2": lambda: (tf.Qwen2ForCausalLM, tf.Qwen2Config(**base)),
        "qwen2-tied": lambda: (
            tf.Qwen2ForCausalLM,
            tf.Qwen2Config(**{**base, "tie_word_embeddings": True}),
        ),
        "qwen3": lambda: (tf.Qwen3ForCausalLM, tf.Qwen3Config(**base)),
        "llama3": lambda: (
            tf.LlamaForCausalLM,
            tf.LlamaConfig(
                **base,
                rope_parameters={
                    "rope_type": "llama3",
                    "rope_theta": 500000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 128,
                },
            ),
        ),
        "mistral": lambda: (
            tf.MistralForCausalLM,
            tf.MistralConfig(**{"sliding_window": None, **base}),
        ),
        "qwen3-moe": lambda: (tf.Qwen3MoeForCausalLM, tf.Qwen3MoeConfig(**base, **MOE)),
        "glm4": lambda: (tf.Glm4ForCausalLM, tf.Glm4Config(**base)),
        "phi3": lambda: (tf.Phi3ForCausalLM, tf.Phi3Config(**base)),
        "qwen3.5-moe": lambda: (
            tf.Qwen3_5MoeForCausalLM,
            tf.Qwen3_5MoeTextConfig(**{**QWEN35_TEXT, **dense}),
        ),
        "qwen3.5-moe-vl": lambda: (
            tf.Qwen3_5MoeForConditionalGeneration,
            tf.Qwen3_5MoeConfig(
                text_config={**QWEN35_TEXT, **dense},
                vision_config=dict(
                    depth=1,
                    hidden_size=32,
                    intermediate_size=64,
                    num_heads=2,
                    out_hidden_size=base["hidden_size"],
                    patch_size=4,
                    spatial_merge_size=2,
                    temporal_patch_size=2,
                    num_position_embeddings=16,
                ),
            ),
        ),
    }
    if arch not in makers:
        raise ValueError(f"architecture {arch!r}: choose one of {', '.join(ARCHITECTURES)}")
    return makers[arch]()


ARCHITECTURES = (
    "qwen2",
    "qwen2-tied",
    "qwen3",
    "llama3",
    "mistral",
    "qwen3-moe",
    "glm4",
    "phi3",
    "qwen3.5-moe",
    "qwen3.5-moe-vl",
)


def create_arch_model(arch: str, *, dtype: str = "float32", seed: int = 0, **overrides: Any):
    """The random-init `transformers` model of `arch` (the same seed, the same weights)."""
    import torch

    from pivot_hpc.models.zoo import _quiet_transformers

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    _quiet_transformers()
    cls, config = _model(arch, overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    model = model.to(getattr(torch, dtype))
    model.eval()
    return model


def build_arch_dir(
    arch: str,
    out: str | Path,
    *,
    dtype: str = "float32",
    seed: int = 0,
    tokenizer: str = "char",
    **overrides: Any,
) -> Path:
    """Save a tiny random-init `arch` model, a tokenizer (`tokenizer`: one of
    recipes/tiny_tokenizers.py's kinds, the tiny job's char tokenizer by default) and a
    generation config with its end ids into `out` (created); returns `out`. `overrides`:
    config sizes (e.g. num_key_value_heads=2)."""
    from pivot_hpc.recipes.tiny_tokenizers import build_family_tokenizer

    out = Path(out)
    tok, ids = build_family_tokenizer(tokenizer)
    specials = {f"{k}_token_id": ids[k] for k in ("pad", "bos", "eos")}
    model = create_arch_model(arch, dtype=dtype, seed=seed, **{**specials, **overrides})
    gen = model.generation_config
    gen.bos_token_id, gen.pad_token_id = ids["bos"], ids["pad"]
    gen.eos_token_id = ids["end"] if len(ids["end"]) > 1 else ids["end"][0]
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("arch", choices=ARCHITECTURES)
    ap.add_argument("out", type=Path)
    ap.add_argument("--dtype", choices=DTYPES, default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer", choices=KINDS, default="char")
    args = ap.parse_args(argv)
    out = build_arch_dir(
        args.arch, args.out, dtype=args.dtype, seed=args.seed, tokenizer=args.tokenizer
    )
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
