"""The training world: the ranks that may train, where their torch.distributed world
meets, and how a replica that joins gets the training set's state.

- **Where it meets** (one place: `rendezvous` at start, `TrainingWorld.trainer_env` for
  each new generation of trainer children): always a file store nobody else can open, no
  TCP store listening on every interface, no port race. On one node a file in a private
  (0700) directory of world rank 0's, gloo/NCCL sockets on loopback; across nodes a file
  in RUN_DIR/.rendezvous (0700, on the run directory's shared filesystem). The
  collectives themselves then run over gloo/NCCL between the nodes, which authenticate
  nobody: a multi-node job trusts its cluster network (docs/guide/security.md).

Elastic training live (`planner.elastic_training`, docs/design.md §3): training's data
parallelism changes between steps.

- **The training world.** torch.distributed spans every worker that may ever train: the
  training set's GPUs first, then each extension slot's (`extension_slots`, the planner's
  own), so megatron's consecutive tensor-parallel groups are exactly the replicas. It is
  made once, at start; megatron's world-wide data-parallel group is never used.
- **A step's group.** The replicas of a step come with it (`Train.members`): each rank
  trains data parallel over the ranks at its tensor-parallel position in those replicas.
  Before a member set's first step every rank of the training world forms its groups
  (`FormGroups`; ranks outside a group return at once, so inference on them goes on), and
  the groups are kept as preserved context (§5.2). The planner picks which slots, not
  only how many, so the groups are the member sets the run uses, not every subset.
- **Joining.** A new replica reads the policy and the optimizer state from GPS: on request
  (`PublishOptimizer`) the training set writes AdamW's moments — and fp32 master weights
  when training in bf16 — as float32 models with the policy's architecture (the same
  canonical names and tensor-parallel cuts), at the policy version they belong to. The
  joiner waits for that version, loads it, and continues exactly where the others are;
  a replica that leaves discards its copy. With the sharded optimizer
  (`rl.trainer.distributed_optimizer`) the training set owns the whole state and a joiner
  takes none (`optimizer_kinds()` is empty: nothing is published or read): a replica that
  leaves must not take a shard with it, and a shift down never meets the set.
"""

from __future__ import annotations

import dataclasses
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from pivot_hpc.engines.base import STORE_ENV, Trainer
from pivot_hpc.gps import ModelSpec, Parallelism
from pivot_hpc.job.config import Config
from pivot_hpc.planner.snapshot import extension_slots

# GPS model of each kind of optimizer state (runtime/main.py registers them)
OPTIMIZER_MODELS = {
    "exp_avg": "policy.exp_avg",
    "exp_avg_sq": "policy.exp_avg_sq",
    "master": "policy.master",
}
TP1 = Parallelism(tp=1, pp=1, dp=1)


def optimizer_models(policy: ModelSpec, *, masters: bool) -> dict[str, ModelSpec]:
    """The GPS models that carry the optimizer state: the policy's architecture in
    float32, with fp32 master weights when `masters` (a trainer that may run in bf16)."""
    kinds = ["exp_avg", "exp_avg_sq", *(["master"] if masters else [])]
    return {
        OPTIMIZER_MODELS[k]: dataclasses.replace(policy, dtype="float32", name=OPTIMIZER_MODELS[k])
        for k in kinds
    }


def run_optimizer_models(cfg: Config, policy: ModelSpec) -> dict[str, ModelSpec]:
    """A run's optimizer-state models: with elastic training (a joiner reads them) or a
    training engine in a child process (`rl.trainer.process: child`: a restarted one
    reads them, runtime/worker.py); none with the sharded optimizer (the training set
    owns all of it; a joiner reads none). Masters wherever the trainer is not fixed to
    fp32 (every rank registers the same models, before it knows whether it sees a GPU)."""
    if not publishes_optimizer(cfg):
        return {}
    return optimizer_models(policy, masters=cfg.rl.trainer.dtype != "fp32")


def elastic_live(cfg: Config) -> bool:
    return cfg.planner.elastic_training and cfg.deployment.mode == "pivot"


def publishes_optimizer(cfg: Config) -> bool:
    """Whether the training set writes its optimizer state to GPS (`run_optimizer_models`)."""
    tr = cfg.rl.trainer
    return (elastic_live(cfg) or tr.process == "child") and not tr.distributed_optimizer


