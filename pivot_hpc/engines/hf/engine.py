"""The `hf` InferenceEngine: continuous batching over a `transformers` decoder.

The model is whatever `transformers` builds from the directory's config (Auto classes,
models/hf_load.py): Qwen2, Qwen3 (q/k norms), Llama (rope scaling lives in the model's
rotary module), GLM-4 (extra post-attention and post-MLP norms, partial rotary), MoE
decoders such as Qwen3-MoE (the layer's own MLP module is called), fused qkv or gate_up
projections, Qwen3.5's hybrid of gated full attention and Gated DeltaNet linear attention
(per-sequence states: linear_attention.py). Weights arrive under their checkpoint (GPS)
names and are mapped onto the model's parameters by `WeightMap`. A decoder the loop would
compute differently from `transformers` (other layer kinds, norms it does not apply,
scaled residuals or logits, a sliding window shorter than the engine's context) is
refused in one line (`unsupported`).

CPU is its home (the embedded default); on a GPU the same loop runs where the model is
(`engines.<role>.device`): the KV cache and every index tensor are created on the model's
device, sampling uses a generator there, and GPS reads land there directly.

Why not `model.generate` or transformers' own continuous batching: generate cannot admit
or abort a sequence mid-batch, and transformers' CB was 3–9x slower on CPU and returns no
partial tokens on cancel (docs/platform.md). This loop calls the model's own modules (norms,
projections, rotary embedding, MLP, LM head) but owns the KV cache:

- KV cache: per layer one K and one V tensor [slots, kv_heads, max_len, head_dim]. Running
  sequence i lives in slot i (slots are kept dense: a finished sequence's slot is refilled
  by moving the last one), so a decode step attends over `K[:n, :, :L]` without gathers.
- Capacity: `kv_capacity_tokens` bounds the tokens held by running sequences. Admission
  needs room for the whole context (prompt + already generated) plus one token; when a
  decode step would overflow, the most recently admitted sequences are preempted back to
  the waiting queue with their tokens and are re-prefilled later (vLLM's recompute policy).
- Prefill: newly admitted sequences are right-padded into chunks and run with a causal +
  padding mask; the first new token comes from the last real position.
- Decode: one token per running sequence; GQA is computed by grouping query heads per KV
  head (exact, no K/V repeat).
- Hybrid models (linear-attention layers) prefill one sequence per chunk: a recurrent
  state is exact only without padding after the sequence's end.
- Abort returns the generated tokens and logprobs; `add(..., generated_ids=...)` resumes
  by re-prefilling prompt + generated tokens.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from pivot_hpc.engines.base import (
    EngineStats,
    InRank,
    SamplingParams,
    SeqResult,
    Tensors,
    check_new_sequence,
)
from pivot_hpc.engines.hf import linear_attention
from pivot_hpc.errors import PivotError


class UnsupportedModelError(PivotError, ValueError):
    """A model the hf engine's own attention loop cannot run."""


# norms a decoder layer may have: the engine applies exactly these (GLM-4's sandwich norms
# after attention and MLP included); any other norm would be skipped silently
LAYER_NORMS = frozenset(
    {
        "input_layernorm",
        "post_attention_layernorm",
        "post_self_attn_layernorm",
        "post_mlp_layernorm",
    }
)
# config keys of models that scale embeddings, residual branches or logits by a constant
# (Granite, Cohere, MiniCPM): the engine's loop adds and projects without them
SCALE_KEYS = (
    "embedding_multiplier",
    "residual_multiplier",
    "logits_scaling",
    "logit_scale",
    "scale_emb",
    "scale_depth",
)


