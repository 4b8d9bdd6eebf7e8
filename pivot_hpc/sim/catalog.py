"""Hardware and model catalog for the simulator; throughput constants from first principles.

Nothing here is fitted to the paper's results. Sources:
- H20 96 GB: HBM 4.0 TB/s and 148 TFLOP/s dense bf16 (NVIDIA H20 datasheet); PCIe
  63 GB/s and InfiniBand 50 GB/s as stated in the paper (§5.1, §8.1).
- H100 SXM 80 GB: 3.35 TB/s, 989 TFLOP/s dense bf16 (NVIDIA H100 datasheet); H200 SXM
  141 GB: 4.8 TB/s, 989 TFLOP/s (NVIDIA H200 datasheet). PCIe Gen5 x16 ≈ 63 GB/s usable,
  NDR InfiniBand 400 Gb/s = 50 GB/s.
- Models: the published HuggingFace configs (layers, hidden, heads, KV heads, head dim,
  FFN sizes, vocab, experts) of Qwen2.5-1.5B/7B/32B/72B, GLM-Z1-9B-0414, Qwen3-30B-A3B.
  Qwen3.5-122B-A10B: 122B total / 10B active and a 48-layer hybrid stack (Gated DeltaNet +
  full attention, hidden 3072) from its model card; we assume the Qwen3-Next attention
  layout (every 4th layer full attention, 2 KV heads of dim 256), so only 12 layers hold a
  per-token KV cache — an assumption, stated as such.

Decode step (paper App. A): L = A·N_tok + max(B, C·N_seq) + D per replica of `tp` GPUs:
  A = KV bytes per token / (tp · HBM bandwidth)       attention reads the whole KV cache
  B = weight bytes / (tp · HBM bandwidth)             memory-bound FFN streams the weights
      (MoE: all experts — at decode batch sizes ≥ ~32 nearly every expert is touched)
  C = 2 · active params / (tp · peak FLOP/s · GEMM_EFFICIENCY)   compute-bound FFN
  D = STEP_OVERHEAD_S (+ two all-reduces per layer when tp > 1)
Assumptions (constants below, documented, not tuned): 80 % of peak HBM bandwidth is
achievable, GEMM efficiency 0.6 for decode and prefill, training MFU 0.35, 3 ms fixed per decode step, 10 µs per TP all-reduce, 85 % of
HBM usable by an inference engine, fixed engine start (KV allocation + CUDA graph capture)
0.5 s on shift up, 0.2 s to stop an engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from pivot_hpc.errors import PivotError
from pivot_hpc.scheduler import ThroughputModel

BF16 = 2
GEMM_EFFICIENCY = 0.6
HBM_EFFICIENCY = 0.8  # achievable fraction of peak HBM bandwidth (STREAM-like copies)
TRAIN_MFU = 0.35
STEP_OVERHEAD_S = 3e-3
ALLREDUCE_S = 10e-6
HBM_USABLE = 0.85
ENGINE_START_S = 0.5
ENGINE_STOP_S = 0.2
TRAIN_CONTEXT_S = 1.0  # re-arm the training context (optimizer bookkeeping, comm warmup)
OPTIMIZER_BYTES_PER_PARAM = 12  # fp32 master weights + Adam m and v


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
    total_override: float | None = None  # published totals where the config is not modelled
    active_override: float | None = None

    def _attn(self) -> float:
        h, d = self.hidden, self.head_dim
        return h * self.heads * d * 2 + h * self.kv_heads * d * 2

    def _embed(self) -> float:
        return self.vocab * self.hidden * (1 if self.tied else 2)

    @property
    def params(self) -> float:
        if self.total_override:
            return self.total_override
        per_layer = (
            self._attn()
            + 3 * self.hidden * self.ffn
            + 3 * self.hidden * self.expert_ffn * self.experts
        )
        return self._embed() + self.layers * per_layer

    @property
    def active_params(self) -> float:
        if self.active_override:
            return self.active_override
        per_layer = self._attn() + 3 * self.hidden * self.ffn
        per_layer += 3 * self.hidden * self.expert_ffn * self.experts_active
        return self._embed() + self.layers * per_layer

    @property
    def weight_bytes(self) -> float:
        return self.params * BF16

    @property
    def kv_bytes_per_token(self) -> float:
        layers = self.kv_layers if self.kv_layers is not None else self.layers
        return 2 * layers * self.kv_heads * self.head_dim * BF16


MODELS: dict[str, ModelSpec] = {
    "qwen2.5-1.5b": ModelSpec("Qwen2.5-1.5B", 28, 1536, 12, 2, 128, 8960, 151936, tied=True),
    "qwen2.5-7b": ModelSpec("Qwen2.5-7B", 28, 3584, 28, 4, 128, 18944, 152064),
    "qwen2.5-32b": ModelSpec("Qwen2.5-32B", 64, 5120, 40, 8, 128, 27648, 152064),
    "qwen2.5-72b": ModelSpec("Qwen2.5-72B", 80, 8192, 64, 8, 128, 29568, 152064),
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
        kv_layers=12,
        total_override=122e9,
        active_override=10e9,
    ),
}


def lookup(table: dict, name: str, what: str):
    try:
        return table[name]
    except KeyError:
        raise CatalogError(f"unknown {what} {name!r}; known: {', '.join(sorted(table))}") from None


@dataclass(frozen=True)
class InferenceCosts:
    """Everything the simulator needs about one (model, hardware, tp) inference replica."""

    model: ThroughputModel
    kv_capacity_tokens: int
    prefill_s_per_token: float
    shift_up_s: dict[str, float]  # phase -> seconds
    shift_down_s: dict[str, float]
    weight_update_s: float  # re-read weights from GPS (new policy version)


def inference_costs(model: ModelSpec, hw: Hardware, tp: int) -> InferenceCosts:
    hbm = hw.hbm_tb_s * 1e12 * tp * HBM_EFFICIENCY
    flops = hw.bf16_tflops * 1e12 * tp * GEMM_EFFICIENCY
    d = STEP_OVERHEAD_S + (2 * model.layers * ALLREDUCE_S if tp > 1 else 0.0)
    tm = ThroughputModel(
        A=model.kv_bytes_per_token / hbm,
        B=model.weight_bytes / hbm,
        C=2 * model.active_params / flops,
        D=d,
    )
    free = tp * hw.hbm_gb * 1e9 * HBM_USABLE - model.weight_bytes
    if free <= 0:
        raise CatalogError(
            f"{model.name} ({model.weight_bytes / 1e9:.0f} GB of weights) does not fit on "
            f"{tp}×{hw.name}: raise its tp"
        )
    read = model.weight_bytes / tp / (hw.pcie_gb_s * 1e9)  # node-local GPS read over PCIe
    return InferenceCosts(
        model=tm,
        kv_capacity_tokens=int(free / model.kv_bytes_per_token),
        prefill_s_per_token=2 * model.active_params / flops,
        shift_up_s={"read_s": read, "reload_s": ENGINE_START_S},
        shift_down_s={"discard_s": ENGINE_STOP_S},
        weight_update_s=read,
    )


@dataclass(frozen=True)
class TrainingCosts:
    gpus: int
    # 6·P/(gpus·peak·MFU): forward + backward. No separate old-policy logprob pass: the
    # GRPO loss takes the importance ratio against the rollout engine's logprobs.
    step_s_per_token: float
    shift_up_s: dict[str, float]
    shift_down_s: dict[str, float]
    publish_s: float  # GPS Write of the new policy (not overlapped in the simulator)


def training_costs(model: ModelSpec, hw: Hardware, gpus: int, tp: int) -> TrainingCosts:
    if gpus < 1:
        raise CatalogError("training needs at least one GPU")
    peak = hw.bf16_tflops * 1e12 * gpus * TRAIN_MFU
    shard = model.weight_bytes / max(1, min(tp, gpus))
    pcie = hw.pcie_gb_s * 1e9
    opt = model.params * OPTIMIZER_BYTES_PER_PARAM / gpus / pcie  # distributed optimizer shard
    write = max(shard / pcie, model.weight_bytes / (hw.ib_gb_s * 1e9))
    return TrainingCosts(
        gpus=gpus,
        step_s_per_token=6 * model.active_params / peak,
        shift_up_s={"read_s": shard / pcie, "reload_s": opt + TRAIN_CONTEXT_S},
        shift_down_s={"offload_s": opt, "discard_s": ENGINE_STOP_S},
        publish_s=write,
    )
