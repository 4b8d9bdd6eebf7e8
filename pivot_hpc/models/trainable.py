"""What the Megatron trainer trains: the dense decoders its conversion maps
(engines/megatron/convert.py), and the `ModelConfig` of a directory's config.json.

Qwen2/Qwen2.5 (tied or not), Qwen3 dense, Llama 3 and Mistral share one layout — RMSNorm, rotary
GQA attention, SwiGLU — and differ in flags a `ModelConfig` carries: q/k/v biases, per-head
q/k norms, head width, llama3 rope scaling. Anything else in a config (a sliding window, an
MLP bias, another rope type, another activation) is refused by name here, before launch
(models/role_check.py) and again where a trainer is built, so a trainer never computes a
different function than the model it was handed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pivot_hpc.errors import PivotError
from pivot_hpc.models.config import ModelConfig

# model_type → the families it stands for (what role_check's refusal lists)
TRAINABLE = {
    "qwen2": "Qwen2/Qwen2.5",
    "qwen3": "Qwen3 (dense)",
    "llama": "Llama 3",
    "mistral": "Mistral (no sliding window)",  # Llama's layout under another model_type
}
ROPE_TYPES = ("default", "llama3")


def _rope(c: Any) -> dict:
    """transformers 5 keeps rope settings in `rope_parameters`, 4.x in `rope_scaling`."""
    rope = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
    return dict(rope)


def training_problem(c: Any) -> str | None:
    """Why the Megatron trainer cannot train the model of transformers config `c` (None:
    it can)."""
    c = getattr(c, "text_config", None) or c
    kind = getattr(c, "model_type", None)
    if kind not in TRAINABLE:
        return (
            f"model_type {kind!r}: the trainer's conversion maps "
            f"{', '.join(TRAINABLE.values())} only (engines/megatron/convert.py)"
        )
    rope_type = _rope(c).get("rope_type", _rope(c).get("type", "default"))
    if rope_type not in ROPE_TYPES:
        return f"rope_type {rope_type!r}: the trainer applies {', '.join(ROPE_TYPES)} only"
    if getattr(c, "use_sliding_window", False):
        return "use_sliding_window is true: the trainer attends to the whole sequence"
    window = getattr(c, "sliding_window", None)  # Mistral's: no use_sliding_window switch
    if kind == "mistral" and window and window < c.max_position_embeddings:
        return f"sliding_window {window}: the trainer attends to the whole sequence"
    if getattr(c, "mlp_bias", False):
        return "mlp_bias is true: the trainer's MLP has no bias"
    act = getattr(c, "hidden_act", "silu")
    if act != "silu":
        return f"hidden_act {act!r}: the trainer's MLP is SwiGLU (silu)"
    return None


def model_config_of_hf(c: Any) -> ModelConfig:
    """The ModelConfig of a transformers config object (one the trainer can train)."""
    why = training_problem(c)
    if why is not None:
        raise PivotError(f"the trainer cannot train this model: {why}")
    c = getattr(c, "text_config", None) or c
    rope = _rope(c)
    theta = getattr(c, "rope_theta", None) or rope.get("rope_theta", 10000.0)
    llama3 = rope.get("rope_type", rope.get("type")) == "llama3"
    return ModelConfig(
        hidden_size=c.hidden_size,
        num_layers=c.num_hidden_layers,
        num_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads,
        intermediate_size=c.intermediate_size,
        vocab_size=c.vocab_size,
        max_position_embeddings=c.max_position_embeddings,
        rope_theta=float(theta),
        rms_norm_eps=c.rms_norm_eps,
        tie_word_embeddings=bool(c.tie_word_embeddings),
        initializer_range=c.initializer_range,
        # a config that names the hidden width's own split is the default (None)
        head_dim=_head_dim(c),
        qkv_bias=c.model_type == "qwen2" or bool(getattr(c, "attention_bias", False)),
        qk_norm=c.model_type == "qwen3",
        rope_llama3_factor=float(rope["factor"]) if llama3 else 0.0,
        rope_llama3_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        rope_llama3_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        rope_llama3_original_max_position=int(rope.get("original_max_position_embeddings", 8192)),
    )


def _head_dim(c: Any) -> int | None:
    d = getattr(c, "head_dim", None)
    return None if d in (None, c.hidden_size // c.num_attention_heads) else int(d)


def model_config_of_dir(path: str | Path) -> ModelConfig:
    """The ModelConfig of the HF model directory `path`, from its config.json alone (the
    weights are never read: a training rank needs the shape, not a whole-model copy)."""
    from transformers import AutoConfig

    return model_config_of_hf(AutoConfig.from_pretrained(str(path)))
