"""A trainer's export of a tied-embedding policy (Qwen2.5-0.5B/1.5B/3B's layout) carries
an `lm_head.weight` (transformers' state dicts list the tied head, megatron_to_hf copies
the embedding into it); the policy in GPS, described from the directory, has no such
tensor. `ModelSpec.as_stored` is what the training seat publishes: the head left out, every
tensor in the storage's dtype, anything else unknown refused by name."""

from __future__ import annotations

import pytest
import torch

from pivot_hpc.gps import ModelSpec
from pivot_hpc.gps.catalog import GPSError
from pivot_hpc.recipes.tiny_arch_dirs import create_arch_model


def _export(arch: str) -> dict[str, torch.Tensor]:
    return {k: v.float() for k, v in create_arch_model(arch, seed=7).state_dict().items()}


def test_tied_head_is_left_to_the_embedding(arch_dirs):
    spec = ModelSpec.from_dir(arch_dirs["qwen2-tied"], name="policy")
    assert spec.tie_word_embeddings and "lm_head.weight" not in spec.index
    weights = _export("qwen2-tied")
    assert "lm_head.weight" in weights  # what a trainer exports
    stored = spec.as_stored(weights)
    assert set(stored) == set(spec.index)
    assert all(v.dtype == torch.bfloat16 for v in stored.values())  # the directory's dtype
    emb = stored["model.embed_tokens.weight"]
    assert torch.equal(emb, weights["lm_head.weight"].to(torch.bfloat16))


def test_untied_head_is_published(arch_dirs):
    spec = ModelSpec.from_dir(arch_dirs["qwen2"], name="policy")
    stored = spec.as_stored(_export("qwen2"))
    assert "lm_head.weight" in stored and set(stored) == set(spec.index)


def test_another_architectures_export_is_refused_by_name(arch_dirs):
    spec = ModelSpec.from_dir(arch_dirs["qwen2-tied"], name="policy")
    with pytest.raises(GPSError, match=r"no tensors \['model.layers.0.self_attn.k_norm"):
        spec.as_stored(_export("qwen3"))
