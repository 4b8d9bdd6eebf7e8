"""The ONLY place where megatron-core is patched to run on CPU (docs/platform.md).

Applied by `apply()` only when no CUDA device is present; on a GPU machine it does
nothing. What it changes, and why:
- `torch.cuda.current_device` → "cpu": megatron allocates small flag/metadata tensors
  with `device=torch.cuda.current_device()` (dist-checkpoint save, grad buffers).
- `torch.cuda.synchronize` → no-op: called by checkpoint save; raises without CUDA.
- RNG tracker: megatron's `model_parallel_cuda_manual_seed` asserts on CPU; an inference
  tracker (fork = nullcontext) is enough because the tiny models use no dropout.
- CUDA RNG state get/set in `tensor_parallel.random` → an empty state / no-op: activation
  recompute (`tensor_parallel.checkpoint`, rl.trainer.recompute) saves and restores every
  RNG around a recomputed block; on CPU only torch's own (CPU) state exists, which it
  still saves and restores.
Everything else that megatron needs on CPU is an argument, not a patch: the local layer
spec, `use_cpu_initialization=True`, an explicit causal mask, a plain torch optimizer.
"""

from __future__ import annotations

import contextlib

import torch

_applied = False


def needed() -> bool:
    return not torch.cuda.is_available()


def apply() -> bool:
    """Patch once; returns True when the CPU shim is active."""
    global _applied
    if not needed():
        return False
    if _applied:
        return True
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.empty(0, dtype=torch.uint8)
    mrandom._set_cuda_rng_state = lambda *a, **k: None
    _applied = True
    reset_rng_tracker()
    return True


def reset_rng_tracker() -> None:
    """A CPU-safe RNG tracker (dropout-free models never fork a real CUDA stream)."""
    from megatron.core.tensor_parallel import random as mrandom

    with contextlib.suppress(Exception):
        mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
