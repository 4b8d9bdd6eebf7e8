"""Bytes on one GPU for each role: training, an inference engine, and a shift.

Training (Megatron, as pivot_hpc/engines/megatron/engine.py builds it):
- weights: parameters / tp × 2 B (bf16) or 4 B (fp32);
- grads: the DDP grad buffer, fp32 (`grad_reduce_in_fp32=True`): 4 B/param;
- optimizer: AdamW m and v in fp32 (8 B) + fp32 master weights when the parameters are
  bf16 (4 B) = 12 B/param (8 in fp32); the distributed optimizer divides it by dp. With bf16
  that is Megatron's 18 B/param (6 + 12/dp distributed);
- optimizer step: torch's foreach AdamW makes one fp32 temporary of the moments (√v),
  4 B/param (/dp distributed), while the activations are gone;
- activations at the step's peak (end of the forward pass), per layer per token
  (Korthikanti et al. 2022, for this layer: RMSNorm, GQA attention, SwiGLU; no sequence
  parallelism, so the norm-region tensors are whole on every TP rank):
  12·h replicated (each norm's input and normalised output, the QKV and FC1 inputs)
  + (2·q + 4·kv + 2·q + 8·ffn) / tp (query, key and value, attention output, FC1 output,
  SiLU output and product); the local spec expands K/V to every query head (kv = q) and
  keeps 6 B × heads/tp × s² of scores per layer (fp32 softmax + bf16 probabilities);
  SDPA keeps only its log-sum-exp. Recompute: "selective" drops the stored scores (one
  layer's recomputed at a time), "full" keeps each layer's input (2·h per token) plus one
  layer's full set while it is recomputed. Logits: 8 B × tokens × vocab/tp at the peak
  (the fp32 copy the loss takes and the contiguous one vocab_parallel_cross_entropy keeps);
- attention workspace (local spec only): megatron's global score buffer (bf16, kept for
  the process's lifetime) + the fp32 softmax input and the backward's temporaries,
  10 B × heads/tp × s² per micro-batch sequence.

Inference (SGLang; the `hf` engine below): weights / tp; the KV pool SGLang sizes as
`mem_fraction_static × capacity − (what is already used) − weights`, capped by the role's
kv_capacity_tokens (SGLang's max_total_tokens); its activations (one prefill chunk, the
decode batch's logits) and CUDA graphs live outside that fraction.

A shift: a GPU of the training set serving inference keeps training's preserved context
(CUDA context, NCCL communicators, and with the local spec megatron's score buffer);
training on a GPU that served inference keeps the released engine's context.

Every constant below that is not a byte count of a tensor is an assumption, named here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pivot_hpc.planning.inputs import GIB, EngineInputs, TrainInputs, heads_per_gpu
from pivot_hpc.sim.catalog import ModelSpec

# Assumed (not measured here): a process's CUDA context with torch's cuBLAS workspaces.
CUDA_CONTEXT_GIB = 0.75
# Assumed: NCCL communicators' buffers of a process in a tp > 1 or dp > 1 group.
NCCL_GIB = 0.5
# Assumed: SGLang's attention-backend workspace (FlashInfer: a few hundred MiB) on top of
# its CUDA context, and its CUDA-graph pool (SGLang logs 0.5-2 GiB at start).
SGLANG_WORKSPACE_GIB = 0.75
SGLANG_GRAPHS_GIB = 1.0
# Assumed: the caching allocator's fragmentation over activations and workspaces.
FRAGMENTATION = 0.05

BYTES = {"bf16": 2, "fp32": 4}
GRAD_BYTES = 4  # grad_reduce_in_fp32=True (engines/megatron/engine.py)
ADAM_BYTES = 8  # exp_avg + exp_avg_sq, fp32
MASTER_BYTES = 4  # fp32 master weights when the parameters are bf16
STEP_TEMP_BYTES = 4  # foreach AdamW's √v temporary
LOGITS_BYTES = 8  # per (token, vocabulary entry) at the peak
SCORE_BYTES = 6  # local attention: fp32 softmax output + bf16 probabilities, kept
SCORE_WORKSPACE_BYTES = 10  # local attention: bf16 global buffer + fp32 temporaries


@dataclass
class RoleMemory:
    """One GPU of one role at its peak, in bytes."""

    role: str
    model: str
    tp: int
    weights: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    attention: float = 0.0
    kv: float = 0.0
    # the optimizer step's temporary beyond the activations it outlives (training)
    temporaries: float = 0.0
    context: float = 0.0  # CUDA context, NCCL, engine workspaces, allocator reserve
    resident: float = 0.0  # another role's memory still on this GPU (a shift)
    capacity: float | None = None
    kv_tokens: int | None = None  # tokens the KV pool holds (inference)
    seq_len: int = 0  # the longest sequence of the role
    static_budget: float | None = None  # SGLang: mem_fraction_static × capacity
    problem: str | None = None  # why it does not fit
    need: float = 0.0  # bytes needed against `have` for the refusal line
    have: float = 0.0
    detail: str = ""
    extras: dict[str, float] = field(default_factory=dict)  # GiB figures beside the total

    @property
    def total(self) -> float:
        return (
            self.weights
            + self.grads
            + self.optimizer
            + self.activations
            + self.attention
            + self.kv
            + self.temporaries
            + self.context
            + self.resident
        )

    @property
    def fits(self) -> bool | None:
        return None if self.capacity is None else self.problem is None

    def check_total(self) -> None:
        if self.capacity is not None and self.problem is None and self.total > self.capacity:
            self.problem = "total"
            self.need, self.have = self.total, self.capacity


# ------------------------------------------------------------------ activations
def layer_bytes_per_token(m: ModelSpec, tp: int, attention: str) -> float:
    """Bytes one decoder layer keeps for backward per token (scores excluded)."""
    h = m.hidden
    q = m.heads * m.head_dim
    kv = q if attention == "local" else m.kv_heads * m.head_dim
    ffn = m.ffn or m.experts_active * m.expert_ffn  # MoE: a token's routed experts
    sharded = 2 * q + 2 * 2 * kv + 2 * q + 8 * ffn
    if attention == "sdpa":
        sharded += 4 * m.heads  # fp32 log-sum-exp per head
    return 12 * h + sharded / tp


def training_activations(t: TrainInputs, recompute: str | None = None) -> tuple[float, float]:
    """(activations, attention workspace) at the training step's peak, bytes per GPU."""
    m, b, s = t.model, t.micro_batch, t.seq_len
    recompute = recompute or t.recompute
    tokens = b * s
    layer = tokens * layer_bytes_per_token(m, t.tp, t.attention)
    local = t.attention == "local"
    heads = heads_per_gpu(m.heads, t.tp)
    scores = SCORE_BYTES * b * heads * s * s if local else 0.0
    if recompute == "none":
        kept = m.layers * (layer + scores)
    elif recompute == "selective":
        kept = m.layers * layer + scores
    else:  # full: each layer's input, plus the layer being recomputed
        kept = m.layers * tokens * 2 * m.hidden + layer + scores
    logits = LOGITS_BYTES * tokens * m.vocab / t.tp
    workspace = SCORE_WORKSPACE_BYTES * b * heads * s * s if local else 0.0
    return kept + logits, workspace


