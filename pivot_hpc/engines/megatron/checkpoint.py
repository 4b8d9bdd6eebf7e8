"""The megatron engine's checkpoints (a part of MegatronTrainEngine, engines/megatron/
engine.py): megatron dist_checkpointing of the model and the optimizer state, with the
optimizer state (and fp32 master weights) sharded like the parameters they belong to, so a
checkpoint loads under another TP size too. The sharded optimizer writes the unsharded
one's format (whole parameters' state, each written by one replica): either optimizer
loads it, at any DP and TP. Loading goes through `data_only_loads`: a checkpoint from
someone else is data, never code.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist

from pivot_hpc.engines.megatron.sharded_adam import Owners, split

MASTER_KEY = "fp32_param"  # checkpoint key of the master weights (bf16 models only)
# checkpoint key → the sharded optimizer's kind (one checkpoint format for both optimizers)
CKPT_KINDS = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", MASTER_KEY: "master"}


class Checkpoints:
    """Save and load of one training rank (a mixin of MegatronTrainEngine; it uses the
    engine's model, parameters and OptimizerState)."""

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
