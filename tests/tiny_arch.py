"""The tiny Qwen2 architecture the engine tests and the standalone MPI/torchrun test
programs share: hidden 64, 2 layers, GQA 4:2, char vocab padded to 128 (seconds, not
minutes). The programs import it as `tests.tiny_arch` (PYTHONPATH = the repository)."""

from __future__ import annotations

from pivot_hpc.models.config import ModelConfig


def tiny_arch(**overrides) -> ModelConfig:
    fields = dict(
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        vocab_size=128,
        max_position_embeddings=128,
        initializer_range=0.02,
    )
    return ModelConfig(**{**fields, **overrides})
