"""Build a role's InferenceEngine from the run config (docs/design.md §5).

`engines.<role>.engine` picks it: `hf` (CPU or the worker's GPU, embedded), `sglang`
(GPU, one SGLang Engine per replica leader over the replica's `tp` GPUs) or `vllm` (vLLM,
CPU or GPU build: vllm_launch.py). `engines.<role>.process` says where `hf` and `vllm` run:
in the worker rank's process or in a child of it (child_engine.py; vLLM's default). sglang
and vllm are imported only here, lazily.

Config keys and where they go: `max_batch`, `max_seq_len`, `prefill_chunk_tokens` and the
sampling `seed` reach both engines (SGLang: max_running_requests, context_length,
chunked_prefill_size, random_seed); `num_threads` and `device` are the `hf` engine's (the
worker's torch threads, where the model lives); the rest of `engines.<role>` is SGLang's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pivot_hpc.engines import job_signals
from pivot_hpc.engines.base import InferenceEngine
from pivot_hpc.engines.config import InferenceEngineConfig
from pivot_hpc.errors import PivotError
from pivot_hpc.models.limits import model_limits


def make_inference_engine(
    cfg: Any,
    role: str,
    model_dir: str | Path,
    *,
    seed: int,
    slot: int = 0,
    reclaim_signals: Callable[[], object] | None = None,
) -> InferenceEngine:
    """The engine of `role` ("rollout" or "reward") for the model in `model_dir`.

    `slot`: node-local index of the replica's first GPU (the leader's own); `hf` ignores it
    (its worker sees one GPU, runtime/devices.py). `reclaim_signals`: called once an
    engine that takes SIGTERM over (SGLang) has given it back (the runtime's stop handler).
    """
    ec: InferenceEngineConfig = getattr(cfg.engines, role)
    rc = getattr(cfg, role)  # InferenceRoleConfig: tp, kv_capacity_tokens
    if ec.engine == "vllm":
        from pivot_hpc.engines.vllm_launch import check_installed, make_vllm_engine

        vllm_args = {
            "ec": ec,
            "role": role,
            "tp": rc.tp,
            "kv_capacity_tokens": rc.kv_capacity_tokens,
            "seed": seed,
        }
        if ec.process == "child":  # vLLM's default: vllm_launch.py, docs/engines.md
            from pivot_hpc.engines.child_engine import ChildEngine

            check_installed(f"engines.{role}.engine")  # one line here, not the child's trace
            return ChildEngine("vllm", str(model_dir), vllm_args, watchdog_s=ec.watchdog_timeout_s)
        return make_vllm_engine(model_dir=model_dir, **vllm_args)
    if ec.engine == "sglang":
        return make_sglang_engine(
            ec,
            model_dir,
            role=role,
            tp=rc.tp,
            kv_capacity_tokens=rc.kv_capacity_tokens,
            slot=slot,
            seed=seed,
            reclaim_signals=reclaim_signals,
        )
    from pivot_hpc.engines.hf_engine import HFEngine
    from pivot_hpc.models.zoo import load_model

    device = resolve_device(ec.device, f"engines.{role}.device")
    hf_args = {
        "kv_capacity_tokens": rc.kv_capacity_tokens,
        "max_batch": ec.max_batch,
        "max_seq_len": ec.max_seq_len,
        "prefill_chunk_tokens": ec.prefill_chunk_tokens,
        "num_threads": ec.num_threads,  # 1 by default: one thread per worker (docs/platform.md)
        "seed": seed,
    }
    if ec.process == "child":
        from pivot_hpc.engines.child_engine import ChildEngine

        return ChildEngine(
            "hf", str(model_dir), {**hf_args, "device": device}, watchdog_s=ec.watchdog_timeout_s
        )
    model, tok = load_model(model_dir)
    return HFEngine(model.to(device), eos_token_id=tok.eos_token_id, **hf_args)


def resolve_device(device: str, config_key: str) -> str:
    """ "auto" → the worker's GPU if it sees one, else "cpu"; "cuda" without one is refused."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise PivotError(
            f"config key '{config_key}' = 'cuda' but this worker sees no CUDA device "
            "(CUDA_VISIBLE_DEVICES, driver); use 'auto' or 'cpu'"
        )
    return device


