"""Build and run a simulated deployment: config → catalog costs → SimCluster + Coordinator.

The coordinator, schedulers and planner are the production objects; only the cluster is
simulated. Telemetry goes to <out>/telemetry/alloc-NNN.h5 in the same schema as live runs.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from pivot_hpc.config import Config, to_dict
from pivot_hpc.config.loader import ConfigError
from pivot_hpc.coordinator import build as builder
from pivot_hpc.coordinator.coordinator import Coordinator
from pivot_hpc.progress import Progress
from pivot_hpc.sim.bound import batched_lengths, bound_rates, critical_path_rate
from pivot_hpc.sim.catalog import (
    HARDWARE,
    MODELS,
    InferenceCosts,
    ModelSpec,
    TrainingTerms,
    from_profile,
    inference_costs,
    lookup,
    model_from_profile,
    training_costs,
    with_max_running,
)
from pivot_hpc.sim.cluster import SimCluster
from pivot_hpc.sim.workload import SimWorkload, sim_rewarder
from pivot_hpc.telemetry.summary import (
    steady_made_rate,
    steady_state,
    steady_work_share,
    step_table,
    work_conserving_bound,
)


def role_model(cfg: Config, role: str) -> ModelSpec:
    """The catalog model of a role, or the one its profile file describes."""
    name = cfg.sim.policy_model if role == "rollout" else cfg.sim.reward_model
    profile = cfg.sim.rollout_profile if role == "rollout" else cfg.sim.reward_profile
    if name in MODELS or profile is None:
        return lookup(MODELS, name, "model")
    return model_from_profile(name, profile)


def role_costs(cfg: Config, models: dict[str, ModelSpec]) -> dict[str, InferenceCosts]:
    """Inference costs of both roles: catalog × calibration, or the user's own profiles."""
    hw = lookup(HARDWARE, cfg.sim.hardware, "hardware")
    out = {}
    for role, profile in (("rollout", cfg.sim.rollout_profile), ("reward", cfg.sim.reward_profile)):
        costs = inference_costs(models[role], hw, getattr(cfg, role).tp)
        if cfg.sim.max_running_requests is not None:
            costs = with_max_running(costs, cfg.sim.max_running_requests)
        if profile is not None:
            costs = from_profile(costs, profile)
        out[role] = costs
    return out


def build(
    cfg: Config, *, late_finish_share: float = 0.0
) -> tuple[Coordinator, SimCluster, dict[str, Any]]:
    """The simulated deployment of `cfg` (`late_finish_share`: see SimCluster; tests)."""
    hw = lookup(HARDWARE, cfg.sim.hardware, "hardware")
    policy, judge = role_model(cfg, "rollout"), role_model(cfg, "reward")
    costs = role_costs(cfg, {"rollout": policy, "reward": judge})
    topology = builder.topology(
        cfg,
        models={r: c.model for r, c in costs.items()},
        kv_capacity={r: c.kv_capacity_tokens for r, c in costs.items()},
        training_tp=cfg.sim.training_tp,
        prefill_s_per_token={r: c.prefill_s_per_token for r, c in costs.items()},
    )
    terms = TrainingTerms(
        recompute_old_logprobs=cfg.sim.recompute_old_logprobs or cfg.rl.grpo.recompute_old_logprobs,
        activation_recompute=cfg.sim.activation_recompute,
        reference_forward=cfg.rl.grpo.kl_coef > 0,
    )
    train_costs = training_costs(
        policy,
        hw,
        len(topology.training_gpus),
        cfg.sim.training_tp,
        terms,
        gpus_per_node=cfg.cluster.gpus_per_node,
    )
    cluster = SimCluster(
        inference=costs,
        training=train_costs,
        late_finish_share=late_finish_share,
        seed=cfg.sim.seed,
    )
    rl = builder.rl_state(cfg, SimWorkload(cfg.sim.workload, cfg.sim.seed))
    coord = builder.build(
        cfg,
        cluster=cluster,
        topology=topology,
        rl=rl,
        rewarder=sim_rewarder,
        training_time=train_costs,
    )
    lengths = batched_lengths(cfg)  # the run's samples, drawn again for both bounds
    meta = builder.run_meta(
        cfg,
        rl,
        simulated=True,
        seed=cfg.sim.seed,
        hardware=hw.name,
        policy_model=policy.name,
        reward_model=judge.name,
        config=json.dumps(to_dict(cfg)),
        # For the work-conserving bound (telemetry/summary.py): what the simulated engines
        # charge per token of this run's samples at their best (sim/bound.py).
        **bound_rates(cfg, costs, train_costs, lengths),
    )
    meta["bound_critical_path"] = critical_path_rate(
        lengths, costs, train_costs, meta["staleness"], meta["gpus"]
    )
    return coord, cluster, meta


