"""The run configuration: one dataclass per component, composed into `Config`.

Field docs are the user documentation of each key; docs/guide/configuration.md shows a full example.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pivot_hpc.agentic.config import ToolsConfig
from pivot_hpc.checkpoint.config import CheckpointConfig
from pivot_hpc.config.code_keys import refuse_code_args
from pivot_hpc.config.loader import (
    ConfigError,
    apply_overrides,
    fail,
    from_dict,
    load_yaml,
    migrate_moved,
    to_dict,
    validate_tree,
)
from pivot_hpc.coordinator.config import DeploymentConfig, LoopConfig
from pivot_hpc.engines.config import EnginesConfig
from pivot_hpc.gps.config import GPSConfig
from pivot_hpc.models.config import ModelsConfig
from pivot_hpc.planner.config import PlannerConfig
from pivot_hpc.rl.config import RLConfig
from pivot_hpc.scheduler.config import SchedulerConfig, ThroughputConfig
from pivot_hpc.sim.config import SimConfig
from pivot_hpc.tracking.config import TrackingConfig


@dataclass(kw_only=True)
class ClusterConfig:
    """The GPUs of one allocation (on CPU: worker device slots)."""

    nodes: int = 1  # nodes of the allocation (one MPI host rank each)
    gpus_per_node: int = 4  # GPUs per node (on CPU: worker processes per node)
    # The GPU model of the nodes (the catalog's names: `pivot-hpc calibration`). When set,
    # `pivot-hpc run`/`submit` check the memory plan (`pivot-hpc plan`) before launch and
    # refuse a config that does not fit; None = not checked (CPU runs). `pivot-hpc
    # simulate` costs this GPU (None: h20, the paper's).
    gpu: Literal["h20", "h100", "h200"] | None = None
    # Memory of one GPU, GiB, for a GPU the catalog does not list (or to override its
    # size); 0 = the catalog's size of cluster.gpu. Set either to check the plan.
    gpu_memory_gib: float = 0.0

    # Sanity caps, far above any machine (the largest nodes hold 8-16 GPUs; the simulator's
    # biggest runs are a few thousand GPUs): a typo like 10000000 fails here, in `config
    # show` and `simulate` too, instead of reaching `mpirun -n 10000001`.
    MAX_NODES = 100_000
    MAX_GPUS_PER_NODE = 64

    def validate(self, path: str) -> None:
        if self.nodes < 1:
            fail(f"{path}.nodes", self.nodes, "need at least 1 node")
        if not math.isfinite(self.gpu_memory_gib) or not 0 <= self.gpu_memory_gib <= 4096:
            fail(
                f"{path}.gpu_memory_gib",
                self.gpu_memory_gib,
                "GiB of one GPU: in [0, 4096] (0 = the catalog's size of cluster.gpu)",
            )
        if self.nodes > self.MAX_NODES:
            fail(f"{path}.nodes", self.nodes, f"at most {self.MAX_NODES} nodes")
        if self.gpus_per_node < 1:
            fail(f"{path}.gpus_per_node", self.gpus_per_node, "need at least 1 GPU per node")
        if self.gpus_per_node > self.MAX_GPUS_PER_NODE:
            fail(
                f"{path}.gpus_per_node",
                self.gpus_per_node,
                f"at most {self.MAX_GPUS_PER_NODE} GPUs per node",
            )

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def ranks_per_node(self) -> int:
        """MPI ranks per node: the host rank (GPS shard; the coordinator on node 0) first,
        then one worker per GPU."""
        return self.gpus_per_node + 1

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node


@dataclass(kw_only=True)
class InferenceRoleConfig:
    """Rollout or reward: replicas of `tp` GPUs on one node serving one model."""

    tp: int = 1  # tensor-parallel GPUs per replica (within one node)
    kv_capacity_tokens: int = 65536  # KV-cache capacity of one replica, in tokens
    gpus: list[int] | None = None  # GPUs this role may use; None = every GPU
    throughput: ThroughputConfig = field(default_factory=ThroughputConfig)

    def validate(self, path: str) -> None:
        if self.tp < 1:
            fail(f"{path}.tp", self.tp, "tensor parallel size must be >= 1")
        if self.kv_capacity_tokens < 1:
            fail(
                f"{path}.kv_capacity_tokens", self.kv_capacity_tokens, "capacity must be >= 1 token"
            )


@dataclass(kw_only=True)
class TrainingRoleConfig:
    """Training shifts as one unit: a fixed GPU set, whose process group is made once."""

    # explicit GPU ids; None = the last `num_gpus` GPUs (colocated mode trains on every GPU)
    gpus: list[int] | None = None
    num_gpus: int = 1  # how many GPUs train (when `gpus` is not given; not in colocated mode)

    def validate(self, path: str) -> None:
        if self.gpus is None and self.num_gpus < 1:
            fail(f"{path}.num_gpus", self.num_gpus, "training needs at least 1 GPU")
        if self.gpus is not None and len(set(self.gpus)) != len(self.gpus):
            fail(f"{path}.gpus", self.gpus, "GPU ids must be distinct")


@dataclass(kw_only=True)
class Config:
    """A whole run. Sections appear as top-level YAML keys."""

    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    rollout: InferenceRoleConfig = field(default_factory=InferenceRoleConfig)
    reward: InferenceRoleConfig = field(default_factory=InferenceRoleConfig)
    training: TrainingRoleConfig = field(default_factory=TrainingRoleConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    models: ModelsConfig = field(default_factory=ModelsConfig)  # tiny CPU policy + GenRM
    engines: EnginesConfig = field(default_factory=EnginesConfig)  # inference engine per role
    rl: RLConfig = field(default_factory=RLConfig)  # GRPO, trainer, rewards, datasets
    deployment: DeploymentConfig = field(default_factory=DeploymentConfig)
    loop: LoopConfig = field(default_factory=LoopConfig)
    sim: SimConfig = field(default_factory=SimConfig)  # the simulator's synthetic workload
    gps: GPSConfig = field(default_factory=GPSConfig)  # Global Parameter Storage (§5.1)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)  # docs/design.md §9
    tracking: TrackingConfig = field(default_factory=TrackingConfig)  # TensorBoard, W&B, MLflow
    # multi-turn rollouts with tool calls in a per-node sandbox (docs/guide/agentic.md)
    tools: ToolsConfig = field(default_factory=ToolsConfig)

    def validate(self, path: str) -> None:
        # the parts the cross-field rules below divide by, checked first (children are
        # validated after their parent)
        self.cluster.validate("cluster")
        for role in ("rollout", "reward"):  # a config may not name code (config/code_keys.py)
            refuse_code_args(f"engines.{role}", getattr(self.engines, role))
        for role in ("rollout", "reward"):
            if getattr(self, role).tp < 1:
                fail(f"{role}.tp", getattr(self, role).tp, "must be >= 1")
        n = self.cluster.total_gpus
        per_node = self.cluster.gpus_per_node
        for role in ("rollout", "reward"):
            rc: InferenceRoleConfig = getattr(self, role)
            if rc.tp > per_node or per_node % rc.tp:
                fail(
                    f"{role}.tp",
                    rc.tp,
                    f"a replica must fit on one node: tp must divide cluster.gpus_per_node={per_node}",
                )
            if rc.gpus is not None:
                _check_gpu_ids(f"{role}.gpus", rc.gpus, n)

        tr = self.training
        if tr.gpus is not None:
            _check_gpu_ids("training.gpus", tr.gpus, n)
        elif tr.num_gpus > n:
            fail("training.num_gpus", tr.num_gpus, f"the cluster has only {n} GPUs")

    def without_files(self) -> Config:
        """The same deployment with nothing that must exist on this machine: each model
        directory replaced by the catalog model it names (models.<role>_catalog), the
        datasets by the synthetic task. What `pivot-hpc simulate` reads (it costs models,
        it loads no weights and no data), so a deployment's config simulates anywhere."""
        m = self.models
        models = dataclasses.replace(
            m,
            policy_path=None,
            genrm_path=None,
            policy_catalog=m.catalog("policy"),
            genrm_catalog=m.catalog("genrm"),
        )
        data = dataclasses.replace(self.rl.data, train="synthetic", validation="synthetic")
        return dataclasses.replace(self, models=models, rl=dataclasses.replace(self.rl, data=data))

    def training_gpus(self) -> list[int]:
        """The GPUs training runs on — the one place that decides it per mode: colocated
        trains on every GPU (the paper's veRL baseline); the other modes on
        `training.gpus`, else the last `training.num_gpus` GPUs."""
        if self.deployment.mode == "colocated":
            return list(range(self.cluster.total_gpus))
        if self.training.gpus is not None:
            return sorted(self.training.gpus)
        n = self.cluster.total_gpus
        return list(range(n - self.training.num_gpus, n))