def unsupported(model, max_len: int | None = None) -> str | None:
    """Why the hf engine cannot run `model` (None: it can). Checked on the built model:
    the loop calls the model's own modules, so what it needs is their names."""
    c = model.config
    inner = getattr(model, "model", None)
    if inner is None or not all(
        hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")
    ):
        return "it is not a decoder with embed_tokens, layers, norm and rotary_emb"
    if not hasattr(model, "lm_head"):
        return "it has no lm_head"
    kinds = set(getattr(c, "layer_types", None) or ["full_attention"])
    if kinds - {"full_attention", "linear_attention"}:
        others = sorted(kinds - {"full_attention", "linear_attention"})
        return f"its layers include {others} (only full and Gated DeltaNet linear attention)"
    for layer in inner.layers:
        why = _block_problem(layer)
        if why is not None:
            return why
        if getattr(layer, "linear_attn", None) is not None:  # Qwen3.5's Gated DeltaNet
            why = linear_attention.problem(layer.linear_attn)
            if why is not None:
                return why
            continue
        a = getattr(layer, "self_attn", None)
        if a is None or not hasattr(a, "o_proj"):
            return "a decoder layer has no self_attn.o_proj"
        if not (
            hasattr(a, "qkv_proj") or all(hasattr(a, n) for n in ("q_proj", "k_proj", "v_proj"))
        ):
            return "its attention has neither q/k/v_proj nor a fused qkv_proj"
        if not hasattr(sys.modules[type(a).__module__], "apply_rotary_pos_emb"):
            return "its attention module defines no apply_rotary_pos_emb"
        why = _attention_norms_problem(c, a)
        if why is not None:
            return why
    scaled = {k: getattr(c, k) for k in SCALE_KEYS if getattr(c, k, None) not in (None, 1, 1.0)}
    if scaled:
        return f"it scales its embeddings, residuals or logits ({scaled})"
    window = getattr(c, "sliding_window", None)
    if window and getattr(c, "use_sliding_window", True) and window < (max_len or 0):
        return f"it attends through a sliding window of {window} < max_seq_len {max_len}"
    if getattr(c, "attn_logit_softcapping", None) or getattr(c, "final_logit_softcapping", None):
        return "it soft-caps logits"
    return None


def _norms(module) -> set[str]:
    return {n for n, m in module.named_children() if "norm" in type(m).__name__.lower()}


def _block_problem(layer) -> str | None:
    """A decoder layer is a pre-norm block whose norms the engine's loop applies."""
    norms = _norms(layer)
    if not {"input_layernorm", "post_attention_layernorm"} <= norms:
        return (
            "its decoder layers are not pre-norm blocks (input_layernorm before attention, "
            "post_attention_layernorm before the MLP)"
        )
    if norms - LAYER_NORMS:
        return f"its decoder layers have norms the engine does not apply: {sorted(norms - LAYER_NORMS)}"
    return None


def _attention_norms_problem(c, attn) -> str | None:
    """An attention's only norms are per-head q/k norms (Qwen3's), applied before rotary."""
    extra = _norms(attn) - {"q_norm", "k_norm"}
    if extra:
        return f"its attention has norms the engine does not apply: {sorted(extra)}"
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    for name in ("q_norm", "k_norm"):
        w = getattr(getattr(attn, name, None), "weight", None)
        if w is not None and w.shape[-1] != head_dim:  # OLMoE's span every head at once
            return f"its attention's {name} spans {w.shape[-1]} features, not one head's {head_dim}"
    return None


@dataclass(slots=True)
class _Seq:
    seq_id: int
    prompt: list[int]
    out: list[int]
    logprobs: list[float]
    sampling: SamplingParams
    cached: int = 0  # tokens whose K/V are in the cache (the last sampled one is not)
    version: int = 0
    admitted_at: int = 0  # admission counter: preempt the newest first
    finish: str | None = None
    prefix_len: int = field(default=0)  # len(prompt) + tokens given at add()


