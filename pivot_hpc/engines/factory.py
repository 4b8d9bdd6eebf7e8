"""Build a role's InferenceEngine from the run config (DESIGN.md §5).

`engines.<role>.engine` picks it: `hf` (CPU, embedded) or `sglang` (GPU, one SGLang Engine
per replica leader over the replica's `tp` GPUs). sglang is imported only here, lazily.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pivot_hpc.engines.base import InferenceEngine
from pivot_hpc.engines.config import InferenceEngineConfig


def make_inference_engine(
    cfg: Any, role: str, model_dir: str | Path, *, seed: int, gpu: int = 0
) -> InferenceEngine:
    """The engine of `role` ("rollout" or "reward") for the model in `model_dir`.

    `gpu`: node-local index of the replica's first GPU (SGLang's base_gpu_id; `hf` ignores it).
    """
    ec: InferenceEngineConfig = getattr(cfg.engines, role)
    rc = getattr(cfg, role)  # InferenceRoleConfig: tp, kv_capacity_tokens
    if ec.engine == "sglang":
        return make_sglang_engine(
            ec,
            model_dir,
            role=role,
            tp=rc.tp,
            kv_capacity_tokens=rc.kv_capacity_tokens,
            base_gpu_id=gpu,
            seed=seed,
        )
    from pivot_hpc.engines.hf_engine import HFEngine
    from pivot_hpc.models.zoo import load_model

    model, tok = load_model(model_dir)
    return HFEngine(
        model,
        kv_capacity_tokens=rc.kv_capacity_tokens,
        max_batch=ec.max_batch,
        max_seq_len=ec.max_seq_len,
        prefill_chunk_tokens=ec.prefill_chunk_tokens,
        eos_token_id=tok.eos_token_id,
        num_threads=ec.num_threads,  # 1 by default: one thread per worker (PLATFORM.md)
        seed=seed,
    )


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


def sglang_server_args(
    ec: InferenceEngineConfig,
    model_dir: str | Path,
    *,
    tp: int,
    kv_capacity_tokens: int,
    max_seq_len: int,
    base_gpu_id: int,
    seed: int,
) -> dict[str, Any]:
    """Keyword arguments of `sglang.Engine` (fields of SGLang 0.5.23's ServerArgs)."""
    args: dict[str, Any] = {
        **ec.server_args,
        "model_path": str(model_dir),
        "tp_size": tp,
        "base_gpu_id": base_gpu_id,
        "skip_tokenizer_init": True,  # token ids in and out
        "enable_memory_saver": True,  # release/resume_memory_occupation on role shifts
        "context_length": max_seq_len,
        "max_total_tokens": kv_capacity_tokens,
        "max_running_requests": ec.max_batch,
        "random_seed": seed,
    }
    if ec.mem_fraction_static is not None:
        args["mem_fraction_static"] = ec.mem_fraction_static
    return args


def make_sglang_engine(
    ec: InferenceEngineConfig,
    model_dir: str | Path,
    *,
    role: str,
    tp: int,
    kv_capacity_tokens: int,
    base_gpu_id: int,
    seed: int,
    api: Any = None,
) -> InferenceEngine:
    """Start one SGLang Engine (this process becomes the replica leader) and wrap it.
    `api` replaces the sglang imports (tests)."""
    from pivot_hpc.engines.sglang_engine import SGLangEngine, load_sglang_api

    api = api or load_sglang_api(f"engines.{role}.engine")
    max_pos, eos = model_limits(model_dir)
    max_seq_len = ec.max_seq_len or max_pos
    engine = api.engine_cls(
        **sglang_server_args(
            ec,
            model_dir,
            tp=tp,
            kv_capacity_tokens=kv_capacity_tokens,
            max_seq_len=max_seq_len,
            base_gpu_id=base_gpu_id,
            seed=seed,
        )
    )
    return SGLangEngine(
        engine,
        api=api,
        tp_size=tp,
        max_batch=ec.max_batch,
        max_seq_len=max_seq_len,
        eos_token_ids=eos,
        weight_bucket_bytes=ec.weight_bucket_mb << 20,
        stream_interval=ec.stream_interval,
        poll_s=ec.poll_s,
        abort_timeout_s=ec.abort_timeout_s,
    )