def score_buffer(t: TrainInputs) -> float:
    """Megatron's global score buffer (local spec): kept after training shifts down."""
    if t.attention != "local":
        return 0.0
    return 2.0 * t.micro_batch * heads_per_gpu(t.model.heads, t.tp) * t.seq_len**2


def optimizer_bytes(t: TrainInputs, distributed: bool | None = None) -> float:
    per_param = ADAM_BYTES + (MASTER_BYTES if t.dtype == "bf16" else 0)
    dist = t.distributed_optimizer if distributed is None else distributed
    return t.model.params / t.tp * per_param / (t.dp if dist else 1)


def training_context(t: TrainInputs) -> float:
    return (CUDA_CONTEXT_GIB + (NCCL_GIB if t.gpus > 1 else 0.0)) * GIB


def training_memory(
    t: TrainInputs,
    capacity: float | None,
    *,
    resident: float = 0.0,
    role: str = "training",
    detail: str = "",
) -> RoleMemory:
    """Training's peak on one GPU of the set: the step (forward end, or the optimizer
    step when its temporary is larger)."""
    params = t.model.params / t.tp
    acts, workspace = training_activations(t)
    optimizer = optimizer_bytes(t)
    step_temp = params * STEP_TEMP_BYTES / (t.dp if t.distributed_optimizer else 1)
    dynamic = max(acts + workspace, step_temp)
    r = RoleMemory(
        role=role,
        model=t.model.name,
        tp=t.tp,
        weights=params * BYTES[t.dtype],
        grads=params * GRAD_BYTES,
        optimizer=optimizer,
        activations=acts,
        attention=workspace,
        temporaries=dynamic - acts - workspace,
        context=training_context(t) + FRAGMENTATION * dynamic,
        resident=resident,
        capacity=capacity,
        detail=detail,
        seq_len=t.seq_len,
    )
    r.extras = {
        "optimizer_step_gib": step_temp / GIB,
        "activations_by_recompute_gib": {  # type: ignore[dict-item]
            mode: sum(training_activations(t, mode)) / GIB for mode in ("none", "selective", "full")
        },
        "optimizer_by_kind_gib": {  # type: ignore[dict-item]
            "plain": optimizer_bytes(t, False) / GIB,
            "distributed": optimizer_bytes(t, True) / GIB,
        },
    }
    r.check_total()
    return r


