"""Tiny random Qwen2 models shared by the engine tests (seconds, not minutes)."""

from __future__ import annotations

import pytest
import torch

from pivot_hpc.models.config import ModelConfig
from pivot_hpc.models.qwen2 import create_model

# hidden 64, 2 layers, GQA 4:2, char vocab padded to 128. initializer_range 0.3 keeps a
# random model's greedy output varied (PLATFORM.md).
TINY = ModelConfig(
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=128,
    vocab_size=128,
    max_position_embeddings=256,
    initializer_range=0.3,
)


@pytest.fixture(scope="session")
def tiny_model():
    torch.set_num_threads(1)
    return create_model(TINY, seed=3)


@pytest.fixture(scope="session")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [
        torch.randint(3, 99, (int(torch.randint(3, 24, (1,), generator=g)),), generator=g).tolist()
        for _ in range(10)
    ]