def _check_gpu_ids(path: str, gpus: list[int], total: int) -> None:
    bad = [g for g in gpus if not 0 <= g < total]
    if bad:
        raise ConfigError(
            f"config key '{path}' = {gpus!r}: GPU ids {bad} are outside the cluster "
            f"(valid ids 0..{total - 1}; see cluster.nodes and cluster.gpus_per_node)"
        )


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    files: bool = True,
) -> Config:
    """Load a YAML file (or the defaults), apply `a.b=c` overrides, validate once.
    `files=False`: the config as the simulator reads it, `Config.without_files` (model
    directories and datasets need not exist here)."""
    data = load_yaml(path) if path is not None else {}
    migrate_moved(data, Config)  # deprecated keys read at their new ones (overrides win)
    apply_overrides(data, overrides, root=Config)
    cfg = from_dict(Config, data)
    _tiny_defaults_with_a_real_model(data, cfg)
    if not files:
        cfg = cfg.without_files()
    validate_tree(cfg)
    return cfg


# The schema's defaults are the tiny job's (`pivot-hpc run` with no file runs it); for a
# model of one's own they would cut every response at 64 tokens without a word, and
# `simulate` would simulate that. So a config that names a model directory sets them.
TINY_DEFAULTS = {
    "rl.max_response_tokens": "the response length the run needs (the paper's groups: 15360)",
    "rl.reward.genrm_max_tokens": "the GenRM's judgement length (the paper's groups: 20480)",
    "rollout.kv_capacity_tokens": "one rollout replica's KV cache (`pivot-hpc plan` sizes it)",
    "reward.kv_capacity_tokens": "one GenRM replica's KV cache (`pivot-hpc plan` sizes it)",
}


def _tiny_defaults_with_a_real_model(data: dict, cfg: Config) -> None:
    named = [k for k in ("policy_path", "genrm_path") if getattr(cfg.models, k) is not None]
    if not named:
        return
    for dotted, what in TINY_DEFAULTS.items():
        node: object = data
        for part in dotted.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            default = from_dict(Config, {})
            for part in dotted.split("."):
                default = getattr(default, part)
            fail(
                dotted,
                default,
                f"not set, and models.{named[0]} names a model of your own: this default is "
                f"the tiny job's; set it to {what}",
            )


def default_dict() -> dict:
    """Every key at its default, as `to_dict` writes it (what a run that predates a key
    ran with: resume compares a checkpoint's config against it for keys it lacks)."""
    return to_dict(from_dict(Config, {}))