class HFEngine(InRank):
    """Continuous-batching engine over a `transformers` decoder (see module docstring)."""

    def __init__(
        self,
        model,
        *,
        kv_capacity_tokens: int = 65536,
        max_batch: int = 256,
        max_seq_len: int | None = None,
        prefill_chunk_tokens: int = 4096,
        eos_token_id: int | None = None,
        tokenizer=None,
        num_threads: int | None = 1,
        seed: int = 0,
        weight_map=None,
    ) -> None:
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.model = model.eval()
        c = model.config
        self.n_layers = c.num_hidden_layers
        self.n_heads = c.num_attention_heads
        self.n_kv = c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.max_len = max_seq_len or c.max_position_embeddings
        why = unsupported(model, self.max_len)
        if why is not None:
            raise UnsupportedModelError(
                f"{type(model).__name__}: the hf engine cannot run it ({why}); "
                "serve this role with engines.<role>.engine: vllm or sglang"
            )
        from pivot_hpc.models.hf_load import WeightMap

        # checkpoint (GPS) names -> parameters; without the directory's names a map of
        # the model's own parameter names (every architecture that stores them as such)
        self.weight_map = weight_map or WeightMap(model, [n for n, _ in model.named_parameters()])
        self.kv_capacity = int(kv_capacity_tokens)
        self.max_batch = int(max_batch)
        self.prefill_chunk_tokens = int(prefill_chunk_tokens)
        eos = c.eos_token_id if eos_token_id is None else eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else ([] if eos is None else [eos]))
        self.tokenizer = tokenizer
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        # where GPS should read weights to: "cpu" (torch tensors over host memory) or "cuda"
        self.weights_device = self.device.type
        # multinomial needs its generator on the probabilities' device
        self.gen = torch.Generator(device=self.device).manual_seed(seed)
        self.version = 0
        self._k: list[torch.Tensor] | None = None
        self._v: list[torch.Tensor] | None = None
        self._slots = 0
        self.running: list[_Seq] = []  # index = KV slot
        self.waiting: deque[_Seq] = deque()
        self._by_id: dict[int, _Seq] = {}
        self._admissions = 0
        self._last_step_s = 0.0
        self._last_step_shape = (0, 0)  # (N_seq, N_tok) of the last decode step
        self._steps = 0
        self._preemptions = 0
        self._weight_shapes: dict[str, tuple[torch.Size, torch.dtype]] | None = None
        inner = model.model
        self._embed = inner.embed_tokens
        self._layers = inner.layers
        self._norm = inner.norm
        self._rotary = inner.rotary_emb
        self._lm_head = model.lm_head
        self._fused: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] | None = None
        # per layer, the model's own rotary application (GLM-4's is partial and
        # interleaved, Qwen2/Llama/Qwen3's is not) and its attention's score scale
        attns = [getattr(layer, "self_attn", None) for layer in self._layers]
        self._rope = [
            None if a is None else sys.modules[type(a).__module__].apply_rotary_pos_emb
            for a in attns
        ]
        self._scale = [getattr(a, "scaling", self.head_dim**-0.5) for a in attns]
        # gated attention (Qwen3.5): q_proj also yields a per-channel output gate
        self._gated = [
            a is not None
            and hasattr(a, "q_proj")
            and a.q_proj.out_features == 2 * self.n_heads * self.head_dim
            for a in attns
        ]
        self._gate: torch.Tensor | None = None  # the current layer's gate, for _attn_out
        # linear-attention layers (Qwen3.5's Gated DeltaNet): their states per KV slot
        linear = {
            i: layer.linear_attn
            for i, layer in enumerate(self._layers)
            if getattr(layer, "linear_attn", None) is not None
        }
        self._linear = linear_attention.LinearStates(linear, self.device) if linear else None
        # the fused SiLU-gated MLP of dense layers; any other MLP (MoE) runs as its module
        self._silu = getattr(c, "hidden_act", "silu") == "silu"

    # ------------------------------------------------------------------ API
    def add(
        self,
        seq_id: int,
        prompt_ids: list[int],
        generated_ids: list[int] | None = None,
        sampling: SamplingParams | None = None,
        generated_logprobs: list[float] | None = None,
    ) -> None:
        gen, lps = check_new_sequence(
            seq_id, prompt_ids, generated_ids, generated_logprobs, self._by_id
        )
        if len(prompt_ids) + len(gen) + 1 > min(self.max_len, self.kv_capacity):
            raise ValueError(
                f"add: sequence {seq_id} needs {len(prompt_ids) + len(gen) + 1} tokens; "
                f"max_seq_len={self.max_len}, kv_capacity={self.kv_capacity}"
            )
        s = _Seq(seq_id, list(prompt_ids), gen, lps, sampling or SamplingParams())
        s.prefix_len = len(prompt_ids) + len(gen)
        s.version = self.version
        self._by_id[seq_id] = s
        if self._done_reason(s) is not None:  # e.g. resumed with max_tokens already reached
            s.finish = self._done_reason(s)
        self.waiting.append(s)

    def can_admit(self, n_tokens: int) -> bool:
        """Whether a sequence with `n_tokens` of context could start now."""
        return (
            len(self.running) < self.max_batch
            and self._tokens_in_cache() + len(self.running) + n_tokens + 1 <= self.kv_capacity
        )

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    def step(self) -> list[SeqResult]:
        """Admit + prefill what fits, then one decode step over every running sequence.

        Returns the sequences that finished in this step."""
        if self._weight_shapes is not None:
            raise RuntimeError("step: weights were released; call resume_memory + load_weights")
        finished: list[SeqResult] = []
        # Sequences that arrive already complete (resumed at max_tokens) skip the model;
        # one that outgrew the whole KV capacity ends as "length" (it can never run).
        while self.waiting and (
            self.waiting[0].finish is not None
            or len(self.waiting[0].prompt) + len(self.waiting[0].out) + 1 > self.kv_capacity
        ):
            s = self.waiting.popleft()
            finished.append(self._finish(s, s.finish or "length"))
        admitted = self._admit()
        if admitted:
            self._prefill(admitted)
            finished.extend(self._collect_finished())
        if self.running:
            self._make_room()
            if self.running:
                self._decode()
                finished.extend(self._collect_finished())
        return finished

    def _collect_finished(self) -> list[SeqResult]:
        out = []
        for s in [s for s in self.running if s.finish is not None]:
            self._free(s)
            out.append(self._result(s, s.finish))
        return out

    def abort(self, seq_id: int) -> SeqResult:
        s = self._by_id.get(seq_id)
        if s is None:
            raise KeyError(f"abort: sequence {seq_id} is not in this engine")
        if s in self.running:
            self._free(s)
        else:
            self.waiting.remove(s)
            del self._by_id[s.seq_id]
        return self._result(s, "abort")

    def abort_all(self) -> list[SeqResult]:
        return [self.abort(i) for i in list(self._by_id)]

    def snapshot(self) -> list[SeqResult]:
        """Every unfinished sequence's tokens so far, without disturbing it (checkpoints)."""
        return [self._result(s, "abort") for s in self._by_id.values()]

    def rng_state(self) -> torch.Tensor:
        return self.gen.get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self.gen.set_state(state)

    def close(self) -> None:
        """Drop the KV cache and the sequences (the model belongs to whoever passed it)."""
        self.running.clear()
        self.waiting.clear()
        self._by_id.clear()
        self._k = self._v = None
        self._fused = None
        self._slots = 0
        if self._linear is not None:
            self._linear.reset()
        self._empty_cache()

    def _empty_cache(self) -> None:
        # freed KV/weight blocks go back to the driver, so another role on this GPU (SGLang
        # sizes its pool from what is free, Megatron) can have them
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def seq_lengths(self) -> dict[int, int]:
        """Context length (prompt + generated) of every sequence in the engine."""
        return {s.seq_id: len(s.prompt) + len(s.out) for s in (*self.running, *self.waiting)}

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self.running),
            waiting=len(self.waiting),
            tokens_in_cache=self._tokens_in_cache(),
            kv_capacity=self.kv_capacity,
            last_step_s=self._last_step_s,
            last_step_seqs=self._last_step_shape[0],
            last_step_tokens=self._last_step_shape[1],
            steps=self._steps,
            preemptions=self._preemptions,
        )

    def load_weights(self, tensors: Tensors, version: int) -> None:
        """Copy tensors under their checkpoint (HF) names into the model's parameters in
        place (a tied lm_head comes with the embedding; one stored anyway is ignored)."""
        if self._weight_shapes is not None:
            raise RuntimeError("load_weights: call resume_memory() first")
        self.weight_map.check(tensors, "load_weights")
        self.weight_map.fill(tensors.__getitem__)
        self._fused = None
        self.version = version

    def release_memory(self, weights: bool = False) -> None:
        """Free the KV cache (and the weights if asked); the engine must be idle."""
        if self.has_unfinished():
            raise RuntimeError("release_memory: abort the engine's sequences first")
        self._k = self._v = None
        self._fused = None
        self._slots = 0
        if self._linear is not None:
            self._linear.reset()
        if weights and self._weight_shapes is None:
            self._weight_shapes = {}
            for name, p in self.model.named_parameters():
                self._weight_shapes[name] = (p.shape, p.dtype)
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self._empty_cache()  # KV cache (and weights) back to the driver

    def resume_memory(self) -> None:
        """Re-allocate released weights (contents undefined until `load_weights`)."""
        if self._weight_shapes is not None:
            for name, p in self.model.named_parameters():
                shape, dtype = self._weight_shapes[name]
                p.data = torch.empty(shape, dtype=dtype, device=p.device)
            self._weight_shapes = None

    # ------------------------------------------------------------ KV cache
    def _tokens_in_cache(self) -> int:
        return sum(s.cached for s in self.running)

    def _ensure_slots(self, n: int) -> None:
        if self._k is not None and self._slots >= n:
            return
        new = min(self.max_batch, max(n, 2 * self._slots, 8))
        dev = self.device
        # a linear-attention layer keeps no K/V (its states: linear_attention.py)
        shapes = [
            (new, self.n_kv, 0 if rope is None else self.max_len, self.head_dim)
            for rope in self._rope
        ]
        ks = [torch.zeros(shape, dtype=self.dtype, device=dev) for shape in shapes]
        vs = [torch.zeros(shape, dtype=self.dtype, device=dev) for shape in shapes]
        if self._linear is not None:
            self._linear.ensure(new)
        if self._k is not None:
            for i in range(self.n_layers):
                ks[i][: self._slots] = self._k[i]
                vs[i][: self._slots] = self._v[i]
        self._k, self._v, self._slots = ks, vs, new

    def _free(self, s: _Seq) -> None:
        """Drop a running sequence; the last slot moves into its place (slots stay dense)."""
        i = self.running.index(s)
        last = len(self.running) - 1
        if i != last:
            moved = self.running[last]
            n = moved.cached
            for k, v in zip(self._k, self._v, strict=True):
                k[i, :, :n] = k[last, :, :n]
                v[i, :, :n] = v[last, :, :n]
            if self._linear is not None:
                self._linear.move(i, last)
            self.running[i] = moved
        self.running.pop()
        self._by_id.pop(s.seq_id, None)

    def _preempt(self, s: _Seq) -> None:
        """Back to the front of the waiting queue, keeping its tokens (re-prefilled later)."""
        self._free(s)
        s.cached = 0
        self._by_id[s.seq_id] = s
        self.waiting.appendleft(s)
        self._preemptions += 1

    def _admit(self) -> list[_Seq]:
        admitted: list[_Seq] = []
        # every running sequence needs one more token in this step's decode
        budget = self.kv_capacity - self._tokens_in_cache() - len(self.running)
        longest = 0  # one prefill forward per step (SGLang's chunked prefill does the same):
        # a step's latency stays bounded, and with it how long a command waits for the engine
        while self.waiting and len(self.running) + len(admitted) < self.max_batch:
            s = self.waiting[0]
            if s.finish is not None:
                break
            need = len(s.prompt) + len(s.out) + 1
            if need > budget:
                break
            padded = max(longest, need - 1) * (len(admitted) + 1)
            if admitted and padded > self.prefill_chunk_tokens:
                break
            longest = max(longest, need - 1)
            budget -= need
            self.waiting.popleft()
            self._admissions += 1
            s.admitted_at = self._admissions
            admitted.append(s)
        return admitted

    def _make_room(self) -> None:
        """Preempt the newest running sequences until one more token each fits."""
        while self.running and self._tokens_in_cache() + len(self.running) > self.kv_capacity:
            victim = max(
                (s for s in self.running if s.finish is None),
                key=lambda s: s.admitted_at,
                default=None,
            )
            if victim is None:
                break
            self._preempt(victim)

    # ------------------------------------------------------------- forward
    def _fused_weights(
        self,
    ) -> list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
        """Per layer: [q; k; v] weight and bias, [gate; up] weight (None: the layer's MLP
        is not a dense SiLU-gated one) — one matmul instead of three (two) per decode
        step. Rebuilt after every weight change."""
        if self._fused is None:
            self._fused = []
            for layer in self._layers:
                a, m = getattr(layer, "self_attn", None), layer.mlp
                if a is None:  # a linear-attention layer (its own module computes it)
                    w = bias = None
                elif hasattr(a, "qkv_proj"):  # fused already (Phi-3)
                    w, bias = a.qkv_proj.weight.detach(), a.qkv_proj.bias
                    bias = None if bias is None else bias.detach()
                else:
                    projs = (a.q_proj, a.k_proj, a.v_proj)
                    w = torch.cat([p.weight for p in projs]).detach()
                    bias = None
                    if any(p.bias is not None for p in projs):  # Qwen2: all three; others one
                        bias = torch.cat(
                            [
                                p.bias if p.bias is not None else p.weight.new_zeros(p.out_features)
                                for p in projs
                            ]
                        ).detach()
                gu = None
                # fused only without biases (Llama's mlp_bias, InternLM): a biased MLP runs
                # as the model's own module, biases included
                down = getattr(m, "down_proj", None)
                if self._silu and isinstance(down, nn.Linear) and down.bias is None:
                    fused = getattr(m, "gate_up_proj", None)  # fused already (GLM-4, Phi-3)
                    gate, up = getattr(m, "gate_proj", None), getattr(m, "up_proj", None)
                    if isinstance(fused, nn.Linear) and fused.bias is None:
                        gu = fused.weight.detach()
                    elif (
                        isinstance(gate, nn.Linear)
                        and isinstance(up, nn.Linear)
                        and gate.bias is None
                        and up.bias is None
                    ):
                        gu = torch.cat([gate.weight, up.weight]).detach()
                self._fused.append((w, bias, gu))
        return self._fused

    def _norm_in(self, li: int, layer, x: torch.Tensor) -> torch.Tensor:
        return _norm(layer.input_layernorm, x)

    def _attn_qkv(self, li: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        w, bias, _ = self._fused_weights()[li]
        a = self._layers[li].self_attn
        b, s, _ = h.shape
        qkv = F.linear(h, w, bias)
        nq, nk = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        gated = self._gated[li]
        q, k, v = qkv.split([nq * (2 if gated else 1), nk, nk], dim=-1)
        self._gate = None
        if gated:  # per head [q (head_dim); gate (head_dim)], as the module splits it
            q, gate = q.view(b, s, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
            self._gate = gate.reshape(b, s, -1)
        q = q.reshape(b, s, self.n_heads, self.head_dim)
        k = k.view(b, s, self.n_kv, self.head_dim)
        if getattr(a, "q_norm", None) is not None:  # Qwen3: per-head norms before rotary
            q, k = _norm(a.q_norm, q), _norm(a.k_norm, k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        if getattr(a, "use_rope", True):  # (SmolLM3's NoPE layers do not rotate at all)
            rot = cos.shape[-1]  # partial rotary (StableLM): the first `rot` dims turn
            qr, kr = self._rope[li](q[..., :rot], k[..., :rot], cos, sin)
            q = torch.cat([qr, q[..., rot:]], dim=-1) if rot < self.head_dim else qr
            k = torch.cat([kr, k[..., rot:]], dim=-1) if rot < self.head_dim else kr
        return q, k, v

    def _attn_out(self, li: int, layer, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        if self._gate is not None:
            o = o * torch.sigmoid(self._gate)
        o = layer.self_attn.o_proj(o)
        post = getattr(layer, "post_self_attn_layernorm", None)  # GLM-4's sandwich norm
        return x + (o if post is None else _norm(post, o))

    def _mlp(self, li: int, layer, x: torch.Tensor) -> torch.Tensor:
        h = _norm(layer.post_attention_layernorm, x)
        gu = self._fused_weights()[li][2]
        if gu is None:  # MoE or another MLP: the model's own module
            out = layer.mlp(h)
            out = out[0] if isinstance(out, tuple) else out
        else:
            gate, up = F.linear(h, gu).chunk(2, dim=-1)
            out = F.linear(F.silu(gate) * up, layer.mlp.down_proj.weight)
        post = getattr(layer, "post_mlp_layernorm", None)
        return out if post is None else _norm(post, out)

    @torch.no_grad()
    def _prefill(self, seqs: list[_Seq]) -> None:
        self._ensure_slots(len(self.running) + len(seqs))
        # Chunks of similar padded size: the prefill cost is batch × longest context.
        chunk: list[_Seq] = []
        longest = 0
        for s in seqs:
            n = len(s.prompt) + len(s.out)
            # a hybrid model prefills one sequence at a time: a linear-attention state
            # is exact only without padding after the sequence's end
            full = (
                self._linear is not None
                or max(longest, n) * (len(chunk) + 1) > self.prefill_chunk_tokens
            )
            if chunk and full:
                self._prefill_chunk(chunk)
                chunk, longest = [], 0
            chunk.append(s)
            longest = max(longest, n)
        if chunk:
            self._prefill_chunk(chunk)

    def _prefill_chunk(self, seqs: list[_Seq]) -> None:
        ctx = [s.prompt + s.out for s in seqs]
        n_ctx = [len(c) for c in ctx]
        b, L = len(seqs), max(n_ctx)
        # built on the host, one copy to the device (per-element writes would each sync)
        host_ids = torch.zeros(b, L, dtype=torch.long)
        for i, c in enumerate(ctx):
            host_ids[i, : len(c)] = torch.tensor(c)
        dev = self.device
        ids = host_ids.to(dev)
        lens = torch.tensor(n_ctx, device=dev)
        first = len(self.running)
        self.running.extend(seqs)
        pos = torch.arange(L, device=dev).unsqueeze(0).expand(b, L)
        x = self._embed(ids)
        cos, sin = self._rotary(x, pos)
        ar = torch.arange(L, device=dev)
        # causal and key-padding mask (True = attend)
        mask = (ar[None, :] <= ar[:, None])[None, None] & (ar[None, :] < lens[:, None])[
            :, None, None, :
        ]
        for li, layer in enumerate(self._layers):
            h = self._norm_in(li, layer, x)
            if self._rope[li] is None:  # linear attention: b == 1 (see _prefill)
                x = x + self._linear.prefill(li, h, first)
                x = x + self._mlp(li, layer, x)
                continue
            q, k, v = self._attn_qkv(li, h, cos, sin)
            self._k[li][first : first + b, :, :L] = k
            self._v[li][first : first + b, :, :L] = v
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, enable_gqa=True, scale=self._scale[li]
            )
            x = self._attn_out(li, layer, x, o.transpose(1, 2).reshape(b, L, -1))
            x = x + self._mlp(li, layer, x)
        last = x[torch.arange(b, device=dev), lens - 1]
        logits = self._lm_head(self._norm(last))
        for s, n in zip(seqs, n_ctx, strict=True):
            s.cached = n
        self._sample(seqs, logits)

    @torch.no_grad()
    def _decode(self) -> None:
        t0 = time.perf_counter()
        seqs = self.running
        n = len(seqs)
        dev = self.device
        cached = [s.cached for s in seqs]
        ids = torch.tensor([s.out[-1] for s in seqs], device=dev).unsqueeze(1)
        pos = torch.tensor(cached, device=dev)
        L = max(cached) + 1
        x = self._embed(ids)
        cos, sin = self._rotary(x, pos.unsqueeze(1))
        ar = torch.arange(n, device=dev)
        mask = (torch.arange(L, device=dev)[None, :] <= pos[:, None])[:, None, None, :]
        g = self.n_heads // self.n_kv
        for li, layer in enumerate(self._layers):
            h = self._norm_in(li, layer, x)
            if self._rope[li] is None:  # linear attention: one step of its recurrence
                x = x + self._linear.decode(li, h)
                x = x + self._mlp(li, layer, x)
                continue
            q, k, v = self._attn_qkv(li, h, cos, sin)
            K, V = self._k[li], self._v[li]
            K[ar, :, pos] = k[:, :, 0]
            V[ar, :, pos] = v[:, :, 0]
            # query heads of one KV group attend together: [n, kv, g, d] x [n, kv, L, d]
            qg = q.reshape(n, self.n_kv, g, self.head_dim)
            o = F.scaled_dot_product_attention(
                qg, K[:n, :, :L], V[:n, :, :L], attn_mask=mask, scale=self._scale[li]
            )
            x = self._attn_out(li, layer, x, o.reshape(n, 1, -1))
            x = x + self._mlp(li, layer, x)
        logits = self._lm_head(self._norm(x[:, 0]))
        for s in seqs:
            s.cached += 1
        self._sample(seqs, logits)
        self._last_step_s = time.perf_counter() - t0
        self._last_step_shape = (n, sum(cached) + n)
        self._steps += 1

    # ------------------------------------------------------------ sampling
    def _sample(self, seqs: list[_Seq], logits: torch.Tensor) -> None:
        logits = logits.float()
        dev = logits.device
        temps = torch.tensor([s.sampling.temperature for s in seqs], device=dev)
        greedy = temps == 0
        scaled = logits / torch.where(greedy, torch.ones_like(temps), temps)[:, None]
        logp = torch.log_softmax(scaled, dim=-1)
        tokens = logits.argmax(dim=-1)
        if not bool(greedy.all()):
            probs = logp.exp()
            top_p = torch.tensor([s.sampling.top_p for s in seqs], device=dev)
            if bool((top_p < 1).any()):
                sp, si = probs.sort(dim=-1, descending=True)
                drop = (sp.cumsum(-1) - sp) >= top_p[:, None]
                sp = sp.masked_fill(drop, 0.0)
                probs = torch.zeros_like(probs).scatter_(-1, si, sp)
            sampled = torch.multinomial(probs, 1, generator=self.gen)[:, 0]
            tokens = torch.where(greedy, tokens, sampled)
        chosen = logp.gather(1, tokens[:, None])[:, 0]
        for s, t, lp in zip(seqs, tokens.tolist(), chosen.tolist(), strict=True):
            s.out.append(t)
            s.logprobs.append(lp)
            s.version = self.version
            s.finish = self._done_reason(s)

    def _done_reason(self, s: _Seq) -> str | None:
        sp = s.sampling
        fresh = len(s.prompt) + len(s.out) > s.prefix_len  # last token generated here
        if fresh:
            t = s.out[-1]
            if t in sp.stop_token_ids or (not sp.ignore_eos and t in self.eos_ids):
                return "stop"
            if sp.stop and self.tokenizer is not None:
                tail = self.tokenizer.decode(s.out[-32:])
                if any(tail.endswith(x) for x in sp.stop):
                    return "stop"
        if len(s.out) >= sp.max_tokens or len(s.prompt) + len(s.out) >= self.max_len:
            return "length"
        return None

    def _finish(self, s: _Seq, reason: str) -> SeqResult:
        self._by_id.pop(s.seq_id, None)
        return self._result(s, reason)

    def _result(self, s: _Seq, reason: str) -> SeqResult:
        return SeqResult(
            seq_id=s.seq_id,
            prompt_ids=list(s.prompt),
            token_ids=list(s.out),
            logprobs=list(s.logprobs),
            finish_reason=reason,  # type: ignore[arg-type]
            version=s.version,
        )


def _norm(module, x: torch.Tensor) -> torch.Tensor:
    """An RMSNorm of the usual form (weight * x / rms, its epsilon `variance_epsilon`) as
    one fused op; any other norm (e.g. Gemma's 1 + weight) runs as its module."""
    eps = getattr(module, "variance_epsilon", None)
    if eps is not None and type(module).__name__.endswith("RMSNorm"):
        return F.rms_norm(x, (x.shape[-1],), module.weight, eps)
    return module(x)


def generate_all(
    engine: HFEngine, prompts: list[list[int]], sampling: SamplingParams, first_id: int = 0
) -> list[SeqResult]:
    """Convenience: run `prompts` to completion; results in prompt order."""
    for i, p in enumerate(prompts):
        engine.add(first_id + i, p, sampling=sampling)
    out: dict[int, SeqResult] = {}
    while engine.has_unfinished():
        for r in engine.step():
            out[r.seq_id] = r
    return [out[first_id + i] for i in range(len(prompts))]


def make_hf_engine(model_dir: str, *, device: str = "cpu", **kwargs) -> HFEngine:
    """The engine over the model in `model_dir` on `device` (HFEngine's keyword arguments:
    kv_capacity_tokens, max_batch, max_seq_len, prefill_chunk_tokens, num_threads, seed)."""
    from pivot_hpc.models.hf_load import load_hf_model
    from pivot_hpc.models.tokenizer import load_tokenizer

    model, weight_map = load_hf_model(model_dir)
    tok = load_tokenizer(model_dir)
    return HFEngine(
        model.to(device), eos_token_id=tok.eos_token_id, weight_map=weight_map, **kwargs
    )
