"""Build every engine from the run config, and decide where each runs (docs/design.md §5).

Inference: `engines.<role>.engine` picks it — `hf` (CPU or the worker's GPU, embedded),
`sglang` (GPU, one SGLang Engine per replica leader over the replica's `tp` GPUs:
engines/sglang/launch.py) or `vllm` (vLLM, CPU or GPU build: engines/vllm/launch.py) — and
`engines.<role>.process` where `hf` and `vllm` run: in the worker rank's process or in a
child of it (engines/process/; vLLM's default), guarded there so that its death is an
unplanned shift-down. Either way the worker gets a SupervisedEngine (engines/base.py).
sglang and vllm are imported only here, lazily.

Training: `rl.trainer.engine` picks the TrainEngine (today `megatron`; a second one, FSDP
or torchtitan, implements engines/base.py's TrainEngine and is added in
`make_train_engine`), `rl.trainer.process` where it runs (`make_trainer`: in the rank or
in a child); the worker gets a SupervisedTrainer. Nothing in the runtime names an engine
class.

Config keys and where they go: `max_batch`, `max_seq_len`, `prefill_chunk_tokens` and the
sampling `seed` reach both inference engines (SGLang: max_running_requests,
context_length, chunked_prefill_size, random_seed); `num_threads` and `device` are the
`hf` engine's (the worker's torch threads, where the model lives); the rest of
`engines.<role>` is SGLang's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from pivot_hpc.engines.base import SupervisedEngine, SupervisedTrainer, TrainEngine
from pivot_hpc.engines.config import InferenceEngineConfig
from pivot_hpc.errors import PivotError
from pivot_hpc.models.config import ModelConfig


def make_inference_engine(
    cfg: Any,
    role: str,
    model_dir: str | Path,
    *,
    seed: int,
    slot: int = 0,
    reclaim_signals: Callable[[], object] | None = None,
    survive_start: bool = False,
) -> SupervisedEngine:
    """The engine of `role` ("rollout" or "reward") for the model in `model_dir`.

    `slot`: node-local index of the replica's first GPU (the leader's own); `hf` ignores it
    (its worker sees one GPU, runtime/devices.py). `reclaim_signals`: called once an
    engine that takes SIGTERM over (SGLang) has given it back (the runtime's stop handler).
    `survive_start`: an engine process that dies while it starts gives a dead engine (a
    shift-up's start: its failure is reported, the replica shifted down and restarted, or
    excluded) instead of EngineProcessError (the job's start: the rank fails).
    """
    ec: InferenceEngineConfig = getattr(cfg.engines, role)
    rc = getattr(cfg, role)  # InferenceRoleConfig: tp, kv_capacity_tokens
    if ec.engine == "sglang":
        from pivot_hpc.engines.sglang.launch import make_sglang_engine

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
    if ec.engine == "vllm":
        from pivot_hpc.engines.vllm.launch import check_installed

        args: dict[str, Any] = {
            "ec": ec,
            "role": role,
            "tp": rc.tp,
            "kv_capacity_tokens": rc.kv_capacity_tokens,
            "seed": seed,
        }
        check_installed(f"engines.{role}.engine")  # one line here, not the child's trace
    else:
        device = resolve_device(ec.device, f"engines.{role}.device")
        args = {
            "kv_capacity_tokens": rc.kv_capacity_tokens,
            "max_batch": ec.max_batch,
            "max_seq_len": ec.max_seq_len,
            "prefill_chunk_tokens": ec.prefill_chunk_tokens,
            "num_threads": ec.num_threads,  # 1 by default: one thread per worker (platform)
            "seed": seed,
            "device": device,
        }
    if ec.process == "child":  # vLLM's default: engines/vllm/launch.py, docs/guide/vllm.md
        from pivot_hpc.engines.process.child import ChildEngine, EngineProcessError
        from pivot_hpc.engines.process.guard import GuardedEngine

        try:
            child = ChildEngine(ec.engine, str(model_dir), args, watchdog_s=ec.watchdog_timeout_s)
        except EngineProcessError as exc:
            if not survive_start:
                raise
            return GuardedEngine.failed_start(exc)
        return GuardedEngine(child)
    if ec.engine == "vllm":
        from pivot_hpc.engines.vllm.launch import make_vllm_engine

        return make_vllm_engine(model_dir=model_dir, **args)
    from pivot_hpc.engines.hf.engine import make_hf_engine

    return make_hf_engine(str(model_dir), **args)


def make_train_engine(cfg: Any, model_cfg: ModelConfig) -> TrainEngine:
    """The training engine of `cfg.rl.trainer.engine` for a policy of shape `model_cfg`, in
    this process (call on every training rank; torch.distributed's environment is the
    caller's)."""
    rl = cfg.rl
    if rl.trainer.engine == "megatron":
        from pivot_hpc.engines.megatron.engine import MegatronTrainEngine

        return MegatronTrainEngine(
            model_cfg, rl.trainer, rl.grpo, max_response_tokens=rl.max_response_tokens
        )
    raise ValueError(f"rl.trainer.engine={rl.trainer.engine!r}: no such training engine")


def make_trainer(
    cfg: Any,
    model_cfg: ModelConfig,
    *,
    world: tuple[tuple[int, ...], int],
    rank: int,
    world_env: dict[str, str],
) -> SupervisedTrainer:
    """The trainer of a rank that may train, where `rl.trainer.process` puts it: in this
    process (its torch.distributed environment, `world_env`, set here first) or in a child
    (which makes a world of its own from `world_env`). `world`: the world ranks that may
    train and training's tp (elastic training's step groups); `rank`: this one's."""
    from pivot_hpc.engines.step_groups import StepGroups

    rl = cfg.rl
    if rl.trainer.process == "child":
        from pivot_hpc.engines.process.child import ChildTrainer

        return ChildTrainer(
            model_cfg,
            rl.trainer,
            rl.grpo,
            max_response_tokens=rl.max_response_tokens,
            world=world,
            rank=rank,
            world_env=world_env,
        )
    import os

    import torch

    from pivot_hpc.engines.process.local import LocalTrainer

    os.environ.update(world_env)
    torch.set_num_threads(1)
    return LocalTrainer(make_train_engine(cfg, model_cfg), StepGroups(*world), rank)


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
