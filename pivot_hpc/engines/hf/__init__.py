"""The `hf` engine: a compact continuous-batching loop over a `transformers` model (CPU)."""
