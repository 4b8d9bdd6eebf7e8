"""What a Hugging Face model directory says about generation limits (read without loading
the model: the engines size their sequences and stop tokens from it)."""

from __future__ import annotations

import json
from pathlib import Path


def model_limits(model_dir: str | Path) -> tuple[int, list[int]]:
    """(max_position_embeddings, eos token ids) from a Hugging Face model directory."""
    d = Path(model_dir)
    config = json.loads((d / "config.json").read_text())
    eos: list[int] = []
    for src in (config, _read_json(d / "generation_config.json")):
        value = src.get("eos_token_id")
        for t in value if isinstance(value, list) else [value]:
            if t is not None and int(t) not in eos:
                eos.append(int(t))
    return int(config["max_position_embeddings"]), eos


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}
