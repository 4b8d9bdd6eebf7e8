"""vLLM on a GPU beside a resident trainer (issue 48): vLLM refuses to start unless
`gpu_memory_utilization` × the GPU is free (0.92 by default, even with the KV cache sized in
bytes), which a training GPU never has. The adapter asks for what the engine needs —
weights, KV cache, a margin — and says in one line when even that is not free. The CUDA
build's async scheduling is turned off: the adapter drives one step per call."""

from __future__ import annotations

from pathlib import Path

import pytest

from pivot_hpc.engines.config import InferenceEngineConfig
from pivot_hpc.engines.vllm.launch import GPU_MARGIN_BYTES, engine_args, memory_fraction
from pivot_hpc.errors import PivotError

GIB = 1 << 30
FACTS = {"layers": 28, "kv_heads": 4, "head_dim": 128, "dtype": "bfloat16"}  # Qwen2.5-7B


def _args(**kw):
    return engine_args(
        InferenceEngineConfig(engine="vllm", **kw.pop("ec", {})),
        Path("/models/qwen"),
        kv_capacity_tokens=200_000,
        max_seq_len=32768,
        seed=0,
        device_type="cuda",
        facts=FACTS,
        **kw,
    )


def test_the_fraction_is_what_the_engine_needs_of_the_whole_gpu() -> None:
    kv = 200_000 * 2 * 28 * 4 * 128 * 2  # 10.7 GiB
    a = _args(device_memory=(40 * GIB, 80 * GIB), weights_bytes=15 * GIB)
    need = 15 * GIB + kv + GPU_MARGIN_BYTES
    assert a["gpu_memory_utilization"] == pytest.approx(need / (80 * GIB), abs=1e-3)
    assert a["gpu_memory_utilization"] * 80 * GIB <= 40 * GIB  # vLLM's start-up check passes
    assert a["async_scheduling"] is False
    # a user's own fraction wins; CPU builds get none
    own = _args(
        device_memory=(40 * GIB, 80 * GIB), ec={"vllm_args": {"gpu_memory_utilization": 0.5}}
    )
    assert own["gpu_memory_utilization"] == 0.5
    assert "gpu_memory_utilization" not in _args()


def test_too_little_free_memory_is_one_line_naming_the_key() -> None:
    with pytest.raises(PivotError) as err:
        memory_fraction((20 * GIB, 80 * GIB), 15 * GIB, 11 * GIB, "engines.rollout")
    msg = str(err.value)
    assert "\n" not in msg and "engines.rollout.engine" in msg and "kv_capacity_tokens" in msg
    assert "28.0 GiB" in msg and "20.0 of 80.0 GiB" in msg
