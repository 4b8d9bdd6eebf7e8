"""The megatron engine's optimizer state (a part of MegatronTrainEngine, engines/megatron/
engine.py): AdamW over the parameters, or over fp32 master copies of bf16 parameters, or
ZeRO-1 (engines/megatron/sharded_adam.py, `rl.trainer.distributed_optimizer`) — its step,
its offload to host memory and back (offloadable context, §5.2), and the state as
canonical tensors for GPS (a joining or restarted replica reads it there) or as this
rank's flat range of the sharded state (a rank keeps it for the child it restarts).

The engine provides: `params` (trainable parameters, in order), `_opt_params` (what AdamW
steps: the parameters or their masters), `_master`, `_zero`, `optimizer`, `_mixed`,
`_shapes`, `gpt`, `model_cfg`, `tp`, `tp_rank`, `tp_group`, `dp`, `dp_group`, `device`,
`_released` and `_canonical`; the state here lives in `_host_optimizer_state` and
`_host_master` while offloaded.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from pivot_hpc.engines.base import Tensors
from pivot_hpc.engines.megatron.convert import hf_to_megatron
from pivot_hpc.engines.megatron.sharded_adam import KINDS, Owners, split

OPT_MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's per-parameter state


class OptimizerState:
    """AdamW's state of one training rank (a mixin of MegatronTrainEngine)."""

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
        if not math.isfinite(grad_norm):  # skipped: AdamW would write NaN everywhere
            for q in self._opt_params:
                q.grad = None
            return grad_norm
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

    def _init_optimizer_state(self) -> None:
        for q in self._opt_params:
            if not self.optimizer.state.get(q):
                self.optimizer.state[q] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(q),
                    "exp_avg_sq": torch.zeros_like(q),
                }


def _to_host(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """A host copy of `t`: pinned and filled by an async copy on a GPU (the caller
    synchronizes once for all of them), a plain clone on CPU."""
    if not pin:
        return t.detach().clone()
    h = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
    h.copy_(t.detach(), non_blocking=True)
    return h
