"""The `megatron` TrainEngine: megatron-core GPTModel (local spec) trained with GRPO.

Model: `megatron_model.build_gpt_model`, wrapped in megatron's DistributedDataParallel
(gradients land in contiguous fp32 `main_grad` buffers, reduced over data parallelism).
Optimizer: a plain torch AdamW (megatron's own optimizer hard-codes CUDA and its
distributed optimizer does not run on CPU; docs/platform.md), so CPU and GPU run one code path.
With fp32 parameters (the CPU default) it steps the parameters themselves; with bf16
parameters (the GPU default, `trainer.dtype`) it steps fp32 master copies and casts them
back after each step, as megatron's mixed-precision optimizer does. The gradient norm is
computed tensor-parallel aware. On a GPU the process group is NCCL and the optimizer
state (moments and master weights) offloads to pinned host memory. Checkpoints: megatron
dist_checkpointing, with the optimizer state (and master weights) sharded like the
parameters they belong to, so a checkpoint loads under another TP size too.

`trainer.distributed_optimizer`: the optimizer is ZeRO-1 instead (engines/sharded_adam.py):
each data-parallel replica keeps masters and moments of 1/DP of the flattened parameters,
steps them after the gradient all-reduce (clipping by the full gradient's norm) and the
weights are all-gathered. Its checkpoint has the unsharded one's format (whole parameters'
state, each written by one replica): either optimizer loads it, at any DP and TP.

Elastic training (`planner.elastic_training`): `use_data_parallel` makes the next steps
data parallel over a group of replicas that changes between steps, and a replica that
joins takes the others' optimizer state in canonical form (`optimizer_state`,
`load_optimizer_state`; it travels through GPS, runtime/elastic.py). Sharded, a joiner
takes none (`optimizer_kinds` is empty): the replicas that hold the state — the training
set — own it all, re-split at each change of the group (`ShardedAdam.regroup`), so a
joiner may leave again without handing anything back.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pivot_hpc.engines.base import Tensors, TrainBatch
from pivot_hpc.engines.convert import hf_to_megatron, megatron_to_hf
from pivot_hpc.engines.megatron_model import (
    build_gpt_model,
    causal_mask,
    init_distributed,
    position_ids,
)
from pivot_hpc.engines.sharded_adam import KINDS, Owners, ShardedAdam, split
from pivot_hpc.models.config import ModelConfig
from pivot_hpc.rl.config import GRPOConfig, TrainerConfig
from pivot_hpc.rl.grpo import resolve_loss, rollout_correction, sft_loss

PAD_ID = 0
MASTER_KEY = "fp32_param"  # checkpoint key of the master weights (bf16 models only)
OPT_MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's per-parameter state
# checkpoint key → the sharded optimizer's kind (one checkpoint format for both optimizers)
CKPT_KINDS = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", MASTER_KEY: "master"}


class MegatronTrainEngine:
    """One training rank. All ranks of the training group construct it and call every
    method collectively (tensor-parallel collectives run inside)."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        trainer: TrainerConfig | None = None,
        grpo: GRPOConfig | None = None,
        *,
        max_response_tokens: int | None = None,
    ) -> None:
        """`max_response_tokens`: the response limit (the constant of the
        "seq-mean-token-sum-norm" loss aggregation, which needs it)."""
        from megatron.core import parallel_state
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
        )

        self.model_cfg = model_cfg
        self.cfg = trainer or TrainerConfig()
        self.grpo = grpo or GRPOConfig()
        self.loss_fn = resolve_loss(self.grpo.loss_fn)  # pluggable (rl.grpo.loss_fn)
        if self.grpo.loss_agg_mode == "seq-mean-token-sum-norm" and not max_response_tokens:
            raise ValueError("seq-mean-token-sum-norm needs max_response_tokens (its constant)")
        self.max_response_tokens = max_response_tokens
        init_distributed(self.cfg.tp, seed=self.cfg.seed, timeout_s=self.cfg.collective_timeout_s)
        self.dtype = self.cfg.resolved_dtype(cuda=torch.cuda.is_available())
        self.tp = parallel_state.get_tensor_model_parallel_world_size()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.dp = parallel_state.get_data_parallel_world_size()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self._explicit_dp = False  # use_data_parallel: our group, our gradient reduction
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.cfg.seed)
            gpt = build_gpt_model(
                model_cfg,
                self.tp,
                self.dtype,
                attention=self.cfg.attention,
                recompute=self.cfg.recompute,
            )
        self.model = DistributedDataParallel(
            config=gpt.config,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False
            ),
            module=gpt,
        )
        self.gpt = gpt
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self._shapes = [p.shape for p in self.params]
        self._mixed = any(p.dtype != torch.float32 for p in self.params)  # fp32 masters
        self.device = self.params[0].device
        hyper = dict(
            lr=self.cfg.lr,
            betas=tuple(self.cfg.betas),
            eps=self.cfg.eps,
            weight_decay=self.cfg.weight_decay,
        )
        # fp32 master weights when the model is not fp32 (same order as self.params, which
        # the checkpoint's optimizer-state sharding relies on)
        self._master: list[torch.Tensor] | None = None
        self._zero: ShardedAdam | None = None  # rl.trainer.distributed_optimizer
        self.optimizer: torch.optim.AdamW | None = None
        if self.cfg.distributed_optimizer:
            # masters and moments of 1/DP of the parameters here (sharded_adam.py); under
            # megatron's data parallelism every replica owns a range
            numels = [p.numel() for p in self.params]
            self._zero = ShardedAdam(numels, **hyper, device=self.device, masters=self._mixed)
            self._zero.own(self._all_own(self.dp, self.dp_group), self.dp_rank, self.params)
            self._opt_params = self.params
        else:
            if self._mixed:
                self._master = [p.detach().float().clone() for p in self.params]
            self._opt_params = self._master if self._master is not None else self.params
            self.optimizer = torch.optim.AdamW(self._opt_params, **hyper)
        self.version = 0
        self.steps = 0
        self._host_optimizer_state: dict | None = None
        self._host_master: list[torch.Tensor] | None = None
        self._released: list[tuple[torch.nn.Parameter, torch.Size]] | None = None

    # ----------------------------------------------------------------- weights
    def load_weights(self, tensors: Tensors) -> None:
        """Canonical HF tensors → this rank's shard, copied into the parameters in place."""
        shard = hf_to_megatron(tensors, self.model_cfg, self.tp_rank, self.tp)
        own = dict(self.gpt.named_parameters())
        missing = set(own) - set(shard)
        if missing:
            raise KeyError(f"load_weights: no tensors for {sorted(missing)[:4]}…")
        index = {id(p): i for i, p in enumerate(self.params)}
        with torch.no_grad():
            if self._zero is not None:  # masters of my range, in the source precision
                self._zero.load_master({index[id(p)]: shard[n].float() for n, p in own.items()})
            for name, p in own.items():
                p.copy_(shard[name].to(p.dtype))
                if self._master is not None:
                    # masters take the source precision, not the bf16-rounded parameter
                    i = index[id(p)]
                    src = shard[name].float()
                    if self.optimizer_offloaded:
                        self._host_master[i].copy_(src)
                    elif self._master[i].numel() != p.numel():  # discarded (discard_optimizer)
                        self._master[i].data = src.to(self.device, copy=True)
                    else:
                        self._master[i].copy_(src)

    def export_weights(self) -> Tensors:
        """Canonical HF tensors on every rank (shards all-gathered over tensor parallelism)."""
        return self._canonical({k: v.detach() for k, v in self.gpt.named_parameters()})

    def _canonical(self, own: dict[str, torch.Tensor]) -> Tensors:
        """Megatron-named tensors shaped like this rank's parameters → canonical HF tensors
        (gathered over tensor parallelism; collective over the TP group)."""
        if self.tp == 1:
            return megatron_to_hf([{k: v.cpu() for k, v in own.items()}], self.model_cfg)
        shards: list[Tensors] = [{} for _ in range(self.tp)]
        for name, t in own.items():
            # gathered where the parameters live: NCCL moves device tensors only
            t = t.to(self.device)
            parts = [torch.empty_like(t) for _ in range(self.tp)]
            dist.all_gather(parts, t.contiguous(), group=self.tp_group)
            for r in range(self.tp):
                shards[r][name] = parts[r].cpu()
        return megatron_to_hf(shards, self.model_cfg)

    def forward_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits [b, s, V] (gathered over TP) — for conversion checks."""
        self.model.eval()
        with torch.no_grad():
            b, s = ids.shape
            logits = self.model(
                ids.to(self.device), position_ids(b, s, self.device), causal_mask(s, self.device)
            )
            if self.tp > 1:
                parts = [torch.empty_like(logits) for _ in range(self.tp)]
                dist.all_gather(parts, logits.contiguous(), group=self.tp_group)
                logits = torch.cat(parts, dim=-1)
        return logits.float().cpu()

    # ------------------------------------------------------------ log-probs
    def _pack(
        self, batch: TrainBatch, rows: range, rollout: list[list[float]] | None = None
    ) -> dict[str, torch.Tensor]:
        """Right-padded tokens, next-token labels, a mask on response positions that carry
        loss (`batch.loss_tokens`: none for a truncated sequence when `batch.truncated`
        says so, none on tool-observation tokens), and with `rollout` the rollout engine's
        logprobs (mismatch correction)."""
        seqs = [batch.prompt_ids[i] + batch.response_ids[i] for i in rows]
        s = max(len(x) for x in seqs)
        b = len(seqs)
        ids = torch.full((b, s), PAD_ID, dtype=torch.long)
        labels = torch.full((b, s), PAD_ID, dtype=torch.long)
        mask = torch.zeros(b, s)
        old = torch.zeros(b, s)
        ref = torch.zeros(b, s)
        ro = torch.zeros(b, s)
        for j, i in enumerate(rows):
            seq = seqs[j]
            p, r = len(batch.prompt_ids[i]), len(batch.response_ids[i])
            ids[j, : len(seq)] = torch.tensor(seq)
            labels[j, : len(seq) - 1] = torch.tensor(seq[1:])
            # position t predicts token t+1: response tokens are predicted at p-1 … p+r-2
            mask[j, p - 1 : p + r - 1] = torch.tensor(batch.loss_tokens(i), dtype=mask.dtype)
            if rollout is not None:
                ro[j, p - 1 : p + r - 1] = torch.tensor(rollout[i][:r])
            if batch.old_logprobs is not None:
                old[j, p - 1 : p + r - 1] = torch.tensor(batch.old_logprobs[i][:r])
            if batch.ref_logprobs is not None:
                ref[j, p - 1 : p + r - 1] = torch.tensor(batch.ref_logprobs[i][:r])
        adv = torch.tensor([batch.advantages[i] for i in rows]) if batch.advantages else None
        out = {"ids": ids, "labels": labels, "mask": mask, "old": old, "ref": ref, "rollout": ro}
        if adv is not None:
            out["adv"] = adv
        return {k: v.to(self.device) for k, v in out.items()}

    def _logprobs(
        self, ids: torch.Tensor, labels: torch.Tensor, temperature: float
    ) -> torch.Tensor:
        from megatron.core import tensor_parallel

        b, s = ids.shape
        logits = self.model(ids, position_ids(b, s, self.device), causal_mask(s, self.device))
        logits = logits.float()
        if temperature != 1.0:
            logits = logits / temperature
        # [b, s, V/tp] → [s, b, V/tp]: megatron's layout; the op edits its input in place.
        ce = tensor_parallel.vocab_parallel_cross_entropy(
            logits.transpose(0, 1).contiguous(), labels.transpose(0, 1).contiguous()
        )
        return -ce.transpose(0, 1)

    def _micro_batches(self, n: int) -> Iterator[range]:
        mb = self.cfg.micro_batch_size
        for start in range(0, n, mb):
            yield range(start, min(n, start + mb))

    def compute_logprobs(
        self, batch: TrainBatch, temperature: float | None = None
    ) -> list[list[float]]:
        """Per-token logprobs of each response under the current weights."""
        t = self.grpo.temperature if temperature is None else temperature
        self.model.eval()
        out: list[list[float]] = []
        with torch.no_grad():
            for rows in self._micro_batches(len(batch)):
                packed = self._pack(batch, rows)
                lp = self._logprobs(packed["ids"], packed["labels"], t).cpu()
                for j, i in enumerate(rows):
                    p, r = len(batch.prompt_ids[i]), len(batch.response_ids[i])
                    out.append(lp[j, p - 1 : p + r - 1].tolist())
        return out

    # ------------------------------------------------------------ training
    def _global_counts(
        self, batch: TrainBatch, keep: list[torch.Tensor] | None = None
    ) -> tuple[float, float]:
        """(loss tokens, sequences with any) over the whole batch, all data-parallel ranks.
        `keep`: per sequence, which response tokens still carry loss (masked IS). Tool
        observations are not loss tokens: they never dilute the generated tokens' loss."""
        tokens = seqs = 0.0
        for i in range(len(batch)):
            if batch.truncated and batch.truncated[i]:
                continue
            k = float(keep[i].sum()) if keep is not None else float(sum(batch.loss_tokens(i)))
            tokens += k
            seqs += 1.0 if k > 0 else 0.0
        n = torch.tensor([tokens, seqs], dtype=torch.float64, device=self.device)
        if self.dp > 1:
            dist.all_reduce(n, group=self.dp_group)
        return float(n[0].item()), float(n[1].item())

    def _reduce_gradients(self) -> None:
        """Data-parallel gradient reduction: megatron's own over its data-parallel group,
        or with `use_data_parallel` the same arithmetic (scale by 1/dp, then sum) over the
        step's group — so a step over the same replicas gives the same update."""
        if not self._explicit_dp:
            self.model.finish_grad_sync()
            return
        if self.dp == 1:
            return
        for buf in self.model.buffers + self.model.expert_parallel_buffers:
            buf.grad_data.mul_(1.0 / self.dp)
            dist.all_reduce(buf.grad_data, group=self.dp_group)

    def _mismatch(
        self, batch: TrainBatch, trainer_old: list[list[float]]
    ) -> tuple[dict[str, float], list[torch.Tensor] | None]:
        """Rollout/trainer mismatch over this rank's loss tokens (metrics), and for masked
        IS which tokens keep their loss."""
        g = self.grpo
        rows = [i for i in range(len(batch)) if not (batch.truncated and batch.truncated[i])]
        old = [torch.tensor(trainer_old[i]) for i in range(len(batch))]  # as _pack packs
        ro = [torch.tensor(batch.old_logprobs[i][: len(old[i])]) for i in range(len(batch))]
        # generated tokens only: an observation's rollout logprob is a 0.0 placeholder
        on = [torch.tensor(batch.loss_tokens(i), dtype=old[i].dtype) for i in range(len(batch))]
        cat = torch.cat([old[i] for i in rows]) if rows else torch.zeros(0)
        cat_ro = torch.cat([ro[i] for i in rows]) if rows else torch.zeros_like(cat)
        cat_on = torch.cat([on[i] for i in rows]) if rows else torch.zeros_like(cat)
        _, _, metrics = rollout_correction(
            cat,
            cat_ro,
            cat_on,
            g.rollout_is,
            g.rollout_is_threshold,
            g.rollout_is_threshold_lower,
        )
        keep = None
        if g.rollout_is == "mask":
            keep = [
                rollout_correction(
                    old[i],
                    ro[i],
                    on[i],
                    "mask",
                    g.rollout_is_threshold,
                    g.rollout_is_threshold_lower,
                )[1]
                for i in range(len(batch))
            ]
        return metrics, keep

    def _grad_norm(self, grads: list[torch.Tensor | None]) -> float:
        """L2 norm of the full (unsharded) gradient: TP-sharded parts summed over ranks."""
        # accumulated on the parameters' device: NCCL reduces device tensors only
        sharded = torch.zeros(1, dtype=torch.float64, device=self.device)
        replicated = torch.zeros(1, dtype=torch.float64, device=self.device)
        for p, g in zip(self.params, grads, strict=True):
            if g is None:
                continue
            sq = g.detach().double().pow(2).sum()
            if getattr(p, "tensor_model_parallel", False):
                sharded += sq
            else:
                replicated += sq
        if self.tp > 1:
            dist.all_reduce(sharded, group=self.tp_group)
        return float((sharded + replicated).sqrt().item())

    def _clip_scale(self, grad_norm: float) -> float | None:
        clip = self.cfg.grad_clip
        if clip > 0 and math.isfinite(grad_norm) and grad_norm > clip:
            return clip / (grad_norm + 1e-6)
        return None

    def _optimizer_step(self, lr: float) -> float:
        """The unsharded AdamW step over every parameter; returns the gradient norm."""
        for p, q in zip(self.params, self._opt_params, strict=True):
            q.grad = p.main_grad.to(q.dtype) if p.main_grad.dtype != q.dtype else p.main_grad
        grad_norm = self._grad_norm([q.grad for q in self._opt_params])
        scale = self._clip_scale(grad_norm)
        if scale is not None:
            for q in self._opt_params:
                q.grad.mul_(scale)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        if self._master is not None:
            with torch.no_grad():
                for p, m in zip(self.params, self._master, strict=True):
                    p.copy_(m)
        for q in self._opt_params:
            q.grad = None
        return grad_norm

    def _lr(self) -> float:
        w = self.cfg.warmup_steps
        return self.cfg.lr * min(1.0, (self.steps + 1) / w) if w > 0 else self.cfg.lr

    def train_step(self, batch: TrainBatch, loss: str = "grpo") -> dict[str, float]:
        """One optimizer step. loss="grpo": PPO-clip with `batch.advantages` against
        `batch.old_logprobs` (the rollout's); loss="sft": NLL of the responses."""
        if loss not in ("grpo", "sft"):
            raise ValueError(f"train_step: loss={loss!r}; valid: 'grpo', 'sft'")
        if loss == "grpo" and (batch.old_logprobs is None or not batch.advantages):
            raise ValueError("train_step(grpo): the batch needs advantages and old_logprobs")
        if self.optimizer_offloaded:
            self.reload_optimizer()
        g = self.grpo
        rollout = keep = None
        mismatch: dict[str, float] = {}
        if loss == "grpo" and g.recompute_old_logprobs:
            # the old policy as the trainer sees it (weights before this update): the PPO
            # ratio's denominator; the rollout's logprobs only measure/correct the mismatch
            trainer_old = self.compute_logprobs(batch)
            mismatch, keep = self._mismatch(batch, trainer_old)
            rollout = batch.old_logprobs
            batch = dataclasses.replace(batch, old_logprobs=trainer_old)
        self.model.train()
        self.model.zero_grad_buffer()
        total, total_seqs = self._global_counts(batch, keep)
        # megatron's DDP averages gradients over data-parallel ranks; scale back so the
        # loss is a mean over the global batch (tokens or sequences, per loss_agg_mode).
        norm, seq_norm = total / self.dp, total_seqs / self.dp
        sums: dict[str, float] = {}
        for rows in self._micro_batches(len(batch)):
            pk = self._pack(batch, rows, rollout)
            is_w = None
            if rollout is not None and loss == "grpo":
                is_w, pk["mask"], _ = rollout_correction(
                    pk["old"],
                    pk["rollout"],
                    pk["mask"],
                    g.rollout_is,
                    g.rollout_is_threshold,
                    g.rollout_is_threshold_lower,
                )
            temp = g.temperature if loss == "grpo" else 1.0
            lp = self._logprobs(pk["ids"], pk["labels"], temp)
            if loss == "sft":
                value = sft_loss(lp, pk["mask"], normalizer=norm)
                parts = {"nll_sum": -(lp.detach() * pk["mask"]).sum(), "tokens": pk["mask"].sum()}
            else:
                value, parts = self.loss_fn(
                    lp,
                    pk["old"],
                    pk["adv"],
                    pk["mask"],
                    clip_low=g.clip_low,
                    clip_high=g.clip_high,
                    dual_clip=g.dual_clip,
                    kl_coef=g.kl_coef,
                    ref_logprobs=pk["ref"] if batch.ref_logprobs is not None else None,
                    normalizer=norm,
                    loss_agg_mode=g.loss_agg_mode,
                    seq_normalizer=seq_norm,
                    horizon=self.max_response_tokens,
                    is_weights=is_w,
                )
            value.backward()
            for k, v in parts.items():
                sums[k] = sums.get(k, 0.0) + float(v)
        self._reduce_gradients()
        lr = self._lr()
        if self._zero is not None:
            # every replica has the full reduced gradient: the norm (and clipping) is the
            # unsharded one; each owner steps its range and the weights are all-gathered
            grads = [p.main_grad for p in self.params]
            grad_norm = self._grad_norm(grads)
            self._zero.step(self.params, grads, lr=lr, scale=self._clip_scale(grad_norm))
        else:
            grad_norm = self._optimizer_step(lr)
        self.steps += 1
        self.version += 1
        tok = max(sums.pop("tokens", 0.0), 1.0)
        metrics = {k.removesuffix("_sum"): v / tok for k, v in sums.items()}
        metrics.update(grad_norm=grad_norm, lr=lr, tokens=tok, sequences=float(len(batch)))
        metrics.update(mismatch)
        if batch.versions:
            metrics["staleness"] = sum(self.version - 1 - v for v in batch.versions) / len(batch)
        return metrics

    # ---------------------------------------------- elastic data parallelism
    def use_data_parallel(self, group, size: int, rank: int) -> None:
        """Train the next steps data parallel over `group` — `size` replicas, this rank's
        being number `rank` — instead of megatron's data-parallel group (elastic training
        changes its replicas between steps; runtime/elastic.py builds the groups). `group`
        may be None when `size` is 1."""
        if size > 1 and group is None:
            raise ValueError("use_data_parallel: a group of more than one replica needs a group")
        self._explicit_dp = True
        self.dp_group, self.dp, self.dp_rank = group, size, rank
        if self._zero is not None:
            # collective over the group: the replicas holding the state own it, split anew
            self._zero.regroup(group if size > 1 else None, size, rank, self.params)

    def _param_names(self) -> list[str]:
        """Megatron names of self.params, in their order."""
        names = {id(p): n for n, p in self.gpt.named_parameters()}
        return [names[id(p)] for p in self.params]

    def _all_own(self, size: int, group) -> Owners:
        """Every replica of a `size`-way group owns a range (megatron's own data parallelism)."""
        ranges = tuple(split(self._zero.layout.total, size))
        return Owners(group if size > 1 else None, tuple(range(size)), ranges)

    @property
    def optimizer_elements(self) -> int:
        """Optimizer-state elements (moments and fp32 masters) held on this rank."""
        if self._zero is not None:
            return self._zero.elements
        n = sum(
            t.numel() for st in self.optimizer.state.values() for k, t in st.items() if k != "step"
        )
        return n + sum(m.numel() for m in self._master or [])

    def optimizer_kinds(self) -> tuple[str, ...]:
        """The kinds of optimizer state `optimizer_state` returns: none with the sharded
        optimizer, whose joining replicas own no range and so need none of it."""
        if self._zero is not None:
            return ()
        return ("exp_avg", "exp_avg_sq", "master") if self._master is not None else OPT_MOMENTS

    def optimizer_state(self) -> dict[str, Tensors]:
        """AdamW's moments ("exp_avg", "exp_avg_sq") and, for a model that is not fp32, the
        fp32 master weights ("master") as canonical HF tensors, wherever they are (device,
        or host memory while offloaded); a parameter never stepped has zero moments, as
        AdamW would create them. Collective over the TP group (shards are gathered);
        `optimizer_step` is the step count they belong to. Sharded: nothing (a joiner takes
        no state; `full_optimizer_state` gathers it)."""
        if self._zero is not None:
            return {}
        names = {id(p): n for n, p in self.gpt.named_parameters()}
        # (parameters released to GPS keep their shapes here)
        shapes = {id(p): shape for p, shape in self._released or []}
        host = self._host_optimizer_state
        out: dict[str, dict[str, torch.Tensor]] = {k: {} for k in self.optimizer_kinds()}
        for i, (p, q) in enumerate(zip(self.params, self._opt_params, strict=True)):
            st = (host.get(id(q)) if host is not None else self.optimizer.state.get(q)) or {}
            name = names[id(p)]
            for k in OPT_MOMENTS:
                v = st.get(k)
                zero = torch.zeros(shapes.get(id(p), p.shape), dtype=torch.float32)
                out[k][name] = (v if v is not None else zero).detach()
            if self._master is not None:
                master = self._host_master[i] if self._host_master is not None else self._master[i]
                out["master"][name] = master.detach()
        # (host copies stay on the host: `_canonical` moves one tensor at a time where
        # NCCL needs it, so a training set shifted down does not crowd the GPU's new role)
        return {k: self._canonical(v) for k, v in out.items()}

    def full_optimizer_state(self) -> dict[str, Tensors]:
        """`optimizer_state`'s canonical tensors of the whole state, sharded or not
        (collective over the data-parallel and TP groups) — for checks and tools."""
        if self._zero is None:
            return self.optimizer_state()
        flat = self._zero.gather()
        names = self._param_names()
        offsets = self._zero.layout.offsets
        kinds = ("exp_avg", "exp_avg_sq", *(["master"] if self._mixed else []))
        out = {}
        for kind in kinds:
            own = {
                names[i]: flat[kind][offsets[i] : offsets[i + 1]].view(self._shapes[i])
                for i in range(len(self.params))
            }
            out[kind] = self._canonical(own)
        return out

    @property
    def optimizer_step(self) -> int:
        """AdamW's step count (every parameter has the same; 0 before the first step)."""
        if self._zero is not None:
            return self._zero.step_count
        host = self._host_optimizer_state
        states = host.values() if host is not None else self.optimizer.state.values()
        steps = {int(st["step"].item()) for st in states if "step" in st}
        if len(steps) > 1:
            raise RuntimeError(f"parameters have different optimizer steps {steps}")
        return steps.pop() if steps else 0

    def load_optimizer_state(self, state: dict[str, Tensors], *, step: int, version: int) -> None:
        """Take the state another data-parallel replica published (`optimizer_state`'s
        canonical tensors, AdamW step `step`, policy `version`): a replica that joins the
        step continues exactly where the others are. Parameters come from `load_weights`."""
        missing = set(self.optimizer_kinds()) - set(state)
        if missing:
            raise KeyError(f"load_optimizer_state: no {sorted(missing)}")
        if self._zero is not None:
            self._load_sharded_state(state, step)
            self.steps = step
            self.version = version
            return
        shards = {
            k: hf_to_megatron(state[k], self.model_cfg, self.tp_rank, self.tp)
            for k in self.optimizer_kinds()
        }
        names = {id(p): n for n, p in self.gpt.named_parameters()}
        self._host_optimizer_state = self._host_master = None
        self.optimizer.state.clear()
        with torch.no_grad():
            for i, (p, q) in enumerate(zip(self.params, self._opt_params, strict=True)):
                name = names[id(p)]
                if self._master is not None:
                    master = shards["master"][name]
                    self._master[i].data = master.to(self.device, torch.float32, copy=True)
                self.optimizer.state[q] = {
                    # AdamW keeps a non-capturable step as a CPU float32 scalar
                    "step": torch.tensor(float(step)),
                    **{k: shards[k][name].to(q.device, q.dtype, copy=True) for k in OPT_MOMENTS},
                }
        self.steps = step
        self.version = version

    def optimizer_shard(self) -> dict[str, Any]:
        """The sharded optimizer's state this rank holds (`rl.trainer.distributed_optimizer`:
        its flat range [lo, hi) of every kind, on the host, and the AdamW step), for its
        rank to keep while the engine runs in a child process (runtime/worker.py): what a
        child started again after a death takes back (`load_optimizer_shard`)."""
        if self._zero is None:
            raise RuntimeError("optimizer_shard: the optimizer is not sharded")
        lo, hi, step, state = self._zero.own_range()
        return {"lo": lo, "hi": hi, "step": step, "state": state}

    def load_optimizer_shard(self, shard: dict[str, Any], *, version: int) -> None:
        """Hold `optimizer_shard`'s state again at policy `version` (parameters come from
        `load_weights`; the masters of a bf16 model from the shard, exactly)."""
        if self._zero is None:
            raise RuntimeError("load_optimizer_shard: the optimizer is not sharded")
        self._zero.restore_range(shard["lo"], shard["hi"], shard["step"], shard["state"])
        self.steps = shard["step"]
        self.version = version

    def _load_sharded_state(self, state: dict[str, Tensors], step: int) -> None:
        """Sharded: with the moments given, hold the whole state until the next
        `use_data_parallel` keeps what this replica then owns; without (the runtime's
        joiner, `optimizer_kinds` being empty) hold none — the training set owns it."""
        if not all(k in state for k in OPT_MOMENTS):
            self._zero.discard(step)
            return
        names = self._param_names()
        flat = {}
        for kind in KINDS:
            if kind == "master" and "master" not in state:  # fp32 model: its weights
                shard = {n: p.detach() for n, p in self.gpt.named_parameters()}
            else:
                shard = hf_to_megatron(state[kind], self.model_cfg, self.tp_rank, self.tp)
            flat[kind] = torch.cat([shard[n].reshape(-1).float() for n in names])
        self._zero.hold_full(flat, step)

    def discard_optimizer(self) -> None:
        """Drop the optimizer state (a replica leaving elastic training: the others keep
        it, and it takes theirs again when it rejoins)."""
        if self._zero is not None:
            self._zero.discard()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            return
        self.optimizer.state.clear()
        self._host_optimizer_state = self._host_master = None
        if self._master is not None:
            for m in self._master:
                m.data = torch.empty(0, dtype=m.dtype, device=m.device)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ------------------------------------------------------ optimizer offload
    def offload_optimizer(self) -> None:
        """Optimizer state (Adam moments, fp32 master weights) → host memory; the device
        copies are freed and, on a GPU, returned to the driver so another role's process
        can use the memory. On a GPU the host copies are pinned and written by async copies
        (one synchronize at the end), so reload is a full-bandwidth DMA."""
        if self._zero is not None:
            self._zero.offload(pin=self.device.type == "cuda")
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            return
        if self._host_optimizer_state is not None:
            return
        pin = self.device.type == "cuda"
        host: dict = {}
        for q in self._opt_params:
            st = self.optimizer.state.get(q)
            if not st:
                continue
            host[id(q)] = {k: _to_host(v, pin) if torch.is_tensor(v) else v for k, v in st.items()}
        if self._master is not None:
            self._host_master = [_to_host(m, pin) for m in self._master]
        if pin:
            torch.cuda.synchronize(self.device)
        if self._master is not None:
            for m in self._master:  # same tensor object: the optimizer keeps its key
                m.data = torch.empty(0, dtype=m.dtype, device=m.device)
        self.optimizer.state.clear()
        self._host_optimizer_state = host
        if pin:
            torch.cuda.empty_cache()

    def reload_optimizer(self) -> None:
        if self._zero is not None:
            self._zero.reload()
            return
        host = self._host_optimizer_state
        if host is None:
            return
        pin = self.device.type == "cuda"
        if self._master is not None and self._host_master is not None:
            for m, h in zip(self._master, self._host_master, strict=True):
                m.data = h.to(self.device, non_blocking=pin, copy=True)
        for q in self._opt_params:
            if id(q) in host:
                # AdamW keeps `step` on the CPU (non-capturable); moments live with q
                self.optimizer.state[q] = {
                    k: v.to(q.device if k != "step" else v.device, non_blocking=pin, copy=True)
                    if torch.is_tensor(v)
                    else v
                    for k, v in host[id(q)].items()
                }
        if pin:
            torch.cuda.synchronize(self.device)  # the pinned sources may be freed now
        self._host_optimizer_state = None
        self._host_master = None

    @property
    def optimizer_offloaded(self) -> bool:
        if self._zero is not None:
            return self._zero.offloaded
        return self._host_optimizer_state is not None

    # ------------------------------------------------- parameters off the device
    def release_memory(self) -> None:
        """Parameters and gradient buffers off the device while training is shifted down:
        GPS holds the published weights and `load_weights` refills them after
        `resume_memory` (the optimizer state has its own offload). On a GPU the memory goes
        back to the driver, so the inference engine that shifts up next (SGLang sizes its
        KV pool from the memory free at its start) finds it free."""
        if self._released is not None:
            return
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        self._released = [(p, p.shape) for p in self.model.parameters()]
        for p, _ in self._released:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        for buf in self.model.buffers + self.model.expert_parallel_buffers:
            buf.offload_to_cpu(move_params=False, move_grads=True)  # views stay valid
        if cuda:
            torch.cuda.empty_cache()

    def resume_memory(self) -> None:
        """Re-allocate what `release_memory` freed (contents undefined until
        `load_weights`; gradients zero)."""
        if self._released is None:
            return
        for p, shape in self._released:
            p.data = torch.empty(shape, dtype=p.dtype, device=p.device)
        for buf in self.model.buffers + self.model.expert_parallel_buffers:
            buf.reload_from_cpu(move_params=False, move_grads=True)
        self._released = None

    @property
    def memory_released(self) -> bool:
        return self._released is not None

    # ------------------------------------------------------------ checkpoints
    def _init_optimizer_state(self) -> None:
        for q in self._opt_params:
            if not self.optimizer.state.get(q):
                self.optimizer.state[q] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(q),
                    "exp_avg_sq": torch.zeros_like(q),
                }

    def _sharded_state_dict(self) -> dict:
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            optim_state_to_sharding_state,
        )

        if self._zero is not None:
            return self._zero_state_dict(load=False)
        self.reload_optimizer()
        self._init_optimizer_state()
        model_sd = self.gpt.sharded_state_dict()
        id_map = get_param_id_to_sharded_param_map(model_sd, self.params)
        opt_sd = self.optimizer.state_dict()
        step = self.optimizer_step
        if self._master is not None:
            # master weights travel as one more per-parameter optimizer tensor, sharded
            # like the parameter (state ids are positions in self.params)
            for i, m in enumerate(self._master):
                opt_sd["state"][i] = {**opt_sd["state"][i], MASTER_KEY: m}
        optim_state_to_sharding_state(opt_sd, id_map, exclude_keys=("step",))
        return {
            "model": model_sd,
            "optimizer": opt_sd,
            "engine": {
                "optimizer_step": step,
                "steps": self.steps,
                "version": self.version,
            },
        }

    def _zero_state_dict(self, *, load: bool) -> dict:
        """The sharded optimizer's checkpoint, in the unsharded one's format (per-parameter
        tensors sharded like the parameters: any DP, any TP, either optimizer loads it).
        Saving, each parameter's state is assembled on the owner of its first element and
        written by it alone; loading, each owner reads the parameters its range touches."""
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            optim_state_to_sharding_state,
        )

        z = self._zero
        keys = [k for k in CKPT_KINDS if k != MASTER_KEY or self._mixed]
        if load:
            state = {
                i: {k: torch.empty(self._shapes[i], device=self.device) for k in keys}
                for i in z.needed()
            }
        else:
            state = {
                i: {k: parts[CKPT_KINDS[k]].view(self._shapes[i]) for k in keys}
                for i, parts in z.assemble(key=self.tp_rank).items()
            }
        groups = torch.optim.AdamW([torch.empty(1)], **z.hyper).state_dict()["param_groups"]
        groups[0]["params"] = list(range(len(self.params)))
        opt_sd = {"state": state, "param_groups": groups}
        model_sd = self.gpt.sharded_state_dict()
        id_map = get_param_id_to_sharded_param_map(model_sd, self.params)
        optim_state_to_sharding_state(opt_sd, id_map, exclude_keys=("step",))
        for i, st in opt_sd["state"].items():
            # the owner of a parameter's first element is its main replica (saves it alone;
            # megatron checks that each element has one); others read a piece of it
            dp = 0 if not load or z.first_owner_is_me(i) else 1
            for k, sh in st.items():
                rid = sh.replica_id  # (pipeline, tensor, data parallel) coordinates
                st[k] = dataclasses.replace(
                    sh, replica_id=(*rid[:-1], dp) if isinstance(rid, tuple) else dp
                )
        return {
            "model": model_sd,
            "optimizer": opt_sd,
            "engine": {
                "optimizer_step": z.step_count,
                "steps": self.steps,
                "version": self.version,
                # how many replicas own the state, and whether they were a step's group
                # (elastic: the training set, the first replicas) — see `_zero_load_layout`
                "optimizer_owners": z.saved_owners,
                "optimizer_elastic": self._explicit_dp,
            },
        }

    def _zero_load_layout(self, path: Path) -> None:
        """Who owns what after a load: every replica of the current group, except when the
        checkpoint comes from elastic training, where its owners were the training set —
        the first replicas of the training world, which then own it again (a resumed run
        starts under megatron's world-wide group; extension replicas own nothing)."""
        from megatron.core import dist_checkpointing

        from pivot_hpc.checkpoint.safe_pickle import data_only_loads

        with data_only_loads(path):
            engine = dist_checkpointing.load_common_state_dict(str(path)).get("engine", {})
        n = self.dp
        if engine.get("optimizer_elastic"):
            n = min(n, int(engine.get("optimizer_owners", n)))
        group = self.dp_group if self.dp > 1 else None
        owners = Owners(group, tuple(range(n)), tuple(split(self._zero.layout.total, n)))
        self._zero.own(owners, self.dp_rank if self.dp_rank < n else None, self.params)

    def _zero_load(self, path: Path, state: dict) -> None:
        opt = state.get("optimizer", {}).get("state", {})  # (none on a replica owning none)
        sources = {}
        for i in self._zero.needed():
            st = opt[i]
            master = st.get(MASTER_KEY)
            sources[i] = {
                "master": (master if master is not None else self.params[i].detach()).float(),
                "exp_avg": st["exp_avg"],
                "exp_avg_sq": st["exp_avg_sq"],
            }
        self._zero.fill(sources, int(state["engine"]["optimizer_step"]))

    def save(self, path: str | Path) -> None:
        """Megatron distributed checkpoint of model + optimizer (collective)."""
        from megatron.core import dist_checkpointing

        _in_process_write_results()
        path = Path(path)
        if dist.get_rank() == 0:
            path.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(self._sharded_state_dict(), str(path))
        dist.barrier()

    def load(self, path: str | Path) -> None:
        from megatron.core import dist_checkpointing

        from pivot_hpc.checkpoint.safe_pickle import data_only_loads

        path = Path(path)
        if self._zero is not None:
            self._zero_load_layout(path)
            template = self._zero_state_dict(load=True)
        else:
            template = self._sharded_state_dict()
        with data_only_loads(path):  # a checkpoint from someone else is data, never code
            state = dist_checkpointing.load(template, str(path))
        missing, _ = self.gpt.load_state_dict(state["model"], strict=False)
        real_missing = [k for k in missing if not k.endswith("_extra_state")]
        if real_missing:
            raise KeyError(f"checkpoint {path} lacks {real_missing[:4]}")
        if self._zero is not None:
            self._zero_load(path, state)
            self.steps = int(state["engine"]["steps"])
            self.version = int(state["engine"]["version"])
            return
        opt = state["optimizer"]
        step = torch.tensor(float(state["engine"]["optimizer_step"]))
        for i, st in opt["state"].items():
            st["step"] = step.clone()
            master = st.pop(MASTER_KEY, None)
            if self._master is not None:
                with torch.no_grad():
                    src = master if master is not None else self.params[i]
                    self._master[i].copy_(src.to(self._master[i].device, torch.float32))
        self.optimizer.load_state_dict(opt)
        self.steps = int(state["engine"]["steps"])
        self.version = int(state["engine"]["version"])


def _to_host(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """A host copy of `t`: pinned and filled by an async copy on a GPU (the caller
    synchronizes once for all of them), a plain clone on CPU."""
    if not pin:
        return t.detach().clone()
    h = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
    h.copy_(t.detach(), non_blocking=True)
    return h


def _in_process_write_results() -> None:
    """megatron-core's filesystem writer (0.16, `strategies/filesystem_async.py`) returns a
    save's write results through a queue it creates on first use with a *spawn* context
    multiprocessing Manager: a fresh interpreter, started at the first checkpoint in the
    middle of the run (3 s on a loaded node, every training step waiting) and living on
    beside the rank. We never save asynchronously, so that queue's only writer and reader is
    this process: an in-process queue does the same job. Left alone if megatron-core no
    longer has that module global."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", False) is None:
        filesystem_async._results_queue = queue.Queue()
