"""The one way to build a job from a config: `build(cfg, backend)` (docs/design.md §2: one
brain, two clusters). The simulator, the live run, the benches and the tests all call it.

What differs between a simulated and a live job comes from its backend (job/backend.py):
the cluster, the replicas' throughput models and KV capacities (catalog costs in the
simulator, engine profiles live), where samples come from and how they are rewarded,
resume, telemetry and the hooks around the loop. Everything the config decides — which
GPUs train in each mode, the mode object, the RL bookkeeping, scheduler options, the
telemetry header — is decided here once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pivot_hpc.coordinator.coordinator import Coordinator
from pivot_hpc.coordinator.monitor import MeasuredTrainingTime
from pivot_hpc.coordinator.rl_state import RLState, SampleSource
from pivot_hpc.job.backend import Backend, Costs, Job
from pivot_hpc.job.config import Config
from pivot_hpc.job.modes import make_mode
from pivot_hpc.planner import Topology
from pivot_hpc.planner.snapshot import INFERENCE_ROLES
from pivot_hpc.scheduler import BusyModel, ReplicaModel, ThroughputModel
from pivot_hpc.scheduler.admission import PipelineAdmission

if TYPE_CHECKING:
    pass


def strategy(cfg: Config) -> str:
    """The planner strategy that runs: only pivot mode plans; '' for the static modes."""
    return cfg.planner.strategy if cfg.deployment.mode == "pivot" else ""


def is_vanilla(cfg: Config) -> bool:
    """Vanilla PivotRL (§8.4): a busy/idle replica model and no migration."""
    return strategy(cfg) == "vanilla"


def elastic(cfg: Config) -> bool:
    """Elastic training runs where a planner decides: pivot mode."""
    return cfg.planner.elastic_training and cfg.deployment.mode == "pivot"


def topology(
    cfg: Config,
    *,
    models: Mapping[str, ReplicaModel],
    kv_capacity: Mapping[str, int],
    training_tp: int,
    prefill_s_per_token: Mapping[str, float] | None = None,
) -> Topology:
    """Replica slots, training GPUs (`Config.training_gpus`, per mode), its elastic
    extension slots (`training_tp` GPUs each) and τ_shift."""
    return Topology.build(
        num_gpus=cfg.cluster.total_gpus,
        gpus_per_node=cfg.cluster.gpus_per_node,
        tp={r: getattr(cfg, r).tp for r in INFERENCE_ROLES},
        kv_capacity=kv_capacity,
        models={
            r: BusyModel(max_running=getattr(m, "max_running", 0)) if is_vanilla(cfg) else m
            for r, m in models.items()
        },
        training_gpus=cfg.training_gpus(),
        allowed={r: getattr(cfg, r).gpus for r in INFERENCE_ROLES},
        shift_time=cfg.planner.shift_time_s,
        training_tp=training_tp,
        elastic=elastic(cfg),
        prefill_s_per_token=prefill_s_per_token,
    )


def configured_topology(cfg: Config) -> Topology:
    """The topology `build` makes for `cfg` with its own constants (`pivot-hpc trace`)."""
    c = configured_costs(cfg)
    return topology(
        cfg,
        models=c.models,
        kv_capacity=c.kv_capacity,
        training_tp=c.training_tp,
        prefill_s_per_token=c.prefill_s_per_token,
    )


def _constants(cfg: Config, role: str) -> tuple[float, float, float, float]:
    t = getattr(cfg, role).throughput
    return t.A, t.B, t.C, t.D


def rl_state(cfg: Config, source: SampleSource) -> RLState:
    return RLState(
        steps=cfg.loop.steps,
        batch_prompts=cfg.loop.batch_prompts,
        samples_per_prompt=cfg.loop.samples_per_prompt,
        staleness=cfg.deployment.effective_staleness(),
        dynamic_sampling=cfg.rl.grpo.dynamic_sampling,
        resample_limit=cfg.rl.grpo.dynamic_sampling_max_batches * cfg.loop.batch_prompts,
        source=source,
    )


def affinity_wait(cfg: Config, backend: Backend) -> float:
    """`scheduler.affinity_wait_s`, or 0 live on the hf engine: it caches no prefix, so a
    turn waiting for its last replica would only be delayed."""
    if not backend.simulated and cfg.engines.rollout.engine == "hf":
        return 0.0
    return cfg.scheduler.affinity_wait_s


def build(cfg: Config, backend: Backend) -> Job:
    """The job of `cfg` on `backend`, ready to run: nothing is set on it afterwards."""
    cfg = backend.configure(cfg)
    costs = backend.costs(cfg)
    topo = topology(
        cfg,
        models=costs.models,
        kv_capacity=costs.kv_capacity,
        training_tp=costs.training_tp,
        prefill_s_per_token=costs.prefill_s_per_token,
    )
    source, rewarder = backend.samples(cfg)
    cluster = backend.cluster(cfg, topo, source)
    rl = rl_state(cfg, source)
    resumed = backend.restore(cluster, rl)  # before the header: it records the resume
    meta = run_meta(cfg, rl, simulated=backend.simulated, **backend.meta(cfg, rl, costs), **resumed)
    writer = backend.telemetry(meta)
    hooks = backend.hooks(cfg, cluster, writer)
    coord = Coordinator(
        cluster=cluster,
        topology=topo,
        rl=rl,
        mode=make_mode(cfg, list(topo.training_gpus)),
        capacity={r: topo.roles[r].kv_capacity for r in INFERENCE_ROLES},
        rewarder=rewarder,
        telemetry=writer,
        hooks=hooks,
        tick_s=cfg.loop.monitor_interval_s,
        priority=cfg.scheduler.priority,
        migration=cfg.scheduler.migration and not is_vanilla(cfg),
        refit_shift_time=cfg.planner.refit_shift_time,
        refit_throughput=cfg.planner.refit_throughput and not is_vanilla(cfg),
        training_time=costs.training_time or MeasuredTrainingTime(),
        strategy=strategy(cfg),
        admission=PipelineAdmission(rl.staleness, rl.batch_size)
        if cfg.scheduler.admission == "pipeline"
        else None,
        rebalance=cfg.scheduler.rebalance,
        restart_window_s=cfg.deployment.engine_restart_window_s,
        tool_timeout_s=cfg.tools.call_timeout_s if cfg.tools.enabled else None,
        horizon_s=cfg.planner.horizon_s,
        affinity_slack=cfg.scheduler.affinity_slack,
        affinity_wait_s=affinity_wait(cfg, backend),
    )
    backend.ready(coord)
    return Job(
        cfg=cfg, coordinator=coord, cluster=cluster, meta=meta, telemetry=writer, hooks=hooks
    )


def configured_costs(cfg: Config) -> Costs:
    """The config's own throughput constants, prefill costs and KV capacities (the live run,
    after engine profiles filled them in; the simulator uses catalog costs). A role whose
    `throughput.prefill_s_per_token` is unset (a profile that did not measure it) plans
    its prefills as free, as before."""
    prefill = {
        r: p
        for r in INFERENCE_ROLES
        if (p := getattr(cfg, r).throughput.prefill_s_per_token) is not None
    }
    return Costs(
        models={r: ThroughputModel(*_constants(cfg, r)) for r in INFERENCE_ROLES},
        kv_capacity={r: getattr(cfg, r).kv_capacity_tokens for r in INFERENCE_ROLES},
        training_tp=cfg.rl.trainer.tp,
        prefill_s_per_token=prefill or None,
    )


def run_meta(cfg: Config, rl: RLState, *, simulated: bool, **extra: Any) -> dict[str, Any]:
    """The telemetry file's header attributes that both kinds of run share."""
    return {
        "mode": cfg.deployment.mode,
        "strategy": strategy(cfg),
        "gpus": cfg.cluster.total_gpus,
        "simulated": simulated,
        "horizon_s": cfg.planner.horizon_s,
        "staleness": rl.staleness,
        "elastic_training": elastic(cfg),
        **extra,
    }
