"""Build the training role's TrainEngine from the run config (`rl.trainer.engine`).

One training engine exists today, `megatron` (megatron-core GPTModel; on CPU through the
shim, on GPUs as is). A second one (FSDP, torchtitan) implements engines/base.py's
TrainEngine and is added here; nothing in the runtime names an engine class.
"""

from __future__ import annotations

from typing import Any

from pivot_hpc.engines.base import TrainEngine
from pivot_hpc.models.config import ModelConfig


def make_train_engine(cfg: Any, model_cfg: ModelConfig) -> TrainEngine:
    """The training engine of `cfg.rl.trainer.engine` for a policy of shape `model_cfg`
    (call on every training rank; torch.distributed's environment is the caller's)."""
    rl = cfg.rl
    if rl.trainer.engine == "megatron":
        from pivot_hpc.engines.megatron_engine import MegatronTrainEngine

        return MegatronTrainEngine(
            model_cfg, rl.trainer, rl.grpo, max_response_tokens=rl.max_response_tokens
        )
    raise ValueError(f"rl.trainer.engine={rl.trainer.engine!r}: no such training engine")
