"""Create a tiny Qwen2 `transformers` model from a ModelConfig (random init, offline)."""

from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from pivot_hpc.models.config import ModelConfig
from pivot_hpc.models.tokenizer import build_tokenizer
from pivot_hpc.models.trainable import model_config_of_dir, model_config_of_hf


def hf_config(cfg: ModelConfig) -> Qwen2Config:
    tok = build_tokenizer()
    return Qwen2Config(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_word_embeddings,
        initializer_range=cfg.initializer_range,
        hidden_act="silu",
        attention_dropout=0.0,
        use_sliding_window=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        torch_dtype="float32",
    )


def create_model(cfg: ModelConfig, seed: int = 0) -> Qwen2ForCausalLM:
    """A randomly initialised model; the same seed gives the same weights."""
    from pivot_hpc.models.zoo import _quiet_transformers

    _quiet_transformers()  # its save_pretrained draws no "Writing model shards" bar
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(hf_config(cfg))
    model.eval()
    return model


def model_config_of(model) -> ModelConfig:
    """The ModelConfig that describes an existing HF model."""
    return model_config_of_hf(model.config)


# the ModelConfig of a directory or config: models/trainable.py (every trained family)
__all__ = ["create_model", "hf_config", "model_config_of", "model_config_of_dir"]