# --------------------------------------------------------------------- inference
def kv_bytes_per_token(e: EngineInputs) -> float:
    """KV bytes of one token on one GPU (the catalog's bf16 figure, in the engine's dtype)."""
    return e.model.kv_bytes_per_token_per_gpu(e.tp) * (e.bytes_per_param / 2)


def inference_activations(e: EngineInputs) -> float:
    """One prefill chunk's largest live tensors and the decode batch's fp32 logits."""
    m = e.model
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    ffn = m.ffn or m.experts_active * m.expert_ffn
    per_token = 2 * (2 * m.hidden) + 2 * (q + 2 * kv) / e.tp + 2 * 3 * ffn / e.tp
    chunk = min(e.prefill_chunk_tokens, max(e.kv_capacity_tokens, 1))
    logits = 8.0 * e.max_batch * m.vocab / e.tp
    return chunk * per_token * (e.bytes_per_param / 2) + logits


def engine_context(e: EngineInputs) -> float:
    base = CUDA_CONTEXT_GIB + (NCCL_GIB if e.tp > 1 else 0.0)
    if e.engine == "sglang":
        base += SGLANG_WORKSPACE_GIB
    return base * GIB


def inference_memory(
    e: EngineInputs,
    capacity: float | None,
    *,
    resident: float = 0.0,
    role: str | None = None,
    detail: str = "",
) -> RoleMemory:
    """One GPU of an inference replica while it serves (KV pool full)."""
    m = e.model
    bpt = kv_bytes_per_token(e)
    state = m.state_bytes_per_seq / e.tp  # hybrid models: recurrent state per sequence
    weights = m.params * e.bytes_per_param / e.tp
    act = inference_activations(e)
    r = RoleMemory(
        role=role or e.role,
        model=m.name,
        tp=e.tp,
        weights=weights,
        context=engine_context(e),
        resident=resident,
        capacity=capacity,
        detail=detail,
        seq_len=e.max_seq_len,
    )
    one_seq = e.max_seq_len * bpt + state
    if e.engine == "hf":
        # slots of max_len tokens, grown by doubling up to max_batch (old + new while it
        # grows); a GPS Read lands in a full-model buffer beside the weights
        kv = e.max_batch * e.max_seq_len * bpt
        r.kv, r.kv_tokens = kv, e.max_batch * e.max_seq_len
        r.activations = act + max(kv / 2, m.params * e.bytes_per_param)
        r.context += FRAGMENTATION * r.activations
        r.check_total()
        return r
    # sglang
    wanted = e.kv_capacity_tokens * bpt + state * e.max_batch
    r.activations = act
    r.context += SGLANG_GRAPHS_GIB * GIB + FRAGMENTATION * act
    if capacity is None:
        r.kv, r.kv_tokens = wanted, e.kv_capacity_tokens
        return r
    fraction = e.mem_fraction_static
    if fraction is None:  # sized at start from the free memory (engines/sglang/launch.py)
        free = capacity - resident
        fraction = min(0.99, max(0.05, 1.0 - e.memory_reserve_gib * GIB / max(free, 1.0)))
    budget = fraction * capacity
    pool = budget - resident - engine_context(e) - weights
    r.static_budget = budget
    r.kv = max(0.0, min(wanted, pool))
    r.kv_tokens = int(max(0.0, r.kv - state * e.max_batch) / bpt) if bpt else 0
    r.extras = {"mem_fraction_static": fraction}
    if pool < one_seq:
        r.problem = "pool"
        r.need = resident + engine_context(e) + weights + one_seq
        r.have = budget
        return r
    r.check_total()
    return r


def engine_residual(e: EngineInputs) -> float:
    """What a released SGLang engine keeps on its GPUs (weights, KV and graphs are
    released; its process's context stays); a released hf engine keeps nothing."""
    return engine_context(e) if e.engine == "sglang" else 0.0