def scale_to(cfg: Config, gpus: int) -> Config:
    """The same deployment on `gpus` GPUs: allocations and batch scale proportionally."""
    total = cfg.cluster.total_gpus
    if gpus == total:
        return cfg
    per_node = cfg.cluster.gpus_per_node
    if gpus < per_node or gpus % per_node:
        raise ConfigError(
            f"--gpus {gpus}: must be a positive multiple of cluster.gpus_per_node={per_node}"
        )
    f = gpus / total

    def scaled(v: int | None, unit: int = 1) -> int | None:
        return None if v is None else max(unit, round(v * f / unit) * unit)

    d = cfg.deployment
    return dataclasses.replace(
        cfg,
        cluster=dataclasses.replace(cfg.cluster, nodes=gpus // per_node),
        training=dataclasses.replace(
            cfg.training, gpus=None, num_gpus=scaled(len(cfg.training_gpus()))
        ),
        deployment=dataclasses.replace(
            d,
            rollout_gpus=scaled(d.rollout_gpus, max(cfg.rollout.tp, cfg.reward.tp)),
            reward_gpus=scaled(d.reward_gpus, cfg.reward.tp),
        ),
        loop=dataclasses.replace(cfg.loop, batch_prompts=scaled(cfg.loop.batch_prompts)),
    )


def simulate(cfg: Config, out: str | Path | None, *, progress: bool = True) -> dict[str, Any]:
    """Run the simulation to completion; write telemetry under `out`; return a summary."""
    if out is not None and any((Path(out) / "telemetry").glob("alloc-*.h5")):
        raise ConfigError(
            f"--out {out}: already holds a run's telemetry (a report would mix the two runs); "
            "choose a new directory or delete it"
        )
    coord, cluster, meta = build(cfg)
    writer = None
    if out is not None:
        from pivot_hpc.telemetry import TelemetryWriter

        writer = TelemetryWriter(out, meta=meta)
        coord.telemetry = writer
    bar = Progress(
        cfg.loop.steps, f"simulate {meta['mode']}", unit="steps", enabled=progress, leave=True
    )
    wall = time.perf_counter()
    try:
        with bar:
            coord.run(progress=bar.update if progress else None)
    finally:
        if writer:
            writer.close()
    wall = time.perf_counter() - wall
    logs = coord.stats
    tokens = coord.tokens_total
    steps = step_table(logs.steps)
    span = coord.last_step_end - coord.first_step_start
    bound = work_conserving_bound(steps, meta.get, meta["gpus"])
    share = steady_work_share(steps, meta["staleness"], meta.get, meta["gpus"])
    return {
        "mode": meta["mode"],
        "strategy": meta["strategy"],
        "gpus": meta["gpus"],
        "steps": cfg.loop.steps,
        "sim_time_s": round(cluster.now(), 3),
        "tokens": int(tokens),
        "tokens_per_s": tokens / span if span > 0 else 0.0,
        "tokens_per_s_steady": steady_state(steps, meta["staleness"]),
        "tokens_per_s_bound": bound,
        "tokens_per_s_critical_path": meta["bound_critical_path"],
        "steady_work_share": share,
        # the work of the full pipeline as tokens/s at the run's mix of work
        "tokens_per_s_steady_made": steady_made_rate(share, bound),
        "shifts": logs.shifts_up,
        "training_prewarms": logs.training_prewarms,
        "plans": logs.plans,
        "migrated_sequences": logs.migrated,
        "preempted_sequences": cluster.preempted,
        "events": logs.events,
        "staleness_max": max(logs.staleness, default=0),
        "reward_mean_first": logs.rewards[0] if logs.rewards else None,
        "reward_mean_last": logs.rewards[-1] if logs.rewards else None,
        "wall_s": round(wall, 3),
    }
