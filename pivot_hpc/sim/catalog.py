"""Hardware and model catalog for the simulator, and the costs derived from them.

Costs are model sizes (published configs, below) times per-hardware calibration factors
(`sim/calibration.py`, every number with its source). Nothing here is fitted to the
paper's end-to-end results.

Hardware: H20 96 GB (4.0 TB/s, 148 TFLOP/s dense bf16), H100 SXM 80 GB (3.35 TB/s,
989 TFLOP/s), H200 SXM 141 GB (4.8 TB/s, 989 TFLOP/s): NVIDIA datasheets. PCIe 63 GB/s and
InfiniBand 50 GB/s as stated in the paper (§5.1, §8.1).

Models: the published HuggingFace configs (layers, hidden, heads, KV heads, head dim, FFN
sizes, vocab, experts) of Qwen2.5-1.5B/7B/32B/72B, Qwen3-8B/32B, GLM-Z1-9B-0414 and
Qwen3-30B-A3B. Qwen3.5-122B-A10B: 122B total from its model card; the layout is an
assumption, stated as such: the Qwen3-Next/Qwen3.5 hybrid stack (48 layers, hidden 3072,
every 4th layer full attention with 2 KV heads of dim 256, the other 36 Gated DeltaNet
layers with an fp32 recurrent state of 32 value heads × 128 × 128 per sequence), 256
experts of width 1024 with 8 routed per token (122B total, 9.7B active).

Decode model (paper App. A, per replica of `tp` GPUs), see `EngineCalibration`:
    L(n, tok) = A·tok + max(B(n), C·n) + S·n + D
- KV cache per GPU: a GPU holds max(1, kv_heads/tp) KV heads — when kv_heads < tp the
  heads are replicated, not split.
- MoE: B(n) reads the dense weights plus the experts that n tokens touch, expected
  E·(1 − (1 − k/E)^n) per layer under uniform routing.
- Hybrid (DeltaNet) models: every running sequence reads and writes its recurrent state
  each step (S), and the engine reserves that state for `max_running_requests` sequences.
The scheduler and planner see A, B, C, D fitted to L over the engine's operating range, as
`pivot-hpc profile` fits them on a real engine; the simulated replicas follow L itself.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pivot_hpc.errors import PivotError, short_repr
from pivot_hpc.scheduler import ThroughputModel
from pivot_hpc.scheduler.throughput import fit_throughput_model
from pivot_hpc.sim.calibration import Calibration, calibration

BF16 = 2
FP32 = 4
OPTIMIZER_BYTES_PER_PARAM = 12  # fp32 master weights + Adam m and v (distributed optimizer)


class CatalogError(PivotError, ValueError):
    pass


@dataclass(frozen=True)
class Hardware:
    name: str
    hbm_gb: float
    hbm_tb_s: float
    bf16_tflops: float
    pcie_gb_s: float
    ib_gb_s: float
    nvlink_gb_s: float


HARDWARE: dict[str, Hardware] = {
    "h20": Hardware("H20", 96, 4.0, 148, 63, 50, 900),
    "h100": Hardware("H100-SXM", 80, 3.35, 989, 63, 50, 900),
    "h200": Hardware("H200-SXM", 141, 4.8, 989, 63, 50, 900),
}


def touched_fraction(n: float, experts: int, active: int) -> float:
    """Expected fraction of E experts that n tokens, each routed to k of them uniformly,
    touch: 1 − (1 − k/E)^n."""
    return 1.0 - (1.0 - active / experts) ** n


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int  # dense FFN width (0 for pure MoE)
    vocab: int
    tied: bool = False
    experts: int = 0
    experts_active: int = 0
    expert_ffn: int = 0
    kv_layers: int | None = None  # layers holding a per-token KV cache (hybrid models)
    state_layers: int = 0  # layers with a per-sequence recurrent state (Gated DeltaNet)
    state_bytes_per_layer: float = 0.0  # that state per sequence, all heads (fp32)
    total_override: float | None = None  # published total where the config is not modelled

    def _attn(self) -> float:
        h, d = self.hidden, self.head_dim
        return h * self.heads * d * 2 + h * self.kv_heads * d * 2

    def _embed(self) -> float:
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def expert_params(self) -> float:
        """Parameters of all routed experts (0 for dense models)."""
        return self.layers * self.experts * 3 * self.hidden * self.expert_ffn

    @property
    def params(self) -> float:
        if self.total_override:
            return self.total_override
        per_layer = self._attn() + 3 * self.hidden * self.ffn
        return self._embed() + self.layers * per_layer + self.expert_params

    @property
    def dense_params(self) -> float:
        """Parameters every token uses (everything but the routed experts)."""
        return self.params - self.expert_params

    @property
    def active_params(self) -> float:
        if not self.experts:
            return self.params
        return self.dense_params + self.expert_params * self.experts_active / self.experts

    @property
    def weight_bytes(self) -> float:
        return self.params * BF16

    @property
    def kv_attention_layers(self) -> int:
        return self.kv_layers if self.kv_layers is not None else self.layers

    @property
    def kv_bytes_per_token(self) -> float:
        """KV bytes of one token on one replica when every KV head is stored once."""
        return 2 * self.kv_attention_layers * self.kv_heads * self.head_dim * BF16

    def kv_bytes_per_token_per_gpu(self, tp: int) -> float:
        """Each GPU stores max(1, kv_heads/tp) heads: replicated when kv_heads < tp."""
        heads = max(1, math.ceil(self.kv_heads / tp))
        return 2 * self.kv_attention_layers * heads * self.head_dim * BF16

    @property
    def state_bytes_per_seq(self) -> float:
        return self.state_layers * self.state_bytes_per_layer

    def expected_experts(self, n: float) -> float:
        """Expected distinct experts per layer touched by n tokens (uniform top-k routing)."""
        if not self.experts or n <= 0:
            return 0.0
        return self.experts * touched_fraction(n, self.experts, self.experts_active)

    def weight_bytes_read(self, n: float) -> float:
        """Weight bytes one decode step of n sequences streams (whole replica)."""
        if not self.experts:
            return self.weight_bytes
        touched = self.expected_experts(n) / self.experts
        return (self.dense_params + self.expert_params * touched) * BF16


MODELS: dict[str, ModelSpec] = {
    "qwen2.5-1.5b": ModelSpec("Qwen2.5-1.5B", 28, 1536, 12, 2, 128, 8960, 151936, tied=True),
    "qwen2.5-7b": ModelSpec("Qwen2.5-7B", 28, 3584, 28, 4, 128, 18944, 152064),
    "qwen2.5-32b": ModelSpec("Qwen2.5-32B", 64, 5120, 40, 8, 128, 27648, 152064),
    "qwen2.5-72b": ModelSpec("Qwen2.5-72B", 80, 8192, 64, 8, 128, 29568, 152064),
    "qwen3-8b": ModelSpec("Qwen3-8B", 36, 4096, 32, 8, 128, 12288, 151936),
    "qwen3-32b": ModelSpec("Qwen3-32B", 64, 5120, 64, 8, 128, 25600, 151936),
    "glm-z1-9b": ModelSpec("GLM-Z1-9B", 40, 4096, 32, 2, 128, 13696, 151552),
    "qwen3-30b-a3b": ModelSpec(
        "Qwen3-30B-A3B",
        48,
        2048,
        32,
        4,
        128,
        0,
        151936,
        experts=128,
        experts_active=8,
        expert_ffn=768,
    ),
    "qwen3.5-122b-a10b": ModelSpec(
        "Qwen3.5-122B-A10B",
        48,
        3072,
        32,
        2,
        256,
        0,
        248320,
        experts=256,
        experts_active=8,
        expert_ffn=1024,
        kv_layers=12,
        state_layers=36,
        state_bytes_per_layer=32 * 128 * 128 * FP32,
        total_override=122e9,
    ),
}


def lookup(table: dict, name: str, what: str):
    try:
        return table[name]
    except KeyError:
        raise CatalogError(f"unknown {what} {name!r}; known: {', '.join(sorted(table))}") from None


# ------------------------------------------------------------------------ inference
@dataclass(frozen=True)
class DecodeCost:
    """The simulated engine's decode iteration, L(n, tok) = A·tok + fixed(n)."""

    A: float
    B_dense: float  # dense-weight streaming time
    B_experts: float  # streaming time of all routed experts (0 for dense models)
    experts: int
    experts_active: int
    C: float
    S: float  # recurrent-state time per running sequence
    D: float

    def B(self, n: float) -> float:
        if not self.experts:
            return self.B_dense
        touched = touched_fraction(max(n, 1.0), self.experts, self.experts_active)
        return self.B_dense + self.B_experts * touched

    def fixed(self, n: float) -> float:
        """The part of a step that does not depend on the tokens held."""
        b = self.B(n)
        c = self.C * n
        return (b if b > c else c) + self.S * n + self.D

    def latency(self, n: float, tok: float) -> float:
        return self.A * tok + self.fixed(n)


