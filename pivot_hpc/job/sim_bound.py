"""The work-conserving bound's per-role rates, from the lengths a simulated run draws.

The bound (telemetry/summary.py) divides each role's tokens by a per-GPU rate. Those
rates are what the simulated engine charges for the run's own samples at the best
batching it allows, with no wait, shift or migration:

- decode: an iteration with n sequences holding `tok` tokens takes A·tok + F(n) and
  gives n tokens (sim/cluster.py). Summed over a run, the A part is exact whatever the
  batching: Σ over sequences of A·(m·c₀ + m²/2), m tokens decoded from a c₀-token context
  (the simulator's continuous form). F(n)/n falls with n, so every token costs at least
  the F(n)/n of the largest batch the engine admits (its running cap, and the KV cache
  over the shortest context).
- prefill: each sequence's context once (prompt; prompt + response for the GenRM).
- training: the FLOPs of every pass per trained sequence at the achieved per-GPU rate
  (no all-reduce, no publish).

Earlier builds took one rate per role at the median lengths. Response and judgement
lengths are log-normal, so a decoded token's mean context is far above the median one
(the long sequences hold most tokens, each at a long context): that "bound" charged the
GenRM 1.45× (group 1) to 1.94× (group 2) fewer GPU-seconds than the simulator can spend
at best, and no schedule could reach it.

A second bound reads the same samples for the pipeline's critical path: with staleness s,
batch k + s + 1 is released only once step k has trained, so every step k costs at least
its longest sample's rollout and judgement, each alone on a replica (an iteration's
A·tok + F(n) is least at n = 1), plus its training's FLOPs on every GPU of the cluster. A
run of N steps then lasts at least the largest sum of those chains over steps k, k + s + 1,
k + 2(s + 1), …; its tokens over that time are `bound_critical_path` (tokens/s). With
short batches, few GPUs' worth of work per step or heavy tails it is far below the
work-conserving bound, and no planner can pass it: the batch's longest samples, not the
GPUs, set the pace.

The samples are those the run releases, drawn again from the seeded workload by the
run's own `RLState.release` (the same sample ids, so the same lengths). With dynamic sampling the
replacements are not in the draw; the rates are then those of each batch's first draw.
"""

from __future__ import annotations

import numpy as np

from pivot_hpc.job import build as builder
from pivot_hpc.job.config import Config
from pivot_hpc.job.sim_settings import sim_workload
from pivot_hpc.sim.catalog import InferenceCosts, TrainingCosts


def drawn_lengths(cfg: Config) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(prompt, response, judgement) lengths of every sample the run releases."""
    rl = builder.rl_state(cfg, sim_workload(cfg))
    rl.staleness = cfg.loop.steps  # release every batch up front, untrained
    rows = [
        (s.prompt_len, s.payload.response_len, s.payload.judgement_len)
        for _ in range(cfg.loop.steps)
        for s in rl.release()
    ]
    prompt, response, judgement = np.array(rows, dtype=np.float64).T
    return prompt, response, judgement


def batched_lengths(cfg: Config) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`drawn_lengths` as (steps, batch size) arrays: row k is batch k."""
    return tuple(x.reshape(cfg.loop.steps, -1) for x in drawn_lengths(cfg))  # type: ignore[return-value]


def min_fixed_per_token(costs: InferenceCosts, shortest_context: float) -> float:
    """F(n)/n at the largest batch the engine admits (running cap; KV cache over the
    shortest context). F(n)/n = max(B(n)/n, C) + S + D/n never rises with n (B(n), the
    weights streamed, is constant or grows ever slower as more experts are touched), so
    that batch is the cheapest per token."""
    n_max = max(1, int(costs.kv_capacity_tokens // max(1.0, shortest_context)))
    if costs.max_running:
        n_max = min(n_max, costs.max_running)
    return costs.fixed(float(n_max)) / n_max


def inference_gpu_s(
    costs: InferenceCosts, tp: int, context: np.ndarray, tokens: np.ndarray
) -> float:
    """GPU-seconds to prefill each `context` and decode its `tokens`, at best batching."""
    if not len(tokens):
        return 0.0
    decode_a = costs.A * float((tokens * context + tokens * tokens / 2.0).sum())
    decode_f = float(tokens.sum()) * min_fixed_per_token(costs, float(context.min()))
    prefill = costs.prefill_s_per_token * float(context.sum())
    return tp * (decode_a + decode_f + prefill)


def solo_seconds(costs: InferenceCosts, context: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Seconds each sequence takes alone on one replica: prefill its context, then decode
    its tokens at F(1) + A·(its own tokens) an iteration, the least any batching allows."""
    return (
        costs.prefill_s_per_token * context
        + tokens * costs.fixed(1.0)
        + costs.A * (tokens * context + tokens * tokens / 2.0)
    )


def critical_path_rate(
    lengths: tuple[np.ndarray, np.ndarray, np.ndarray],
    inference: dict[str, InferenceCosts],
    training: TrainingCosts,
    staleness: int,
    gpus: int,
) -> float:
    """Tokens/s (rollout + reward) that no schedule of `gpus` GPUs beats over the run at
    staleness `staleness`, from its `batched_lengths`: see the module docstring."""
    prompt, response, judgement = lengths
    sample = solo_seconds(inference["rollout"], prompt, response) + solo_seconds(
        inference["reward"], prompt + response, judgement
    )
    train = np.array([training.flops(p + r) for p, r in zip(prompt, response, strict=True)])
    chain = sample.max(axis=1) + train / (training.flops_per_s_per_gpu * gpus)
    span = max(chain[r :: staleness + 1].sum() for r in range(staleness + 1))
    return float((response.sum() + judgement.sum()) / span)


def bound_rates(
    cfg: Config,
    inference: dict[str, InferenceCosts],
    training: TrainingCosts,
    lengths: tuple[np.ndarray, np.ndarray, np.ndarray],
) -> dict[str, float]:
    """The run attributes `bound_rollout_per_gpu`, `bound_reward_per_gpu` (tokens per
    GPU-second) and `bound_train_gpu_s_per_token` that telemetry/summary.py reads, from
    the run's `drawn_lengths` (any shape)."""
    prompt, response, judgement = (x.ravel() for x in lengths)
    ro = inference_gpu_s(inference["rollout"], cfg.rollout.tp, prompt, response)
    rm = inference_gpu_s(inference["reward"], cfg.reward.tp, prompt + response, judgement)
    trained = prompt + response
    return {
        "bound_rollout_per_gpu": float(response.sum()) / ro,
        "bound_reward_per_gpu": float(judgement.sum()) / rm,
        # every pass's FLOPs at the achieved per-GPU rate (no all-reduce, no publish)
        "bound_train_gpu_s_per_token": training.flops(trained)
        / training.flops_per_s_per_gpu
        / float(trained.sum()),
    }
