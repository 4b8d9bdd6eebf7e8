"""What the simulator reads from a deployment's config, resolved in one place.

One config describes a deployment for `pivot-hpc run`, `pivot-hpc simulate` and
`pivot-hpc plan`. The simulator reads every setting a live run has from its live key, and
this is the only place it does: the simulated cluster (job/simulate.py), its bounds
(job/sim_bound.py) and the memory plan's simulator twin (planning/inputs.py) all cost the same
`SimSettings`. The `sim:` section adds only the synthetic workload (sim/config.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

from pivot_hpc.errors import ConfigError
from pivot_hpc.sim.catalog import MODELS, TrainingTerms, catalog_key
from pivot_hpc.sim.config import Workload

if TYPE_CHECKING:
    from pivot_hpc.job.config import Config
    from pivot_hpc.sim.workload import SimWorkload

# What the simulator assumes where a config names no GPU or model (CPU configs, tests):
# the paper's GPU and its model group 2. Named, so `simulate`'s header says what it costed.
DEFAULT_GPU = "h20"
DEFAULT_MODELS = {"rollout": "qwen2.5-7b", "reward": "qwen3-30b-a3b"}
# inference role → the `models` key of its model
MODEL_OF_ROLE = {"rollout": "policy", "reward": "genrm"}


@dataclass(frozen=True)
class SimSettings:
    """A config as the simulator costs it; each field says which live key it comes from."""

    hardware: str  # cluster.gpu (DEFAULT_GPU when unset)
    # per inference role: its model's catalog name, or the name of a model outside the
    # catalog that its profile describes (models.<policy|genrm>_catalog / _path)
    models: Mapping[str, str]
    profiles: Mapping[str, Path | None]  # engines.<role>.throughput_profile
    max_running: Mapping[str, int]  # engines.<role>.max_batch: running sequences per replica
    training_tp: int  # rl.trainer.tp
    terms: TrainingTerms  # rl.grpo.recompute_old_logprobs, rl.trainer.recompute, kl_coef
    workload: Workload  # sim.workload, cut at rl.max_response_tokens / genrm_max_tokens
    seed: int  # sim.seed


def catalog_name(cfg: Config, key: str) -> str | None:
    """The catalog model `models.<key>_catalog` or `<key>_path` names (a directory named
    after a variant of a catalog model maps to it), None when neither is set."""
    raw = cfg.models.catalog(key)
    return None if raw is None else catalog_key(raw) or raw


def model_problem(cfg: Config, role: str) -> str | None:
    """Why the simulator cannot cost `role`'s model (a name outside the catalog without a
    profile that describes it), or None."""
    name = catalog_name(cfg, MODEL_OF_ROLE[role])
    if name is None or name in MODELS or getattr(cfg.engines, role).throughput_profile:
        return None
    return (
        f"the catalog has no model {name!r} (known: {', '.join(sorted(MODELS))}); set "
        f"models.{MODEL_OF_ROLE[role]}_catalog to the catalog model it is, or profile it "
        f"(pivot-hpc profile), add a `model:` section to the file and set "
        f"engines.{role}.throughput_profile"
    )


def sim_settings(cfg: Config) -> SimSettings:
    """The simulator's reading of `cfg` (ConfigError when it cannot cost a model)."""
    for role in MODEL_OF_ROLE:
        problem = model_problem(cfg, role)
        if problem is not None:
            key = MODEL_OF_ROLE[role]
            where = (
                f"models.{key}_catalog"
                if getattr(cfg.models, f"{key}_catalog") is not None
                else f"models.{key}_path"
            )
            raise ConfigError(f"config key '{where}': {problem}")
    w = cfg.sim.workload
    workload = Workload(
        **{f.name: getattr(w, f.name) for f in fields(w)},
        response_cap=cfg.rl.max_response_tokens,
        judgement_cap=cfg.rl.reward.genrm_max_tokens,
        max_tool_calls=cfg.tools.max_turns - 1 if cfg.tools.enabled else 0,
        tool=cfg.tools.tools[0] if cfg.tools.tools else "",
        tool_output_cap=cfg.tools.max_tool_output_tokens,
    )
    return SimSettings(
        hardware=cfg.cluster.gpu or DEFAULT_GPU,
        models={
            role: catalog_name(cfg, key) or DEFAULT_MODELS[role]
            for role, key in MODEL_OF_ROLE.items()
        },
        profiles={r: getattr(cfg.engines, r).throughput_profile for r in MODEL_OF_ROLE},
        max_running={r: getattr(cfg.engines, r).max_batch for r in MODEL_OF_ROLE},
        training_tp=cfg.rl.trainer.tp,
        terms=TrainingTerms(
            recompute_old_logprobs=cfg.rl.grpo.recompute_old_logprobs,
            # full recompute re-runs each layer's forward in backward; selective recomputes
            # only core attention, which the catalog's step time does not resolve
            activation_recompute=cfg.rl.trainer.recompute == "full",
            reference_forward=cfg.rl.grpo.kl_coef > 0,
        ),
        workload=workload,
        seed=cfg.sim.seed,
    )


def sim_workload(cfg: Config) -> SimWorkload:
    """The seeded sample source the simulator draws `cfg`'s samples from."""
    from pivot_hpc.sim.workload import SimWorkload

    s = sim_settings(cfg)
    return SimWorkload(s.workload, s.seed)
