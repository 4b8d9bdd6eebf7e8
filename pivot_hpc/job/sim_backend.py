"""The simulator's backend (job/backend.py): catalog costs, the synthetic workload, the
SimCluster, and the telemetry header's bound rates. `build(cfg, SimBackend(...))` makes a
simulated job; `job/simulate.py` runs it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pivot_hpc.config import to_dict
from pivot_hpc.coordinator.hooks import Hooks
from pivot_hpc.job.backend import Costs
from pivot_hpc.job.config import Config
from pivot_hpc.job.sim_bound import batched_lengths, bound_rates, critical_path_rate
from pivot_hpc.job.sim_settings import sim_settings, sim_workload
from pivot_hpc.sim.catalog import (
    HARDWARE,
    MODELS,
    InferenceCosts,
    ModelSpec,
    from_profile,
    inference_costs,
    lookup,
    model_from_profile,
    training_costs,
    with_max_running,
)
from pivot_hpc.sim.cluster import SimCluster
from pivot_hpc.sim.workload import sim_rewarder


def role_model(cfg: Config, role: str) -> ModelSpec:
    """The catalog model of a role (models.<policy|genrm>_catalog, or the one its model
    directory names), or the model its profile file describes (job/sim_settings.py)."""
    s = sim_settings(cfg)
    name, profile = s.models[role], s.profiles[role]
    if name in MODELS or profile is None:
        return lookup(MODELS, name, "model")
    return model_from_profile(name, profile)


def role_costs(cfg: Config, models: dict[str, ModelSpec]) -> dict[str, InferenceCosts]:
    """Inference costs of both roles: catalog × calibration for `cluster.gpu`, with the
    running cap of `engines.<role>.max_batch`, or the engine profiles the config names."""
    s = sim_settings(cfg)
    hw = lookup(HARDWARE, s.hardware, "hardware")
    out = {}
    for role, profile in s.profiles.items():
        costs = inference_costs(models[role], hw, getattr(cfg, role).tp)
        if s.max_running[role] != costs.max_running:  # the calibration's cap otherwise
            costs = with_max_running(costs, s.max_running[role])
        if profile is not None:
            costs = from_profile(costs, profile)
        out[role] = costs
    return out


class SimBackend:
    """A simulated job. `out`: where telemetry goes (None: none is written); `hooks`: what
    runs around the loop (a test's stop deadline or step callback); `late_finish_share`:
    see SimCluster (tests)."""

    simulated = True

    def __init__(
        self,
        *,
        out: str | Path | None = None,
        hooks: Hooks | None = None,
        late_finish_share: float = 0.0,
    ) -> None:
        self.out = out
        self.step_hooks = hooks or Hooks()
        self.late_finish_share = late_finish_share
        self.inference: dict = {}
        self.training = None
        self.policy = self.judge = None

    def configure(self, cfg: Config) -> Config:
        return cfg

    def costs(self, cfg: Config) -> Costs:
        s = sim_settings(cfg)  # every live key the simulator reads, in one place
        hw = lookup(HARDWARE, s.hardware, "hardware")
        self.policy, self.judge = role_model(cfg, "rollout"), role_model(cfg, "reward")
        self.inference = role_costs(cfg, {"rollout": self.policy, "reward": self.judge})
        # (the training GPUs are the config's: `Config.training_gpus`, as `build` uses them)
        self.training = training_costs(
            self.policy,
            hw,
            len(cfg.training_gpus()),
            s.training_tp,
            s.terms,
            gpus_per_node=cfg.cluster.gpus_per_node,
        )
        return Costs(
            models={r: c.model for r, c in self.inference.items()},
            kv_capacity={r: c.kv_capacity_tokens for r, c in self.inference.items()},
            training_tp=s.training_tp,
            prefill_s_per_token={r: c.prefill_s_per_token for r, c in self.inference.items()},
            training_time=self.training,
        )

    def samples(self, cfg: Config):
        return sim_workload(cfg), sim_rewarder

    def cluster(self, cfg: Config, topology, source) -> SimCluster:
        return SimCluster(
            inference=self.inference,
            training=self.training,
            late_finish_share=self.late_finish_share,
            seed=cfg.sim.seed,
            failures=cfg.sim.failures,
            gpus=cfg.cluster.total_gpus,
            tool_latency=source.tool_latency,
            training_gpus=topology.training_gpus,
            restart_window_s=cfg.deployment.engine_restart_window_s,
        )

    def restore(self, cluster, rl) -> dict[str, Any]:
        return {}

    def meta(self, cfg: Config, rl, costs: Costs) -> dict[str, Any]:
        lengths = batched_lengths(cfg)  # the run's samples, drawn again for both bounds
        return {
            "seed": cfg.sim.seed,
            "hardware": lookup(HARDWARE, sim_settings(cfg).hardware, "hardware").name,
            "policy_model": self.policy.name,
            "reward_model": self.judge.name,
            "config": json.dumps(to_dict(cfg)),
            # For the work-conserving bound (telemetry/summary.py): what the simulated
            # engines charge per token of this run's samples at their best (job/sim_bound.py).
            **bound_rates(cfg, self.inference, self.training, lengths),
            "bound_critical_path": critical_path_rate(
                lengths, self.inference, self.training, rl.staleness, cfg.cluster.total_gpus
            ),
        }

    def telemetry(self, meta: dict[str, Any]):
        if self.out is None:
            return None
        from pivot_hpc.telemetry import TelemetryWriter

        return TelemetryWriter(self.out, meta=meta)

    def hooks(self, cfg: Config, cluster, writer) -> Hooks:
        return self.step_hooks

    def ready(self, coord) -> None:
        pass
