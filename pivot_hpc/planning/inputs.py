"""What the memory plan needs from a run config, gathered in one frozen record.

Two sources give the same record:

- `live_inputs(cfg)`: a config `pivot-hpc run` would launch. Models come from
  `models.policy_path` / `models.genrm_path` (matched by directory name against the
  simulator's catalog, sim/catalog.py, else from the directory's description,
  models/description.py), or from the tiny architectures of `models.policy.arch` /
  `models.genrm.arch`. The GPU is
  `cluster.gpu` (catalog) or `cluster.gpu_memory_gib`; neither = capacity unknown.
- `sim_inputs(cfg)`: the simulator's twin of the same config (`--source sim`): models,
  GPU, training tp and recompute as the simulator reads them (job/sim_settings.py); training as
  sim/catalog.py costs it (veRL-style: fused attention, sharded optimizer state, one
  sequence per micro-batch); engines as its calibration sizes them (SGLang at the
  calibrated HBM fraction).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from pivot_hpc.errors import PivotError
from pivot_hpc.job.config import Config
from pivot_hpc.models.config import ModelConfig
from pivot_hpc.models.description import ModelDescription, ModelDirError, description_of
from pivot_hpc.sim.catalog import HARDWARE, MODELS, ModelSpec, catalog_key

GIB = 1 << 30
# Catalog sizes ("96 GB") are binary (HBM stacks are powers of two), and the driver keeps
# about 0.5 % for itself: an H100 80GB shows 79.6 GiB to CUDA, an H200 140.4 GiB.
VISIBLE_FRACTION = 0.995


class PlanInputError(PivotError, ValueError):
    """The plan cannot tell what a config runs (an unknown model, say)."""


@dataclass(frozen=True)
class TrainInputs:
    """Training of the policy: one GPU of a `tp`-way tensor-parallel, dp-way data-parallel set."""

    model: ModelSpec
    tp: int
    gpus: int  # the training set (data parallel = gpus // tp)
    dtype: str  # parameter dtype: "bf16" (fp32 masters in the optimizer) or "fp32"
    micro_batch: int  # sequences per forward/backward, padded to the longest
    seq_len: int  # the longest sequence trained (prompt + response)
    attention: str  # "local" | "sdpa"
    recompute: str  # "none" | "selective" | "full"
    distributed_optimizer: bool

    @property
    def dp(self) -> int:
        return max(1, self.gpus // self.tp)


@dataclass(frozen=True)
class EngineInputs:
    """One inference role: replicas of `tp` GPUs serving `model`."""

    role: str  # "rollout" | "reward"
    model: ModelSpec
    tp: int
    engine: str  # "sglang" | "hf"
    bytes_per_param: int  # weights (and, for hf, KV) element size
    kv_capacity_tokens: int  # the role's KV cap (SGLang's max_total_tokens)
    max_batch: int  # running sequences at most
    max_seq_len: int  # the longest sequence the role must hold (prompt + generated)
    prefill_chunk_tokens: int
    mem_fraction_static: float | None  # SGLang; None = sized from the memory free at start
    memory_reserve_gib: float  # kept free when mem_fraction_static is None


@dataclass(frozen=True)
class PlanInputs:
    source: str  # "live" | "sim"
    gpu: str | None  # catalog hardware name, None if unknown
    capacity_gib: float | None  # memory of one GPU; None = not known (not checked)
    nodes: int
    gpus_per_node: int
    mode: str  # deployment mode
    rollout: EngineInputs
    reward: EngineInputs
    training: TrainInputs
    # inference roles whose engines may run on a GPU of the training set (the shift rows)
    shift_roles: tuple[str, ...]
    train_gpus_per_node: int  # training GPUs on the busiest node
    optimizer_offload: bool  # training shifts down (its optimizer state goes to host memory)
    elastic: bool  # elastic training: the optimizer state is also kept in GPS
    # GPS: (name, parameters, bytes per element, writable) of every model it holds
    gps_models: tuple[tuple[str, float, int, bool], ...]
    gps_budget_gib: float | None  # gps.host_budget_gib; None = half the node's RAM (unknown here)
    gps_group_size: int  # gps.group_size (0 = the smallest that fits)
    local_gb_s: float  # GPS link model: node-local and remote bandwidth, GB/s
    remote_gb_s: float
    host_read_gb_s: float | None  # all GPUs of a node reading together (calibration)


# ------------------------------------------------------------------------- models
def spec_from_arch(name: str, arch: ModelConfig) -> ModelSpec:
    """A tiny generated model (models.<role>.arch) as a catalog spec."""
    return ModelSpec(
        name,
        arch.num_layers,
        arch.hidden_size,
        arch.num_heads,
        arch.num_kv_heads,
        arch.hidden_size // arch.num_heads,
        arch.intermediate_size,
        arch.vocab_size,
        tied=arch.tie_word_embeddings,
    )


def spec_from_description(name: str, d: ModelDescription) -> tuple[ModelSpec, int | None]:
    """A model outside the catalog from its directory's description (config.json and
    safetensors headers; dense, MoE and hybrid-attention fields)."""
    experts = d.num_experts
    spec = ModelSpec(
        name,
        d.num_hidden_layers,
        d.hidden_size,
        d.num_attention_heads,
        d.num_key_value_heads,
        d.head_dim,
        0 if experts else int(d.intermediate_size or 0),
        d.vocab_size,
        tied=d.tie_word_embeddings,
        experts=experts,
        experts_active=d.num_experts_per_tok,
        expert_ffn=d.moe_intermediate_size or 0,
        kv_layers=d.kv_layers if d.layer_types else None,
    )
    return spec, d.max_position_embeddings


def resolve_model(
    path: Path | None, arch: ModelConfig, key: str, catalog: str | None = None
) -> tuple[ModelSpec, int | None]:
    """(spec, max positions or None) of one role's model; bf16 weights unless generated.
    `catalog`: models.<role>_catalog, the catalog model the directory holds."""
    if path is None:
        name = f"tiny {key.split('.')[-1].removesuffix('_path')}"
        return spec_from_arch(name, arch), arch.max_position_embeddings
    found = catalog if catalog in MODELS else catalog_key(Path(path).name)
    if found is not None:
        return MODELS[found], None
    try:
        return spec_from_description(Path(path).name, description_of(path))
    except ModelDirError as exc:
        raise PlanInputError(
            f"config key '{key}' = {str(path)!r}: the memory plan knows no model "
            f"{Path(path).name!r} (catalog: {', '.join(sorted(MODELS))}) and cannot describe "
            f"its directory ({exc}); name the directory after a catalog model or give a "
            "Hugging Face model directory"
        ) from None


# ------------------------------------------------------------------------ helpers
def _capacity(cfg: Config, gpu: str | None) -> float | None:
    if cfg.cluster.gpu_memory_gib > 0:
        return cfg.cluster.gpu_memory_gib
    if gpu is None:
        return None
    return HARDWARE[gpu].hbm_gb * VISIBLE_FRACTION


def _cap(n: int, limit: int | None) -> int:
    return n if limit is None else min(n, limit)


def _host_read(gpu: str | None) -> float | None:
    if gpu is None:
        return None
    from pivot_hpc.sim.calibration import calibration

    return calibration(gpu).shift.host_read_gb_s.value


def _shift_roles(cfg: Config, train: list[int]) -> tuple[str, ...]:
    """Inference roles whose engines may run on a training GPU (colocated and pivot shift
    training's GPUs to inference; the static modes never do)."""
    if cfg.deployment.mode not in ("colocated", "pivot"):
        return ()
    out = []
    for role in ("rollout", "reward"):
        allowed = getattr(cfg, role).gpus
        if allowed is None or set(allowed) & set(train):
            out.append(role)
    return tuple(out)


def _busiest_node(gpus: list[int], per_node: int) -> int:
    return max(Counter(g // per_node for g in gpus).values(), default=0)


def _gps_models(
    policy: ModelSpec, genrm: ModelSpec, nbytes: int, optimizer: bool, masters: bool
) -> tuple[tuple[str, float, int, bool], ...]:
    models = [("policy", policy.params, nbytes, True), ("genrm", genrm.params, nbytes, False)]
    if optimizer:  # runtime/training_world.py: fp32 Adam moments (and masters), writable
        kinds = ["exp_avg", "exp_avg_sq", *(["master"] if masters else [])]
        models += [(f"policy.{k}", policy.params, 4, True) for k in kinds]
    return tuple(models)


def _common(cfg: Config) -> dict:
    train = cfg.training_gpus()
    return {
        "nodes": cfg.cluster.nodes,
        "gpus_per_node": cfg.cluster.gpus_per_node,
        "mode": cfg.deployment.mode,
        "shift_roles": _shift_roles(cfg, train),
        "train_gpus_per_node": _busiest_node(train, cfg.cluster.gpus_per_node),
        "optimizer_offload": cfg.deployment.mode in ("colocated", "pivot"),
        "gps_budget_gib": cfg.gps.host_budget_gib or None,
        "gps_group_size": cfg.gps.group_size,
        "local_gb_s": cfg.gps.local_bandwidth_gbps,
        "remote_gb_s": cfg.gps.remote_bandwidth_gbps,
    }


# -------------------------------------------------------------------------- live
def live_inputs(cfg: Config) -> PlanInputs:
    """The plan of a config as `pivot-hpc run` would launch it."""
    gpu = cfg.cluster.gpu
    capacity = _capacity(cfg, gpu)
    ec = cfg.engines
    cuda = (
        capacity is not None
        or "sglang" in (ec.rollout.engine, ec.reward.engine)
        or "cuda" in (ec.rollout.device, ec.reward.device)
    )
    m = cfg.models
    policy, policy_pos = resolve_model(
        m.policy_path, m.policy.arch, "models.policy_path", m.policy_catalog
    )
    genrm, genrm_pos = resolve_model(
        m.genrm_path, m.genrm.arch, "models.genrm_path", m.genrm_catalog
    )
    generated = m.policy_path is None  # created models are fp32 (models/qwen2.py)
    nbytes = 4 if generated else 2
    rl = cfg.rl
    prompt = rl.data.max_prompt_tokens
    response = rl.max_response_tokens
    tr = rl.trainer

    def engine(role: str, spec: ModelSpec, max_pos: int | None, longest: int) -> EngineInputs:
        e = getattr(ec, role)
        seq = _cap(_cap(longest, e.max_seq_len), max_pos)
        return EngineInputs(
            role=role,
            model=spec,
            tp=getattr(cfg, role).tp,
            engine=e.engine,
            bytes_per_param=nbytes,
            kv_capacity_tokens=getattr(cfg, role).kv_capacity_tokens,
            max_batch=e.max_batch,
            max_seq_len=seq,
            prefill_chunk_tokens=e.prefill_chunk_tokens,
            mem_fraction_static=e.mem_fraction_static,
            memory_reserve_gib=e.memory_reserve_gib,
        )

    elastic = cfg.planner.elastic_training and cfg.deployment.mode == "pivot"
    dtype = tr.resolved_dtype(cuda=cuda)
    return PlanInputs(
        source="live",
        gpu=gpu,
        capacity_gib=capacity,
        rollout=engine("rollout", policy, policy_pos, prompt + response),
        # the GenRM reads the prompt and the response, then writes its judgement
        reward=engine("reward", genrm, genrm_pos, prompt + response + rl.reward.genrm_max_tokens),
        training=TrainInputs(
            model=policy,
            tp=tr.tp,
            gpus=len(cfg.training_gpus()),
            dtype=dtype,
            micro_batch=tr.micro_batch_size,
            seq_len=_cap(prompt + response, policy_pos),
            attention=tr.attention,
            recompute=tr.recompute,
            distributed_optimizer=tr.distributed_optimizer,
        ),
        elastic=elastic,
        # the optimizer state in GPS: for elastic joiners, or a restarted trainer child
        gps_models=_gps_models(
            policy,
            genrm,
            nbytes,
            elastic or tr.process == "child",
            masters=tr.dtype != "fp32",
        ),
        host_read_gb_s=_host_read(gpu),
        **_common(cfg),
    )


# --------------------------------------------------------------------------- sim
def sim_inputs(cfg: Config) -> PlanInputs:
    """The simulator's twin of a config, sized as the simulator costs it (job/sim_settings.py:
    the same models, GPU, training tp and recompute, caps and running cap)."""
    from pivot_hpc.job.sim_settings import sim_settings
    from pivot_hpc.sim.calibration import calibration
    from pivot_hpc.sim.catalog import CatalogError, inference_costs, model_from_profile

    s = sim_settings(cfg)
    gpu = s.hardware
    hw = HARDWARE[gpu]
    cal = calibration(gpu)
    usable = cal.engine.hbm_usable.value
    w = s.workload

    def model(role: str) -> ModelSpec:
        name, profile = s.models[role], s.profiles[role]
        return MODELS[name] if name in MODELS else model_from_profile(name, profile or "")

    policy, genrm = model("rollout"), model("reward")

    def engine(role: str, spec: ModelSpec, longest: int) -> EngineInputs:
        tp = getattr(cfg, role).tp
        try:
            kv = inference_costs(spec, hw, tp, cal).kv_capacity_tokens
        except CatalogError:
            kv = 1  # the weights alone do not fit: the plan says so
        return EngineInputs(
            role=role,
            model=spec,
            tp=tp,
            engine="sglang",
            bytes_per_param=2,
            kv_capacity_tokens=kv,
            max_batch=s.max_running[role],
            max_seq_len=longest,
            prefill_chunk_tokens=getattr(cfg.engines, role).prefill_chunk_tokens,
            mem_fraction_static=usable,
            memory_reserve_gib=0.0,
        )

    longest = w.prompt_len_max + w.response_cap
    return PlanInputs(
        source="sim",
        gpu=gpu,
        capacity_gib=_capacity(cfg, gpu),
        rollout=engine("rollout", policy, longest),
        reward=engine("reward", genrm, longest + w.judgement_cap),
        training=TrainInputs(
            model=policy,
            tp=s.training_tp,
            gpus=len(cfg.training_gpus()),
            dtype="bf16",
            micro_batch=1,
            seq_len=longest,
            attention="sdpa",
            recompute="full" if s.terms.activation_recompute else "none",
            distributed_optimizer=True,
        ),
        elastic=False,
        gps_models=_gps_models(policy, genrm, 2, False, masters=True),
        host_read_gb_s=_host_read(gpu),
        **_common(cfg),
    )


def heads_per_gpu(heads: int, tp: int) -> int:
    """Attention heads one GPU of a tp-way group computes."""
    return math.ceil(heads / tp)
