"""The `vllm` engine: vLLM 0.32 driven step by step (CPU build in CI, CUDA on clusters)."""
