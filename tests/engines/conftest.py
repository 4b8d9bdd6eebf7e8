"""Tiny random Qwen2 models shared by the engine tests (seconds, not minutes)."""

from __future__ import annotations

import pytest
import torch

from pivot_hpc.models.qwen2 import create_model
from tests.tiny_arch import tiny_arch

# initializer_range 0.3 keeps a random model's greedy output varied (docs/platform.md)
TINY = tiny_arch(max_position_embeddings=256, initializer_range=0.3)


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


@pytest.fixture(scope="session")
def hf_model_dir(tiny_model, tmp_path_factory):
    """The tiny policy with its tokenizer as a Hugging Face directory (child engines)."""
    from pivot_hpc.models.tokenizer import build_tokenizer

    d = tmp_path_factory.mktemp("policy")
    tiny_model.save_pretrained(d)
    build_tokenizer().save_pretrained(d)
    return d
