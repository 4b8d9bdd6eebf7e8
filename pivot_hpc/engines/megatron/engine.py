"""The `megatron` TrainEngine: megatron-core GPTModel (local spec) trained with GRPO.

Model: `megatron/model.py build_gpt_model`, wrapped in megatron's DistributedDataParallel
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

`trainer.distributed_optimizer`: the optimizer is ZeRO-1 instead (engines/megatron/sharded_adam.py):
each data-parallel replica keeps masters and moments of 1/DP of the flattened parameters,
steps them after the gradient all-reduce (clipping by the full gradient's norm) and the
weights are all-gathered. Its checkpoint has the unsharded one's format (whole parameters'
state, each written by one replica): either optimizer loads it, at any DP and TP.

Elastic training (`planner.elastic_training`): `use_data_parallel` makes the next steps
data parallel over a group of replicas that changes between steps, and a replica that
joins takes the others' optimizer state in canonical form (`optimizer_state`,
`load_optimizer_state`; it travels through GPS, runtime/training_world.py). Sharded, a joiner
takes none (`optimizer_kinds` is empty): the replicas that hold the state — the training
set — own it all, re-split at each change of the group (`ShardedAdam.regroup`), so a
joiner may leave again without handing anything back.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist

from pivot_hpc.engines.base import Tensors, TrainBatch
from pivot_hpc.engines.megatron.checkpoint import Checkpoints
from pivot_hpc.engines.megatron.convert import hf_to_megatron, megatron_to_hf
from pivot_hpc.engines.megatron.model import (
    build_gpt_model,
    causal_mask,
    init_distributed,
    position_ids,
)
from pivot_hpc.engines.megatron.optimizer import OptimizerState
from pivot_hpc.engines.megatron.sharded_adam import ShardedAdam
from pivot_hpc.models.config import ModelConfig
from pivot_hpc.rl.config import GRPOConfig, TrainerConfig
from pivot_hpc.rl.grpo import resolve_loss, rollout_correction, sft_loss

log = logging.getLogger(__name__)

PAD_ID = 0


class MegatronTrainEngine(OptimizerState, Checkpoints):
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
            # masters and moments of 1/DP of the parameters here (engines/megatron/sharded_adam.py); under
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

    def load_weights(self, tensors: Tensors, *, masters: bool = True) -> None:
        """Canonical HF tensors → this rank's shard, copied into the parameters in place;
        and into the fp32 masters of a model that is not fp32 unless `masters` is False
        (the trainer's own masters are newer than any rounded copy of its weights)."""
        shard = hf_to_megatron(tensors, self.model_cfg, self.tp_rank, self.tp)
        own = dict(self.gpt.named_parameters())
        missing = set(own) - set(shard)
        if missing:
            raise KeyError(f"load_weights: no tensors for {sorted(missing)[:4]}…")
        index = {id(p): i for i, p in enumerate(self.params)}
        with torch.no_grad():
            if self._zero is not None and masters:  # my range's, in the source precision
                self._zero.load_master({index[id(p)]: shard[n].float() for n, p in own.items()})
            for name, p in own.items():
                p.copy_(shard[name].to(p.dtype))
                if self._master is not None and masters:
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
            if math.isfinite(grad_norm):
                self._zero.step(self.params, grads, lr=lr, scale=self._clip_scale(grad_norm))
        else:
            grad_norm = self._optimizer_step(lr)
        # A gradient norm that is not finite (the same on every replica: the gradients were
        # reduced) skips the optimizer step everywhere: the weights stay, a new policy
        # version is published as usual, the optimizer's step count does not advance.
        skipped = not math.isfinite(grad_norm)
        if skipped:
            log.warning(
                "training step %d: gradient norm %s is not finite: optimizer step skipped "
                "(weights unchanged)",
                self.version + 1,
                grad_norm,
            )
        else:
            self.steps += 1
        self.version += 1
        tok = max(sums.pop("tokens", 0.0), 1.0)
        metrics = {k.removesuffix("_sum"): v / tok for k, v in sums.items()}
        metrics.update(grad_norm=grad_norm, lr=lr, tokens=tok, sequences=float(len(batch)))
        metrics["skipped_nonfinite"] = float(skipped)
        metrics.update(mismatch)
        if batch.versions:
            metrics["staleness"] = sum(self.version - 1 - v for v in batch.versions) / len(batch)
        return metrics

    def use_data_parallel(self, group, size: int, rank: int) -> None:
        """Train the next steps data parallel over `group` — `size` replicas, this rank's
        being number `rank` — instead of megatron's data-parallel group (elastic training
        changes its replicas between steps; runtime/training_world.py builds the groups). `group`
        may be None when `size` is 1."""
        if size > 1 and group is None:
            raise ValueError("use_data_parallel: a group of more than one replica needs a group")
        self._explicit_dp = True
        self.dp_group, self.dp, self.dp_rank = group, size, rank
        if self._zero is not None:
            # collective over the group: the replicas holding the state own it, split anew
            self._zero.regroup(group if size > 1 else None, size, rank, self.params)

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

    def close(self) -> None:
        """Nothing to free before the process ends (its process groups are its world's)."""