@dataclass(frozen=True)
class TrainingWorld:
    """The ranks that may train, in torch.distributed rank order, and the training set."""

    ranks: tuple[int, ...]  # world (MPI) ranks; torch rank = position
    base: tuple[int, ...]  # the training set's ranks (always in every step)
    tp: int

    @classmethod
    def of(cls, cfg: Config, rank_of_gpu) -> TrainingWorld:
        """From the config: the training set alone, or with elastic training every
        extension slot after it."""
        base_gpus = sorted(cfg.training_gpus())
        tp = cfg.rl.trainer.tp
        gpus = list(base_gpus)
        if elastic_live(cfg):
            slots = extension_slots(cfg.cluster.total_gpus, base_gpus, tp)
            gpus += [g for s in sorted(slots) for g in slots[s]]
        return cls(
            tuple(rank_of_gpu(g) for g in gpus), tuple(rank_of_gpu(g) for g in base_gpus), tp
        )

    @property
    def elastic(self) -> bool:
        return len(self.ranks) > len(self.base)

    def torch_rank(self, rank: int) -> int:
        return self.ranks.index(rank)

    def trainer_env(self, rank: int, *, child: bool, generation: int = 0) -> dict[str, str]:
        """The torch.distributed environment of world rank `rank`'s trainer
        (engines/factory.py `make_trainer`). In the rank: its RANK and WORLD_SIZE, meeting
        at the store `rendezvous` made. A trainer child, generation `generation` of them:
        alone, its own private store (nothing); else a new file beside the one `rendezvous`
        made (the last generation's children are all gone by then)."""
        env = {"RANK": str(self.torch_rank(rank)), "WORLD_SIZE": str(len(self.ranks))}
        if not child:
            return env
        if len(self.ranks) == 1:
            return {}
        env[STORE_ENV] = f"{os.environ[STORE_ENV]}.trainers{generation}"
        return env


RENDEZVOUS_DIR = ".rendezvous"  # in the run directory: the multi-node training stores


def rendezvous(comm, cfg: Config, run_dir: Path) -> None:
    """Where the training world meets at start, on every rank (runtime/main.py): a file
    store nobody else can open. On one node in a private directory of world rank 0's
    (gloo and NCCL on loopback); across nodes in a private (0700) directory of the run
    directory, which a multi-node job already shares — never a TCP store, which listens on
    every interface and lets whoever reaches a node take a rank's seat (issue 49 #3). Each
    launch meets at a new file (a file store's keys outlive a job that died)."""
    path = None
    if comm.Get_rank() == 0:
        if cfg.cluster.nodes == 1:
            from pivot_hpc.engines.megatron.model import private_store

            path = private_store()
        else:
            path = str(_shared_store_dir(run_dir) / f"train-{uuid.uuid4().hex}")
    os.environ[STORE_ENV] = comm.bcast(path)
    if cfg.cluster.nodes == 1:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")


def _shared_store_dir(run_dir: Path) -> Path:
    """RUN_DIR/.rendezvous, private, emptied of earlier launches' stores."""
    from pivot_hpc.private_dirs import ensure

    d = ensure(
        Path(run_dir) / RENDEZVOUS_DIR,
        "the training world's rendezvous directory",
        "remove it; the job makes it again, private",
        up_to=Path(run_dir),
    )
    for old in d.iterdir():  # (the run directory is this job's: no other launch uses it)
        if old.is_file() and not old.is_symlink():
            old.unlink(missing_ok=True)
    return d


def publish_optimizer(gps, trainer: Trainer, rank: int, writer: int, version: int) -> None:
    """Write the trainer's optimizer state to GPS at policy `version`. Called on the ranks
    of the training set's first replica (they gather over tensor parallelism together);
    `writer`, the first of them, writes."""
    state = trainer.optimizer_state()  # collective over the TP group
    if trainer.version != version or trainer.optimizer_step != trainer.steps:
        raise RuntimeError(
            f"optimizer state to publish at policy v{version}, but the trainer is at "
            f"v{trainer.version} after {trainer.steps} steps (optimizer step "
            f"{trainer.optimizer_step}): the training set and the coordinator disagree"
        )
    if rank != writer:
        return
    for kind, tensors in state.items():
        model = OPTIMIZER_MODELS[kind]
        if gps.version(model) >= version:
            continue  # already published for this version
        spec = gps.models[model]
        shards = {t.name: tensors[t.name].float().contiguous() for t in spec.tensors}
        gps.write(model, [rank], TP1, shards, version=version)


def read_optimizer(
    gps, trainer: Trainer, rank: int, version: int, timeout_s: float = 600.0
) -> None:
    """Wait until the optimizer state of policy `version` is in GPS and read it into the
    trainer (which must hold that policy)."""
    kinds = trainer.optimizer_kinds()
    t0 = time.monotonic()
    backoff = 1e-3
    while True:
        have = [gps.version(OPTIMIZER_MODELS[k]) for k in kinds]
        if all(v == version for v in have):
            break
        if any(v > version for v in have):
            raise RuntimeError(
                f"a training extension joins at policy v{version} but GPS holds optimizer "
                f"state of v{max(have)}: a step ran while it shifted up"
            )
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(
                f"a training extension waited {timeout_s:.0f} s for the optimizer state of "
                f"v{version} in GPS (published: {have}); the training set never wrote it"
            )
        time.sleep(backoff)
        backoff = min(2 * backoff, 0.01)
    state = {}
    for k in kinds:
        tensors, got = gps.read(OPTIMIZER_MODELS[k], [rank], TP1, device="cpu")
        if got != version:
            raise RuntimeError(f"read {OPTIMIZER_MODELS[k]} v{got}, expected v{version}")
        state[k] = tensors
    trainer.load_optimizer_state(state, step=version, version=version)