def sglang_server_args(
    ec: InferenceEngineConfig,
    model_dir: str | Path,
    *,
    tp: int,
    kv_capacity_tokens: int,
    max_seq_len: int,
    seed: int,
    ports: list[int],
    mem_fraction_static: float | None,
) -> dict[str, Any]:
    """Keyword arguments of `sglang.Engine` (fields of SGLang 0.5.23's ServerArgs)."""
    port, nccl_port = ports
    args: dict[str, Any] = {
        **ec.server_args,
        "model_path": str(model_dir),
        "tp_size": tp,
        "base_gpu_id": 0,  # CUDA_VISIBLE_DEVICES is the replica's GPUs (sglang_launch)
        "skip_tokenizer_init": True,  # token ids in and out
        "enable_memory_saver": True,  # release/resume_memory_occupation on role shifts
        "context_length": max_seq_len,
        "max_total_tokens": kv_capacity_tokens,
        "max_running_requests": ec.max_batch,
        "chunked_prefill_size": ec.prefill_chunk_tokens,
        "random_seed": seed,
        "port": port,
        "nccl_port": nccl_port,
        "dist_init_addr": f"127.0.0.1:{nccl_port}",  # a replica is on one node
        "watchdog_timeout": ec.watchdog_timeout_s,
    }
    if mem_fraction_static is not None:
        args["mem_fraction_static"] = mem_fraction_static
    return args


def make_sglang_engine(
    ec: InferenceEngineConfig,
    model_dir: str | Path,
    *,
    role: str,
    tp: int,
    kv_capacity_tokens: int,
    slot: int,
    seed: int,
    api: Any = None,
    free_memory: Callable[[str | None], list[int]] | None = None,
    reclaim_signals: Callable[[], object] | None = None,
) -> InferenceEngine:
    """Start one SGLang Engine over GPUs [slot, slot + tp) of this node (this process
    becomes the replica leader) and wrap it. `api` replaces the sglang imports and
    `free_memory` the NVML query (tests)."""
    from pivot_hpc.engines import sglang_launch as launch
    from pivot_hpc.engines.sglang_engine import SGLangEngine, load_sglang_api

    key = f"engines.{role}"
    api = api or load_sglang_api(f"{key}.engine")
    max_pos, eos = model_limits(model_dir)
    max_seq_len = ec.max_seq_len or max_pos
    visible = launch.replica_gpus(slot, tp, f"{role}.tp")
    ports = launch.engine_ports(ec.port_base, slot, config_key=f"{key}.port_base")
    fraction = ec.mem_fraction_static
    if fraction is None:
        free = (free_memory or launch.free_gpu_bytes)(visible)
        if free:  # else SGLang's own choice (no NVML here)
            launch.check_balanced(free, config_key=f"{role}.tp")
            fraction = launch.mem_fraction_static(
                min(free),
                launch.weights_bytes(model_dir) // tp,
                int(ec.memory_reserve_gib * launch.GIB),
                config_key=f"{key}.memory_reserve_gib",
            )
    args = sglang_server_args(
        ec,
        model_dir,
        tp=tp,
        kv_capacity_tokens=kv_capacity_tokens,
        max_seq_len=max_seq_len,
        seed=seed,
        ports=ports,
        mem_fraction_static=fraction,
    )
    # its scheduler and detokenizer children must outlive Slurm's step-wide USR1/TERM
    with launch.scoped_env(launch.launch_env(visible)), job_signals.shielded():
        engine = api.engine_cls(**args)
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
        idle_timeout_s=ec.idle_timeout_s,
        pause_mode=ec.pause_mode,
        config_key=key,
        reclaim_signals=reclaim_signals,
    )
