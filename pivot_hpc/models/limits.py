"""What a Hugging Face model directory says about generation limits (read without loading
the model: the engines size their sequences and stop tokens from it). A thin view of the
model's description (models/description.py)."""

from __future__ import annotations

from pathlib import Path

from pivot_hpc.models.description import description_of
from pivot_hpc.models.safetensors_headers import ModelDirError


def model_limits(model_dir: str | Path) -> tuple[int, list[int]]:
    """(max_position_embeddings, eos token ids) from a Hugging Face model directory: the
    eos ids of config.json, then those generation_config.json adds."""
    desc = description_of(model_dir)
    if desc.max_position_embeddings is None:
        raise ModelDirError(
            f"{Path(model_dir) / 'config.json'}: no max_position_embeddings; add the model's "
            "context length to its config"
        )
    return desc.max_position_embeddings, list(desc.eos_token_ids)