@dataclass(frozen=True)
class InferenceCosts:
    """Everything the simulator needs about one (model, hardware, tp) inference replica."""

    model: ThroughputModel  # what the scheduler and planner see (fitted to `decode`)
    kv_capacity_tokens: int
    prefill_s_per_token: float
    shift_up_s: dict[str, float]  # phase -> seconds
    shift_down_s: dict[str, float]
    weight_update_s: float  # re-read weights from GPS (new policy version)
    decode: DecodeCost | None = None  # the engine itself (None: follow `model` exactly)
    max_running: int = 0  # running-request cap of one replica (0: none)
    sources: dict[str, str] = field(default_factory=dict)
    tp: int = 1  # GPUs of one replica (the simulator places its GPS reads on their node)

    def latency(self, n: float, tok: float) -> float:
        if self.decode is not None:
            return self.decode.latency(n, tok)
        return self.model.latency(int(n), int(tok))

    def fixed(self, n: float) -> float:
        """Step time at zero tokens held (the simulator's per-membership constant)."""
        if self.decode is not None:
            return self.decode.fixed(n)
        return self.model.latency(n, 0)

    @property
    def A(self) -> float:
        return self.decode.A if self.decode is not None else self.model.A

    def best_rate(self, context: float = 2000.0) -> float:
        """Highest tokens/s of one replica at a `context`-token mean context (KV and
        running caps respected): the role's best operating point for bounds."""
        cap_n = max(1, self.kv_capacity_tokens // max(1, int(context)))
        if self.max_running:
            cap_n = min(cap_n, self.max_running)
        ns = np.unique(np.clip(np.geomspace(1, cap_n, 48).astype(int), 1, cap_n))
        return max(n / self.latency(n, n * context) for n in ns)


def _fit_grid(decode: DecodeCost, max_n: int, kv_capacity: int) -> ThroughputModel:
    """A, B, C, D as a profile of the engine would fit them (n up to the cap, contexts from
    a short prompt to the response cap)."""
    ns = np.unique(np.geomspace(1, max(2, max_n), 12).astype(int))
    rows = []
    for n in ns:
        for ctx in (300, 1000, 2000, 4000, 8000, 15000):
            tok = n * ctx
            if tok <= kv_capacity:
                rows.append((decode.latency(n, tok), n, tok))
    if len(rows) < 4:
        rows = [(decode.latency(n, n * 300), n, n * 300) for n in (1, 2, 3, 4)]
    lat, n, tok = (np.array(c, dtype=float) for c in zip(*rows, strict=True))
    return fit_throughput_model(lat, n, tok).model


def inference_costs(
    model: ModelSpec, hw: Hardware, tp: int, cal: Calibration | None = None
) -> InferenceCosts:
    cal = cal or calibration(_hw_key(hw))
    e, s = cal.engine, cal.shift
    bw = hw.hbm_tb_s * 1e12  # per GPU
    flops = hw.bf16_tflops * 1e12
    w_bw = bw * e.eta_weights.value
    expert_bytes = model.expert_params * BF16
    allreduce = 2 * model.layers * e.allreduce_s.value if tp > 1 else 0.0
    decode = DecodeCost(
        A=model.kv_bytes_per_token_per_gpu(tp) / (bw * e.eta_attention.value),
        B_dense=(model.weight_bytes - expert_bytes) / tp / w_bw,
        B_experts=expert_bytes / tp / w_bw,
        experts=model.experts,
        experts_active=model.experts_active,
        C=2 * model.active_params / (tp * flops * e.eta_decode_compute.value),
        S=2 * model.state_bytes_per_seq / tp / w_bw,
        D=e.step_overhead_s.value + allreduce,
    )
    max_running = int(e.max_running_requests.value)
    usable = hw.hbm_gb * 1e9 * e.hbm_usable.value
    state = model.state_bytes_per_seq / tp * max_running  # reserved state pool
    free = usable - model.weight_bytes / tp - state
    if free <= 0:
        raise CatalogError(
            f"{model.name} ({model.weight_bytes / 1e9:.0f} GB of weights) does not fit on "
            f"{tp}×{hw.name}: raise its tp"
        )
    kv_capacity = int(free / model.kv_bytes_per_token_per_gpu(tp))
    read = model.weight_bytes / (s.host_read_gb_s.value * 1e9)
    fitted = dataclasses.replace(
        _fit_grid(decode, max_running, kv_capacity), max_running=max_running
    )
    return InferenceCosts(
        model=fitted,
        kv_capacity_tokens=kv_capacity,
        prefill_s_per_token=2 * model.active_params / (tp * flops * e.eta_prefill.value),
        shift_up_s={"read_s": read, "reload_s": s.engine_start_s.value},
        shift_down_s={"discard_s": s.engine_stop_s.value},
        weight_update_s=read,
        decode=decode,
        max_running=max_running,
        sources={name: src for name, _, src in cal.rows()},
        tp=tp,
    )


def read_profile(path: str | Path) -> dict:
    """A `pivot-hpc profile` YAML file as a mapping ({} for an empty file)."""
    from pivot_hpc.config.loader import ConfigError, load_yaml_text, read_yaml_file

    try:  # the project's one YAML reader: no aliases, bounded size, nesting and numbers
        source = f"profile {str(path)!r}"
        doc = load_yaml_text(read_yaml_file(path, source), source) or {}
    except ConfigError as exc:
        raise CatalogError(str(exc)) from None
    if not isinstance(doc, dict):
        raise CatalogError(f"{path}: a profile is a mapping; write one with `pivot-hpc profile`")
    return doc


def with_max_running(costs: InferenceCosts, max_running: int) -> InferenceCosts:
    """The same engine with another running-request cap."""
    return dataclasses.replace(
        costs,
        model=dataclasses.replace(costs.model, max_running=max_running),
        max_running=max_running,
        sources={
            **costs.sources,
            "engine.max_running_requests": "config: engines.<role>.max_batch",
        },
    )


def from_profile(costs: InferenceCosts, path: str | Path) -> InferenceCosts:
    """The user's own engine profile (`pivot-hpc profile` YAML): its A-D drive both the
    simulated engine and the scheduler; `kv_capacity_tokens` in the file replaces the
    catalog's capacity, and `prefill_s_per_token` (the measured prefill slope) the catalog's
    prefill cost. That slope is one engine's, a replica of `tp` GPUs, like A-D and like the
    catalog's prefill: taken as it is, not rescaled. A file without the key (or with null:
    a profile from before it) keeps the catalog's prefill. Shift costs stay the catalog's."""
    doc = read_profile(path)
    try:
        t = doc["throughput"]
        model = ThroughputModel(
            A=float(t["A"]),
            B=float(t["B"]),
            C=float(t["C"]),
            D=float(t["D"]),
            max_running=costs.max_running,
        )
        kv = int(doc.get("kv_capacity_tokens", costs.kv_capacity_tokens))
    except (TypeError, KeyError, ValueError) as exc:
        raise CatalogError(
            f"{path}: not a throughput profile ({exc}); write one with `pivot-hpc profile`"
        ) from None
    prefill = _profile_prefill(doc, path)
    src = f"profile: {path}"
    sources = {**costs.sources, "A": src, "B": src, "C": src, "D": src}
    if "kv_capacity_tokens" in doc:
        sources["kv_capacity_tokens"] = src
    if prefill is not None:
        sources["prefill_s_per_token"] = src
    return dataclasses.replace(
        costs,
        model=model,
        decode=None,
        kv_capacity_tokens=kv,
        prefill_s_per_token=costs.prefill_s_per_token if prefill is None else prefill,
        sources=sources,
    )


def _profile_prefill(doc: dict, path: str | Path) -> float | None:
    """A profile's `prefill_s_per_token`: None where it has none (or null), else a finite
    number >= 0, or one CatalogError line naming the file and the key."""
    p = doc.get("prefill_s_per_token")
    if p is None:
        return None
    try:
        if isinstance(p, bool):  # YAML true/false are ints to float(): not a slope
            raise TypeError
        value = float(p)  # a string too: YAML 1.1 reads a bare 1e-6 as one
    except (TypeError, ValueError, OverflowError):
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise CatalogError(
            f"{path}: prefill_s_per_token must be a finite number >= 0 (or null), not "
            f"{short_repr(p)}; write the file with `pivot-hpc profile`"
        )
    return value


PROFILE_MODEL_KEYS = ("params", "layers", "hidden", "heads", "kv_heads", "head_dim")


def model_from_profile(name: str, path: str | Path) -> ModelSpec:
    """A model that is not in the catalog, described by the `model:` section of a profile
    file (params, layers, hidden, heads, kv_heads, head_dim: the model's config.json)."""
    m = read_profile(path).get("model")
    missing = [k for k in PROFILE_MODEL_KEYS if not isinstance(m, dict) or k not in m]
    if missing:
        raise CatalogError(
            f"{path}: model {name!r} is not in the catalog, so the profile needs a `model:` "
            f"section with {', '.join(PROFILE_MODEL_KEYS)} (missing: {', '.join(missing)})"
        )
    try:
        return ModelSpec(
            name,
            int(m["layers"]),
            int(m["hidden"]),
            int(m["heads"]),
            int(m["kv_heads"]),
            int(m["head_dim"]),
            0,
            0,
            total_override=float(m["params"]),
        )
    except (TypeError, ValueError) as exc:
        raise CatalogError(f"{path}: bad `model:` section ({exc})") from None


def _hw_key(hw: Hardware) -> str:
    return next(k for k, v in HARDWARE.items() if v is hw or v == hw)


# ------------------------------------------------------------------------- training
@dataclass(frozen=True)
class TrainingTerms:
    """Which passes a training step runs (paper §8.1 baselines run on veRL)."""

    recompute_old_logprobs: bool = False  # an old-policy forward before the update
    activation_recompute: bool = True  # full recompute: one more forward in backward
    reference_forward: bool = False  # KL against a frozen reference policy


@dataclass(frozen=True)
class TrainingCosts:
    """A training step's seconds and training's shift phases.

    A step at g GPUs (data parallel over g/tp replicas): the FLOPs of every pass at the
    achieved per-GPU rate, plus the gradient all-reduce across replicas (ring: 2(d−1)/d of
    the bf16 gradient shard per GPU, over NVLink within a node, else InfiniBand; not
    overlapped with the backward pass, which veRL's default does not do either), plus the
    GPS Write of the new policy. It is also the planner's training-time model in the
    simulator (the `TrainingTime` protocol: exact, nothing to observe), as the fitted A–D
    are for inference.
    """

    gpus: int  # the training set (every step runs at least on these)
    tp: int
    flops_per_token: float  # linear-layer FLOPs of every pass per trained token
    attn_flops_per_token2: float  # causal-attention FLOPs per (sequence length)² of every pass
    flops_per_s_per_gpu: float  # one GPU's achieved FLOP/s (peak × MFU)
    grad_bytes_per_gpu: float  # bf16 gradient shard one GPU all-reduces
    gpus_per_node: int
    link_gb_s: tuple[float, float]  # all-reduce bandwidth: (within a node, across nodes)
    shift_up_s: dict[str, float]
    shift_down_s: dict[str, float]
    # an elastic extension (one data-parallel replica beyond the set): up = GPS Read of
    # the parameters and of its optimizer shard, after the set wrote that state; down =
    # discard (the set keeps the state)
    extension_up_s: dict[str, float]
    extension_down_s: dict[str, float]
    publish_s: float  # GPS Write of the new policy (not overlapped in the simulator)

    @property
    def flops_per_s(self) -> float:
        """The training set's achieved FLOP/s."""
        return self.flops_per_s_per_gpu * self.gpus

    def allreduce_s(self, gpus: int) -> float:
        dp = max(1, gpus // self.tp)
        if dp == 1:
            return 0.0
        within, across = self.link_gb_s
        bw = (within if gpus <= self.gpus_per_node else across) * 1e9
        return 2.0 * (dp - 1) / dp * self.grad_bytes_per_gpu / bw

    def step_time(self, lengths: Sequence[int] | np.ndarray, gpus: int | None = None) -> float:
        """Seconds for one step over sequences of these lengths (prompt + response) on
        `gpus` GPUs (default: the training set)."""
        g = self.gpus if gpus is None else gpus
        flops = self.flops(lengths)
        return flops / (self.flops_per_s_per_gpu * g) + self.allreduce_s(g) + self.publish_s

    def flops(self, lengths: Sequence[int] | np.ndarray) -> float:
        """FLOPs of every pass over sequences of these lengths (prompt + response)."""
        x = np.asarray(lengths, dtype=float)
        return float(self.flops_per_token * x.sum() + self.attn_flops_per_token2 * (x * x).sum())

    # the coordinator's TrainingTime protocol (coordinator/monitor.py)
    def ready(self) -> bool:
        return True

    def observe(self, lengths: Sequence[int], gpus: int, seconds: float) -> None:
        pass  # the simulated step follows this model exactly


def _mfu(model: ModelSpec, cal: Calibration) -> float:
    t = cal.training
    if model.experts:
        return t.mfu_moe.value
    return (t.mfu_dense_small if model.params < 10e9 else t.mfu_dense_large).value


def training_costs(
    model: ModelSpec,
    hw: Hardware,
    gpus: int,
    tp: int,
    terms: TrainingTerms | None = None,
    gpus_per_node: int = 8,
    cal: Calibration | None = None,
) -> TrainingCosts:
    if gpus < 1:
        raise CatalogError("training needs at least one GPU")
    cal = cal or calibration(_hw_key(hw))
    terms = terms or TrainingTerms()
    s = cal.shift
    passes = 3.0  # forward + backward (2×)
    if terms.activation_recompute:
        passes += 1.0
    if terms.recompute_old_logprobs:
        passes += 1.0
    if terms.reference_forward:
        passes += 1.0
    q_dim = model.heads * model.head_dim
    # causal attention forward: QK^T and AV, 2·L²·q_dim FLOPs per attention layer in all
    attn = 2.0 * model.kv_attention_layers * q_dim
    rate = hw.bf16_tflops * 1e12 * _mfu(model, cal)
    on_node = min(gpus, gpus_per_node)
    tp = max(1, min(tp, gpus))
    weights_node = model.weight_bytes / tp * on_node  # each GPU reads its TP shard
    optimizer_node = model.params * OPTIMIZER_BYTES_PER_PARAM * on_node / gpus
    host = s.train_host_gb_s.value * 1e9
    pcie, ib = hw.pcie_gb_s * 1e9, hw.ib_gb_s * 1e9
    write = max(model.weight_bytes / tp / pcie, model.weight_bytes / ib)
    # an extension replica (tp GPUs): its weight shards, then its optimizer shard at the
    # set's layout, which the set first writes to GPS (the set's own share of a node)
    ext_weights = model.weight_bytes
    ext_optimizer = model.params * OPTIMIZER_BYTES_PER_PARAM * tp / gpus
    return TrainingCosts(
        gpus=gpus,
        tp=tp,
        flops_per_token=2.0 * model.active_params * passes,
        attn_flops_per_token2=attn * passes,
        flops_per_s_per_gpu=rate,
        grad_bytes_per_gpu=model.params * 2.0 / tp,
        gpus_per_node=gpus_per_node,
        link_gb_s=(hw.nvlink_gb_s, hw.ib_gb_s),
        shift_up_s={
            "read_s": weights_node / host,
            "reload_s": optimizer_node / host + s.train_start_s.value,
        },
        shift_down_s={"offload_s": optimizer_node / host, "discard_s": s.train_stop_s.value},
        extension_up_s={
            "read_s": ext_weights / host,
            "reload_s": (optimizer_node + ext_optimizer) / host + s.train_start_s.value,
        },
        extension_down_s={"discard_s": s.train_stop_s.value},
        publish_s=write,
    )


def catalog_key(dirname: str) -> str | None:
    """The catalog model a directory name denotes: the name itself or a variant of it
    ("Qwen2.5-7B-Instruct" → qwen2.5-7b, "GLM-Z1-9B-0414" → glm-z1-9b)."""
    name = dirname.lower()
    for key in sorted(MODELS, key=len, reverse=True):
        if name == key or name.startswith(key + "-"):
            return key
    return None
