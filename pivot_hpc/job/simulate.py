"""Build and run a simulated deployment: config → catalog costs → SimCluster + Coordinator.

The coordinator, schedulers and planner are the production objects; only the cluster is
simulated. Telemetry goes to <out>/telemetry/alloc-NNN.h5 in the same schema as live runs.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from pivot_hpc.config.loader import ConfigError
from pivot_hpc.coordinator.coordinator import Coordinator
from pivot_hpc.job import build as builder
from pivot_hpc.job.config import Config
from pivot_hpc.job.sim_backend import SimBackend
from pivot_hpc.progress import Progress
from pivot_hpc.sim.cluster import SimCluster
from pivot_hpc.telemetry.summary import (
    processed_rates,
    steady_made_rate,
    steady_state,
    steady_work_share,
    step_table,
    work_conserving_bound,
)


def build(
    cfg: Config, *, late_finish_share: float = 0.0
) -> tuple[Coordinator, SimCluster, dict[str, Any]]:
    """The simulated deployment of `cfg` (`late_finish_share`: see SimCluster; tests)."""
    job = builder.build(cfg, SimBackend(late_finish_share=late_finish_share))
    return job.coordinator, job.cluster, job.meta


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
    job = builder.build(cfg, SimBackend(out=out))
    coord, cluster, meta = job.coordinator, job.cluster, job.meta
    bar = Progress(
        cfg.loop.steps, f"simulate {meta['mode']}", unit="steps", enabled=progress, leave=True
    )
    wall = time.perf_counter()
    with bar:
        job.run(progress=bar.update if progress else None)
    wall = time.perf_counter() - wall
    logs = coord.stats
    tokens = coord.tokens_total
    steps = step_table(logs.steps)
    span = coord.last_step_end - coord.first_step_start
    tokens_per_s = tokens / span if span > 0 else 0.0
    steady = steady_state(steps, meta["staleness"])
    bound = work_conserving_bound(steps, meta.get, meta["gpus"])
    share = steady_work_share(steps, meta["staleness"], meta.get, meta["gpus"])
    return {
        "mode": meta["mode"],
        "strategy": meta["strategy"],
        "gpus": meta["gpus"],
        "steps": cfg.loop.steps,
        "sim_time_s": round(cluster.now(), 3),
        "tokens": int(tokens),
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_steady": steady,
        "tokens_per_s_bound": bound,
        "tokens_per_s_critical_path": meta["bound_critical_path"],
        "steady_work_share": share,
        # the work of the full pipeline as tokens/s at the run's mix of work
        "tokens_per_s_steady_made": steady_made_rate(share, bound),
        # §8.1's "total tokens processed": prompts and the GenRM's inputs counted too
        **processed_rates(steps, meta["staleness"], tokens_per_s, steady, bound),
        "end_to_end_over_bound": tokens_per_s / bound if bound else None,
        "shifts": logs.shifts_up,
        "shifts_per_step": logs.shifts_up / max(1, len(steps)),
        "plans_per_step": logs.plans / max(1, len(steps)),
        "training_prewarms": logs.training_prewarms,
        "plans": logs.plans,
        "migrated_sequences": logs.migrated,
        "preempted_sequences": cluster.preempted,
        # rollout context prefilled at admissions, and what the prefix cache of tool-calling
        # turns spared (scheduler.affinity_slack)
        "rollout_prefill_tokens": int(cluster.prefill_tokens["rollout"]),
        "rollout_prefix_hit_tokens": int(cluster.prefix_hit_tokens),
        "events": logs.events,
        # injected engine deaths (sim.failures): the same keys as `pivot-hpc report`
        "engine_failures": logs.engine_failures,
        "engine_restarts": logs.engine_restarts,
        "engines_excluded": sorted(logs.excluded),
        "sequences_recovered": logs.sequences_recovered,
        "tokens_regenerated": logs.tokens_regenerated,
        # deaths on training's GPUs (sim.failures.training) and the job stops they caused
        # (a live job's stop is a new allocation: no report of one run counts them)
        "training_deaths": cluster.training_deaths,
        "job_restarts": cluster.job_restarts,
        # tool-calling rollouts (tools.enabled): the same keys as `pivot-hpc report`
        **tool_summary(coord),
        "staleness_max": max(logs.staleness, default=0),
        "reward_mean_first": logs.rewards[0] if logs.rewards else None,
        "reward_mean_last": logs.rewards[-1] if logs.rewards else None,
        "wall_s": round(wall, 3),
    }


def tool_summary(coord: Coordinator) -> dict[str, Any]:
    """Tool calls answered, the share of trained trajectories with at least one, and the
    mean seconds a trajectory waited on a call (None: no tools, or none called)."""
    turns = coord.turns
    n = len(coord.stats.staleness)  # one entry per trained sample
    return {
        "tool_calls": turns.stats.results if turns is not None else 0,
        "tool_call_trajectory_share": coord.stats.trained_with_calls / n if n else None,
        "tool_wait_s_mean": turns.stats.wait_s_mean if turns is not None else None,
    }
