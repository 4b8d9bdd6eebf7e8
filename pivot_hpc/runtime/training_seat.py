"""A worker's training seat: the trainer of a rank that may train, through shifts, steps,
checkpoints and its own deaths.

- **Where the trainer runs** is the factory's choice (`rl.trainer.process`: in the rank or
  in a child, engines/factory.py `make_trainer`); the seat drives a SupervisedTrainer
  either way (engines/base.py) and branches on the config, never on the engine's class.
- **Shifts** (§5.2): down, the optimizer state is offloadable context (to host memory) and
  the parameters, on a GPU, are discarded (GPS holds them); up, both come back. An
  elastic extension discards its copy of the state on the way down and reads the
  training set's from GPS on the way up (runtime/training_world.py).
- **A step**: this rank's share of the batch (data parallel over the step's replicas),
  the KL reference's logprobs, the step, then the training set's first rank publishes the
  policy to GPS in the storage's dtype.
- **Trainer children that die** (`rl.trainer.process: child`): a death between steps is
  reported (`EngineFailed`) and the coordinator has every rank that may train replace its
  child together (`CheckTrainer`, `CloseTrainer`, `StartTrainer`, runtime/live_cluster.py),
  refit from GPS: the policy and the optimizer state the training set publishes after
  every step (sharded: each rank keeps its own child's range in its memory instead).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator

from pivot_hpc.engines.base import SupervisedTrainer
from pivot_hpc.runtime import protocol as msg
from pivot_hpc.runtime.training_world import (
    OPTIMIZER_MODELS,
    TP1,
    TrainingWorld,
    publish_optimizer,
    read_optimizer,
)

TEST_KILL_TRAINER_ENV = "PIVOT_HPC_TEST_KILL_TRAINER_AFTER_STEP"  # a test hook (see below)


class TrainingSeat:
    """The training role of world rank `rank` (a rank in `world.ranks`). `send` delivers an
    event to the coordinator. `active`: training is this rank's role right now."""

    def __init__(
        self,
        rank: int,
        gps,
        cfg,
        policy_dir,
        world: TrainingWorld,
        send: Callable[[msg.Event], None],
    ) -> None:
        self.rank = rank
        self.gps = gps
        self.cfg = cfg
        self.policy_dir = policy_dir
        self.world = world
        self.send = send
        self.training_ranks = list(world.base)
        # a rank of an elastic extension slot: trains only in the steps it is taken for
        self.extension = rank not in world.base
        self.child = cfg.rl.trainer.process == "child"
        self.sharded = cfg.rl.trainer.distributed_optimizer
        self.active = False
        self.trainer: SupervisedTrainer | None = None
        # the policy version whose weights (and fp32 masters) the trainer holds; None: none
        # yet (a trainer is built from the shape alone). A shift-up reads GPS only when
        # this is not the version to train from (DESIGN.md §3: preserved context)
        self.holds: int | None = None
        self.reference = None  # the KL reference: the frozen initial policy
        # trainer children are replaced together after a death: the generation names where
        # each new world meets; the step member sets formed so far are formed again in it
        self._generation = 0
        self._lost = False  # this rank's child died: reported, not yet replaced
        self._formed: list[tuple[int, ...]] = []
        # sharded optimizer: (policy version, this rank's child's range) (_publish_optimizer)
        self._optimizer_shard: tuple[int, dict] | None = None
        # tests: SIGKILL the trainer child right after this rank reports training step N
        # done (each N of "N[,M…]"; "N@R": on world rank R only), a death between steps
        self.test_kill_after = _kill_steps(os.environ.get(TEST_KILL_TRAINER_ENV, ""), rank)

    # ------------------------------------------------------------------ life
    def prepare(self) -> None:
        """Build the trainer (preserved context), shifted down; the KL reference."""
        self.trainer = self._make_trainer()
        self.trainer.offload_optimizer()
        if self.trainer.device.type == "cuda":
            # shifted down as a shift-down leaves it: the parameters come from GPS at the
            # first shift-up, and an inference engine that starts on this GPU first (pivot
            # mode starts every GPU rolling out) finds the memory free (issue 48)
            self.trainer.release_memory()
        if self.child and self.gps.version("policy") == self.trainer.version:
            self._publish_optimizer()  # (resumed: after the checkpoint's restore)
        if self.cfg.rl.grpo.kl_coef > 0:
            from pivot_hpc.models.zoo import load_model

            self.reference = load_model(self.policy_dir)[0]

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.close()

    def _make_trainer(self) -> SupervisedTrainer:
        from pivot_hpc.engines.factory import make_trainer
        from pivot_hpc.models.trainable import model_config_of_dir

        env = self.world.trainer_env(self.rank, child=self.child, generation=self._generation)
        return make_trainer(
            self.cfg,
            model_config_of_dir(self.policy_dir),  # the shape only: weights come from GPS
            world=(self.world.ranks, self.world.tp),
            rank=self.rank,
            world_env=env,
        )

    # ---------------------------------------------------------------- shifts
    def shift_up(self, version: int, leader: bool, phases: dict[str, float]) -> None:
        t0 = time.perf_counter()
        trainer = self.trainer
        if self._lost:
            pass  # its replacement is refit as training (start)
        elif self.extension:  # joins: the set's policy and optimizer
            trainer.resume_memory()
            self._load_policy(version)
            phases["read_s"] = time.perf_counter() - t0
            t1 = time.perf_counter()
            read_optimizer(self.gps, trainer, self.rank, version)
            phases["reload_s"] = time.perf_counter() - t1
        elif leader:
            released = trainer.memory_released
            trainer.resume_memory()  # (released at shift down on a GPU)
            trainer.reload_optimizer()
            phases["reload_s"] = time.perf_counter() - t0
            t1 = time.perf_counter()
            if self.holds != version:  # (new, or behind GPS: take all of it)
                self._load_policy(version)
            elif released:  # the parameters back from GPS; the masters are its own
                self._load_policy(version, masters=False)
            # else it holds the current version, fp32 masters included: nothing to read
            phases["read_s"] = time.perf_counter() - t1
        self.active = True

    def shift_down(self, phases: dict[str, float]) -> None:
        t0 = time.perf_counter()
        trainer = self.trainer
        if self._lost:
            pass  # its replacement is refit shifted down (start)
        elif self.extension:  # the set keeps the state
            trainer.discard_optimizer()
            if trainer.device.type == "cuda":
                trainer.release_memory()
            phases["discard_s"] = time.perf_counter() - t0
        else:
            trainer.offload_optimizer()
            phases["offload_s"] = time.perf_counter() - t0
            if trainer.device.type == "cuda":  # parameters come back from GPS
                t1 = time.perf_counter()
                trainer.release_memory()
                phases["discard_s"] = time.perf_counter() - t1
        self.active = False

    def _load_policy(self, version: int, *, masters: bool = True) -> None:
        """The trainer takes the policy from GPS; training must start from the latest.
        `masters=False`: the parameters only (the trainer keeps its fp32 masters)."""
        tensors, got = self.gps.read("policy", [self.rank], TP1, device="cpu")
        if got != version:
            raise RuntimeError(f"training read policy v{got} from GPS, expected v{version}")
        self.trainer.load_weights(tensors, masters=masters)
        self.holds = version

    # ------------------------------------------------------------------ steps
    def form_groups(self, members: tuple[int, ...]) -> None:
        """A step member set's data-parallel groups (collective over every rank that may
        train; a child that died forms them with its replacement)."""
        self._formed.append(members)
        if not self._lost:
            self.trainer.form_groups(members)

    def train(self, step: int, batch, members: tuple[int, ...] = ()) -> None:
        """One step: each data-parallel rank trains on its share of the batch (advantages
        were computed over whole groups by the coordinator); gradients are averaged over
        the step's replicas (elastic training: the members it was sent with)."""
        trainer = self.trainer
        if members:
            trainer.use_members(members)
        dp, d = trainer.dp, trainer.dp_rank
        if dp > 1:
            batch = shard(batch, d, dp)
        if self.reference is not None:
            from pivot_hpc.rl.grpo import reference_logprobs

            batch.ref_logprobs = reference_logprobs(
                self.reference, batch.prompt_ids, batch.response_ids, self.cfg.rl.grpo.temperature
            )
        metrics = trainer.train_step(batch)
        self.holds = trainer.version
        metrics.setdefault("loss", metrics.get("pg_loss", float("nan")))
        if self.extension:  # the training set publishes; an extension only trains
            self.send(msg.Trained(step, {**metrics, "version": None}))
            self._test_kill(step)
            return
        t0 = time.perf_counter()
        version = None
        # the training set's first replica gathers the canonical tensors (collective over
        # its TP group); the other replicas hold the same weights and make no copy
        if self.rank in self.training_ranks[: self.world.tp]:
            weights = trainer.export_weights()
        if self.rank == self.training_ranks[0]:  # one full copy suffices
            # in the storage's dtype, a tied lm_head left to the embedding (catalog.py)
            shards = self.gps.models["policy"].as_stored(weights)
            version = self.gps.write("policy", self.training_ranks[:1], TP1, shards)
        if self.child:  # what restarted trainer children read back
            self._publish_optimizer()
        metrics = {**metrics, "publish_s": time.perf_counter() - t0, "version": version}
        self.send(msg.Trained(step, metrics))
        self._test_kill(step)

    def publish_optimizer(self, version: int) -> None:
        """For extensions about to join (`PublishOptimizer`); children publish theirs after
        every step."""
        if not self.child:
            publish_optimizer(self.gps, self.trainer, self.rank, self.training_ranks[0], version)

    def _publish_optimizer(self) -> None:
        """The trainer children's optimizer state at their policy version (after each
        step, at start and after a restore), where restarted children read it back: GPS,
        gathered over tensor parallelism by the training set's first replica, its first
        rank writing. Sharded (rl.trainer.distributed_optimizer): no rank holds the whole
        state, and gathering it would undo the sharding; each rank of the training set
        keeps its own child's range in its own memory instead (`_optimizer_shard`: the
        rank outlives its child), 12 B per parameter over the data-parallel size."""
        if self.sharded:
            if not self.extension:  # (an extension owns no range)
                self._optimizer_shard = (self.trainer.version, self.trainer.optimizer_shard())
        elif self.rank in self.training_ranks[: self.world.tp]:
            writer = self.training_ranks[0]
            publish_optimizer(self.gps, self.trainer, self.rank, writer, self.trainer.version)

    def _test_kill(self, step: int) -> None:
        """The test hook (TEST_KILL_TRAINER_ENV): a trainer child's death between steps."""
        if self.child and step in self.test_kill_after:
            self.trainer.kill()

    # ------------------------------------------------------------ checkpoints
    @contextlib.contextmanager
    def _optimizer_loaded(self) -> Iterator[None]:
        """The parameters and optimizer state in the trainer (where save/load find them),
        released and offloaded again afterwards if they were (a shifted-down trainer keeps
        its optimizer in host memory and, on a GPU, its parameters only in GPS)."""
        trainer = self.trainer
        released = trainer.memory_released
        if released:
            trainer.resume_memory()
            tensors, _ = self.gps.read("policy", [self.rank], TP1, device="cpu")
            # the parameters back; the training set's masters are its own (offloaded), an
            # extension discarded its state and takes the policy's
            trainer.load_weights(tensors, masters=self.extension)
        offloaded = trainer.optimizer_offloaded
        trainer.reload_optimizer()
        yield
        if offloaded:
            trainer.offload_optimizer()
        if released:
            trainer.release_memory()

    def save(self, path: str) -> None:
        """The megatron distributed checkpoint (model + optimizer) under `path`/train
        (collectively over the ranks that may train)."""
        with self._optimizer_loaded():
            self.trainer.save(os.path.join(path, "train"))

    def restore(self, path: str) -> None:
        with self._optimizer_loaded():
            self.trainer.load(os.path.join(path, "train"))
        self.holds = self.trainer.version  # the checkpoint's weights and masters
        if self.child:
            self._publish_optimizer()  # at the checkpoint's version

    # ------------------------------------------------- trainer children's deaths
    def check(self) -> None:
        """A trainer child found dead between steps (the 0.5 s health check, or the start
        of a command) is reported to the coordinator (`EngineFailed`; it stops the job if
        one dies again within deployment.engine_restart_window_s). The coordinator asks
        every rank that may train before the next step, save or restore, and has them all
        replace their children then (runtime/live_cluster.py `_replace_lost_trainers`).
        Until then a shift leaves this one alone: its replacement is refit as the shift
        left the role. A death inside a call (a step, a save) is the call's
        EngineProcessError: the rank fails and the job stops, as it would with the
        trainer in the rank."""
        if self.trainer is None or self._lost or not self.trainer.dead:
            return
        self._lost = True
        self.send(msg.EngineFailed("training", str(self.trainer.death()), 0, 0, 0))

    @property
    def alive(self) -> bool:
        """`CheckTrainer`'s answer: no death reported that was not replaced yet."""
        return not self._lost

    def close_for_replacement(self) -> None:
        """`CloseTrainer`: end this generation's child."""
        self.trainer.close()
        self._lost = True  # gone on purpose: no death to report

    def start(self, generation: int) -> None:
        """A new trainer child in the world of `generation` (every rank that may train
        starts one at once, after all closed theirs), with the step groups formed so far,
        refit from GPS as the role needs it: the current policy and the optimizer state
        published with it on the training set, and on an extension that is training now;
        an extension that is not reads them when it next joins, as always. A survivor's
        own state was that same state (the set's gradients are averaged), so the world
        trains on from exactly where it was."""
        t0 = time.perf_counter()
        self._generation = generation
        self.trainer = trainer = self._make_trainer()
        self.holds = None  # (set by what it is refit with below)
        for members in self._formed:
            trainer.form_groups(members)
        version = self.gps.version("policy")
        if self.sharded and not self.extension:
            kept = None if self._optimizer_shard is None else self._optimizer_shard[0]
            if kept != version:
                raise RuntimeError(
                    f"a training engine process died but this rank kept its optimizer range "
                    f"of policy v{kept}, not of v{version}: it cannot be restarted; run the "
                    "same command to resume from the last checkpoint"
                )
            self._load_policy(version)
            trainer.load_optimizer_shard(self._optimizer_shard[1], version=version)
        elif not self.extension or self.active:
            # (sharded: an extension training now holds no state, as when it joined)
            have = {
                k: self.gps.version(OPTIMIZER_MODELS[k])
                for k in trainer.optimizer_kinds()
                if k != "master"
            }
            if any(v != version for v in have.values()):
                raise RuntimeError(
                    f"a training engine process died but GPS holds the optimizer state of "
                    f"{have}, not of policy v{version}: it cannot be restarted; run the same "
                    "command to resume from the last checkpoint"
                )
            self._load_policy(version)
            read_optimizer(self.gps, trainer, self.rank, version, timeout_s=5.0)
        if not self.active:  # shifted down: as a shift-down (or, on an extension, start) leaves it
            trainer.offload_optimizer()
            if trainer.device.type == "cuda":
                trainer.release_memory()
        self._lost = False
        self.send(msg.TrainerStarted(time.perf_counter() - t0))


def _kill_steps(spec: str, rank: int) -> set[int]:
    """The steps after which the trainer-kill test hook fires on world rank `rank`:
    "N[,M…]", each N on every training rank or "N@R" on rank R only."""
    steps = set()
    for item in filter(None, spec.split(",")):
        step, _, on = item.partition("@")
        if not on or int(on) == rank:
            steps.add(int(step))
    return steps


def shard(batch, d: int, dp: int):
    """Rows d, d+dp, d+2dp, … of a TrainBatch (data-parallel rank d of dp), every
    per-sequence field (the loss mask too) picked alike (`TrainBatch.rows`)."""
    return batch.rows(range(d, len(batch), dp))
