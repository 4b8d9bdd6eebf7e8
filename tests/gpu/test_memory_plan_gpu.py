"""The memory plan's training figure against `torch.cuda.max_memory_allocated` of a real
Megatron step (skipped without CUDA).

The plan's allocator-side bytes (weights + grads + optimizer + activations + attention
workspace + the optimizer step's temporary; no CUDA context, NCCL or fragmentation, which
the allocator does not count) should bound the measured peak from above without being far
off: 0.7-1.15 of it. The engine runs the local attention spec, no recompute and a full
optimizer per GPU, so that is what is planned.
"""

from __future__ import annotations

import gc
import os
import socket

import pytest
import torch

from pivot_hpc.models.config import ModelConfig
from pivot_hpc.planning.inputs import TrainInputs, spec_from_arch
from pivot_hpc.planning.memory import training_memory

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ARCH = ModelConfig(
    hidden_size=1024,
    num_layers=8,
    num_heads=16,
    num_kv_heads=4,
    intermediate_size=2816,
    vocab_size=32000,
    max_position_embeddings=4096,
)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@needs_cuda
@pytest.mark.parametrize(("micro_batch", "seq_len"), [(1, 2048), (2, 1024), (1, 4096)])
def test_training_peak_matches_the_plan(micro_batch: int, seq_len: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    )
    from pivot_hpc.engines.base import TrainBatch
    from pivot_hpc.engines.megatron_engine import MegatronTrainEngine
    from pivot_hpc.rl.config import TrainerConfig

    gc.collect()  # an earlier case's engine is gone before this one is measured
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    engine = MegatronTrainEngine(ARCH, TrainerConfig(dtype="bf16", micro_batch_size=micro_batch))
    g = torch.Generator().manual_seed(0)
    prompt = seq_len // 4
    batch = TrainBatch(
        prompt_ids=[torch.randint(3, 99, (prompt,), generator=g).tolist()] * micro_batch,
        response_ids=[torch.randint(3, 99, (seq_len - prompt,), generator=g).tolist()]
        * micro_batch,
    )
    engine.train_step(batch, loss="sft")  # the first step also creates the Adam state
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - base
    del engine
    plan = training_memory(
        TrainInputs(
            model=spec_from_arch("probe", ARCH),
            tp=1,
            gpus=1,
            dtype="bf16",
            micro_batch=micro_batch,
            seq_len=seq_len,
            attention="local",
            recompute="none",
            distributed_optimizer=False,
        ),
        None,
    )
    allocated = (
        plan.weights
        + plan.grads
        + plan.optimizer
        + plan.activations
        + plan.attention
        + plan.temporaries
    )
    print(f"measured {measured / 2**30:.2f} GiB, planned {allocated / 2**30:.2f} GiB")
    assert 0.7 * allocated <= measured <= 1.15 * allocated
