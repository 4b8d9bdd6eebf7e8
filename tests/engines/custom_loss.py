"""A user's loss for `rl.grpo.loss_fn` (tests/engines/megatron_worker.py plugs it in):
the default PPO-clip loss, doubled, and counted."""

from __future__ import annotations

from pivot_hpc.rl.grpo import ppo_clip_loss

CALLS = []


def doubled_loss(*args, **kwargs):
    CALLS.append(sorted(kwargs))
    loss, parts = ppo_clip_loss(*args, **kwargs)
    return 2 * loss, {**parts, "pg_loss_sum": 2 * parts["pg_loss_sum"]}
