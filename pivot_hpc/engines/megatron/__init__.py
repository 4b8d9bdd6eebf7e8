"""The `megatron` training engine: megatron-core GPTModel, its optimizer, checkpoints and
the Hugging Face ↔ Megatron conversion."""
