"""What a Hugging Face model directory says about generation limits (read without loading
the model: the engines size their sequences and stop tokens from it). The config part of the
model layer (models/description.py): SGLang's and vLLM's adapters read it for a directory
whose weights their library loads."""

from __future__ import annotations

from pathlib import Path

from pivot_hpc.models.description import generation_limits
from pivot_hpc.models.safetensors_headers import ModelDirError


def model_limits(model_dir: str | Path) -> tuple[int, list[int]]:
    """(max_position_embeddings, eos token ids) from a Hugging Face model directory: the
    eos ids of config.json, then those generation_config.json adds."""
    max_pos, eos = generation_limits(model_dir)
    if max_pos is None:
        raise ModelDirError(
            f"{Path(model_dir) / 'config.json'}: no max_position_embeddings; add the model's "
            "context length to its config"
        )
    return max_pos, list(eos)
