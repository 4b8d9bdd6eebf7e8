"""A worker rank: serves coordinator commands and steps the engine of its current role.

Role shifting follows the four context categories of §5.2:
- temporary (KV cache): discarded on shift down, re-allocated lazily on shift up;
- parameters: discarded on shift down, Read from GPS on shift up;
- offloadable (optimizer state): offloaded to host memory on shift down, reloaded on up;
- preserved (the engine objects, torch.distributed groups): kept across shifts.
Each phase is timed and reported with the shift.

An idle worker polls with exponential back-off (1 ms → 5 ms) instead of a blocking
receive, which OpenMPI implements by spinning a core. The cap bounds how long a shift
command waits for an idle worker (a shift's own phases take milliseconds on CPU).
"""

from __future__ import annotations

import contextlib
import os
import time
import traceback
from typing import Any

import torch
from mpi4py import MPI

from pivot_hpc.engines.base import TrainEngine
from pivot_hpc.runtime import protocol as msg
from pivot_hpc.runtime import stop
from pivot_hpc.runtime.decode_steps import DecodeSteps
from pivot_hpc.runtime.elastic import (
    OPTIMIZER_MODELS,
    TrainingWorld,
    publish_optimizer,
    read_optimizer,
)
from pivot_hpc.runtime.engine_guard import GuardedEngine
from pivot_hpc.runtime.protocol import CMD, EVT

LENGTHS_EVERY_S = 0.5
TEST_KILL_TRAINER_ENV = "PIVOT_HPC_TEST_KILL_TRAINER_AFTER_STEP"  # a test hook (see Worker)
IDLE_POLL_MAX_S = 0.005
ROLES = ("rollout", "reward")


class Worker:
    def __init__(self, comm, gps, cfg, policy_dir, genrm_dir, world: TrainingWorld) -> None:
        self.comm = comm
        self.gps = gps
        self.cfg = cfg
        self.dirs = {"rollout": policy_dir, "reward": genrm_dir}
        self.world = world  # the ranks that may train (elastic training: beyond the set)
        self.training_ranks = list(world.base)
        rank = comm.Get_rank()
        # a rank of an elastic extension slot: trains only in the steps it is taken for
        self.extension = rank in world.ranks and rank not in world.base
        self.step_groups = world.step_groups()
        # rl.trainer.process: child — the training world's children are replaced together
        # after a death (the coordinator's CheckTrainer/CloseTrainer/StartTrainer); the
        # generation names where each new world meets, and the step member sets formed so
        # far are formed again in it, in order (elastic training)
        self._trainer_generation = 0
        self._trainer_lost = False  # this rank's child died: reported, not yet replaced
        self._formed: list[tuple[int, ...]] = []
        # sharded optimizer: (policy version, this rank's child's range) (_publish_optimizer)
        self._optimizer_shard: tuple[int, dict] | None = None
        self.engines: dict[str, Any] = {}
        self.trainer: TrainEngine | None = None
        self.reference = None
        self.role: str | None = None
        self.leader = True  # False: a non-leading rank of a tp > 1 inference replica
        self._last_lengths = 0.0
        self._last_health = 0.0  # engine processes checked (engine_guard.py)
        self._steps = DecodeSteps()  # for the monitor's A–D refit
        self._sending: list = []  # requests of events not yet received (see send)
        self.fault = os.environ.get("PIVOT_HPC_FAULT")  # tests: "<command>[@rank]" raises
        # tests: seconds added to every decode step, so that sequences are still running
        # when a test signals or kills the job
        self.decode_delay_s = float(os.environ.get("PIVOT_HPC_DECODE_DELAY_S", "0"))
        # tests: SIGKILL the trainer child (rl.trainer.process: child) right after this
        # rank reports training step N done (each N of "N[,M…]"; "N@R": on world rank R
        # only), a death between steps (TEST_KILL_TRAINER_ENV)
        self.test_kill_trainer_after = _kill_steps(
            os.environ.get(TEST_KILL_TRAINER_ENV, ""), comm.Get_rank()
        )

    def yield_to_coordinator(self) -> None:
        """Where a node has fewer cores than ranks (a CPU workstation), workers run at a
        lower priority: the coordinator's short, latency-bound work (dispatch, shifts)
        then does not queue behind engine steps. No effect where cores are not shared."""
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        if cores is not None and cores < self.cfg.cluster.ranks_per_node:
            os.nice(5)

    def prepare(self) -> None:
        """Build the preserved context once: both engines (weights released until a shift
        up reads them from GPS) and, on training ranks, the trainer and its process group.

        Exception: an `sglang` engine is built by a replica's leader at its first shift up
        to the role (the other ranks of a tp > 1 replica lend it their GPUs), and SGLang
        keeps its configuration process-wide, so a worker holds one SGLang engine at a
        time: shifting up to the other sglang role closes it (a cold start, reported in
        the shift's reload phase). Tells the coordinator when it is done (`Ready`)."""
        t0 = time.perf_counter()
        # GPU engines are built by replica leaders only, at their first shift up
        self.lazy_roles = {r for r in ROLES if getattr(self.cfg.engines, r).engine != "hf"}
        for role in ROLES:
            if role in self.lazy_roles:
                continue
            engine = self.engines[role] = self._make_engine(role)
            engine.release_memory(weights=True)
        if self.comm.Get_rank() in self.world.ranks:
            self.trainer = self._make_trainer()
            self.trainer.offload_optimizer()
            if self.extension and self.trainer.device.type == "cuda":
                self.trainer.release_memory()  # GPS holds what it reads when it joins
            if self._child_trainer and self.gps.version("policy") == self.trainer.version:
                self._publish_optimizer()  # (resumed: after the checkpoint's restore)
            if self.cfg.rl.grpo.kl_coef > 0:  # KL reference: the frozen initial policy
                from pivot_hpc.models.zoo import load_model

                self.reference = load_model(self.dirs["rollout"])[0]
        self.send(msg.Ready(time.perf_counter() - t0))

    # ----------------------------------------------------------------- loop
    def serve(self) -> int:
        """Serve until the coordinator says stop; returns the exit code it sends."""
        backoff = 1e-3
        while True:
            busy = False
            while self.comm.Iprobe(source=0, tag=CMD):
                cmd = self.comm.recv(source=0, tag=CMD)
                if isinstance(cmd, msg.Stop):
                    self.send(msg.Stopped())  # the coordinator drains up to this one,
                    MPI.Request.Waitall(self._sending)  # so every send completes
                    child = self._trainer_process()
                    if child is not None:
                        child.close()  # (it would die with the rank: see ChildTrainer)
                    return cmd.code
                self.handle(cmd)
                self._report_failures()
                busy = True
            engine = self.engines.get(self.role) if self.role in ROLES and self.leader else None
            if engine is not None and engine.has_unfinished():
                before = self._decode_steps(engine)
                done = engine.step()
                if self.decode_delay_s:
                    time.sleep(self.decode_delay_s)
                if done:
                    self.send(msg.Finished(done))
                self._steps.record(engine.stats(), before)
                now = time.monotonic()
                if now - self._last_lengths > LENGTHS_EVERY_S:
                    self._last_lengths = now
                    if isinstance(engine, GuardedEngine):
                        engine.stream()  # the tokens a death would keep (engine_guard.py)
                    self.send(msg.Lengths(engine.seq_lengths(), self._steps.take()))
                busy = True
            else:
                self._steps.idle()
            now = time.monotonic()
            if now - self._last_health > LENGTHS_EVERY_S:
                self._last_health = now
                for e in self.engines.values():
                    if isinstance(e, GuardedEngine):
                        e.check()  # a process gone between calls (an idle role's too)
                self._check_trainer()
            self._report_failures()
            if busy:
                backoff = 1e-3
            else:
                time.sleep(backoff)
                backoff = min(backoff * 2, IDLE_POLL_MAX_S)

    def _report_failures(self) -> None:
        """Engine processes found dead: tell the coordinator once each. It migrates a
        serving replica's sequences with their kept tokens and restarts it; an idle role's
        engine is dropped here and a fresh one starts at its next shift-up."""
        for role, engine in list(self.engines.items()):
            failure = getattr(engine, "failure", None)
            if failure is None or engine.reported:
                continue
            engine.reported = True
            self.send(
                msg.EngineFailed(
                    role, failure.cause, failure.sequences, failure.tokens_kept, failure.tokens_lost
                )
            )
            if role != self.role or not self.leader:
                self.engines.pop(role).close()

    @staticmethod
    def _decode_steps(engine) -> int:
        return engine.stats().steps

    def send(self, event: msg.Event) -> None:
        """Non-blocking (a large `Finished` would otherwise wait for a busy coordinator);
        MPI keeps the order of this rank's messages."""
        self._sending.append(self.comm.isend(event, dest=0, tag=EVT))
        if len(self._sending) > 64:
            self._sending = [r for r in self._sending if not r.Test()]

    # ------------------------------------------------------------- commands
    def handle(self, cmd: msg.Command) -> None:
        self._check_trainer()  # a trainer child dead between steps: reported first
        kind = type(cmd).__name__.lower()  # PIVOT_HPC_FAULT names it so: "train", "save", …
        if self.fault and self.fault.split("@")[0] == kind:
            target = self.fault.partition("@")[2]
            if not target or int(target) == self.comm.Get_rank():
                raise RuntimeError(f"injected fault on {kind!r} (PIVOT_HPC_FAULT)")
        match cmd:
            case msg.ShiftUp(role, version, leader):
                self.shift_up(role, version, leader)
            case msg.ShiftDown():
                self.shift_down()
            case msg.Start(seq_id, prompt, generated, logprobs, sampling):
                engine = self.engines[self.role]
                engine.add(seq_id, prompt, generated or None, sampling, logprobs or None)
                self._steps.added = True
            case msg.Abort(seq_ids):
                self.send(msg.Aborted({s: self._abort(s) for s in seq_ids}))
            case msg.UpdateWeights():
                t0 = time.perf_counter()
                rank = [self.comm.Get_rank()]
                engine = self.engines["rollout"]
                tensors, version = self.gps.read(
                    "policy", rank, _tp1(), device=engine.weights_device
                )
                engine.load_weights(tensors, version)
                self.send(msg.WeightsLoaded(version, time.perf_counter() - t0))
            case msg.Train(step, batch, members):
                self.train(step, batch, members)
            case msg.FormGroups(members):
                if self._child_trainer:  # the groups live in the children's world
                    self._formed.append(members)
                    if not self._trainer_lost:  # (else formed with its replacement)
                        self._trainer_process().form_groups(members)
                else:
                    self.step_groups.form(members, self.comm.Get_rank())
            case msg.PublishOptimizer(version):
                if not self._child_trainer:  # (children publish theirs after every step)
                    rank = self.comm.Get_rank()
                    writer = self.training_ranks[0]
                    publish_optimizer(self.gps, self.trainer, rank, writer, version)
            case msg.Peek():  # checkpoint: tokens of the running sequences, undisturbed
                engine = self.engines.get(self.role) if self.role in ROLES and self.leader else None
                self.send(msg.Peeked(self.role, engine.snapshot() if engine is not None else []))
            case msg.Save(path):
                self.save(path)
            case msg.Restore(path):
                self.restore(path)
            case msg.CheckTrainer():
                self.send(msg.TrainerChecked(not self._trainer_lost))
            case msg.CloseTrainer():
                self._trainer_process().close()
                self._trainer_lost = True  # gone on purpose: no death to report
                self.send(msg.TrainerClosed(self._next_world_address()))
            case msg.StartTrainer(generation, address):
                self._start_trainer(generation, address)
            case _:
                raise ValueError(f"worker: unknown command {cmd!r}")

    def _abort(self, seq_id: int):
        try:
            return self.engines[self.role].abort(seq_id)
        except KeyError:
            return None  # finished before the abort arrived: already reported

    def shift_up(self, role: str, version: int, leader: bool = True) -> None:
        phases: dict[str, float] = {}
        t0 = time.perf_counter()
        self.leader = leader  # (a non-leader's GPU serves the replica leader's engine)
        if role == "training" and self._trainer_lost:
            pass  # its replacement is refit as training (_start_trainer)
        elif role == "training" and self.extension:  # joins: the set's policy and optimizer
            self.trainer.resume_memory()
            self._load_policy_to_train(version)
            phases["read_s"] = time.perf_counter() - t0
            t1 = time.perf_counter()
            read_optimizer(self.gps, self.trainer, self.comm.Get_rank(), version)
            phases["reload_s"] = time.perf_counter() - t1
        elif leader and role == "training":
            self.trainer.resume_memory()  # (released at shift down on a GPU)
            self.trainer.reload_optimizer()
            phases["reload_s"] = time.perf_counter() - t0
            t1 = time.perf_counter()
            self._load_policy_to_train(version)
            phases["read_s"] = time.perf_counter() - t1
        elif leader:
            if role not in self.engines:  # lazily built, or restarted after a death
                for other in [r for r in self.engines if r != role and r in self.lazy_roles]:
                    if getattr(self.cfg.engines, other).engine == "sglang":
                        self.engines.pop(other).close()  # one SGLang engine per process
                if torch.cuda.is_initialized():  # blocks cached here count as used for
                    torch.cuda.empty_cache()  # SGLang, which sizes its pool from what is free
                self.engines[role] = self._start_engine(role)
                self.engines[role].release_memory(weights=True)
            engine = self.engines[role]
            engine.resume_memory()
            self._steps.reset()
            phases["reload_s"] = time.perf_counter() - t0
            t1 = time.perf_counter()
            if not getattr(engine, "dead", False):  # (a dead one is reported after this)
                model = "policy" if role == "rollout" else "genrm"
                rank = [self.comm.Get_rank()]  # straight into the engine's memory (VRAM on GPU)
                tensors, got = self.gps.read(model, rank, _tp1(), device=engine.weights_device)
                if model == "policy" and got < version:
                    raise RuntimeError(
                        f"rollout read policy v{got} from GPS, expected >= v{version}"
                    )
                engine.load_weights(tensors, got)
            phases["read_s"] = time.perf_counter() - t1
        self.role = role
        self.send(msg.Shifted("up", phases))

    def _load_policy_to_train(self, version: int) -> None:
        """The trainer takes the policy from GPS; training must start from the latest."""
        tensors, got = self.gps.read("policy", [self.comm.Get_rank()], _tp1(), device="cpu")
        if got != version:
            raise RuntimeError(f"training read policy v{got} from GPS, expected v{version}")
        self.trainer.load_weights(tensors)

    def shift_down(self) -> None:
        self._steps.reset()
        t0 = time.perf_counter()
        phases: dict[str, float] = {}
        if self.role == "training" and self._trainer_lost:
            pass  # its replacement is refit shifted down (_start_trainer)
        elif self.role == "training" and self.extension:  # the set keeps the state
            self.trainer.discard_optimizer()
            if self.trainer.device.type == "cuda":
                self.trainer.release_memory()
            phases["discard_s"] = time.perf_counter() - t0
        elif self.role == "training":
            self.trainer.offload_optimizer()
            phases["offload_s"] = time.perf_counter() - t0
            if self.trainer.device.type == "cuda":  # parameters come back from GPS
                t1 = time.perf_counter()
                self.trainer.release_memory()
                phases["discard_s"] = time.perf_counter() - t1
        elif self.role is not None and self.leader:
            engine = self.engines[self.role]
            if getattr(engine, "dead", False):  # the next shift-up starts a fresh process
                self.engines.pop(self.role).close()
            else:
                engine.release_memory(weights=True)
            phases["discard_s"] = time.perf_counter() - t0
        self.role = None
        self.send(msg.Shifted("down", phases))

    def train(self, step: int, batch, members: tuple[int, ...] = ()) -> None:
        # data parallelism: each DP rank trains on its share of the batch (advantages were
        # computed over whole groups by the coordinator); gradients are averaged over the
        # step's replicas (elastic training: the members it was sent with)
        if members and self._child_trainer:
            self._trainer_process().use_members(members)
        elif members:
            self.trainer.use_data_parallel(*self.step_groups.of(members))
        dp, d = self.trainer.dp, self.trainer.dp_rank
        if dp > 1:
            batch = shard(batch, d, dp)
        if self.reference is not None:
            from pivot_hpc.rl.grpo import reference_logprobs

            batch.ref_logprobs = reference_logprobs(
                self.reference, batch.prompt_ids, batch.response_ids, self.cfg.rl.grpo.temperature
            )
        metrics = self.trainer.train_step(batch)
        metrics.setdefault("loss", metrics.get("pg_loss", float("nan")))
        if self.extension:  # the training set publishes; an extension only trains
            self.send(msg.Trained(step, {**metrics, "version": None}))
            self._test_kill_trainer(step)
            return
        t0 = time.perf_counter()
        weights = self.trainer.export_weights()  # full canonical tensors (gathered over TP)
        version = None
        if self.comm.Get_rank() == self.training_ranks[0]:  # one full copy suffices
            # in the storage's dtype (a bf16 trainer publishes into an fp32 policy)
            spec = self.gps.models["policy"]
            dtypes = {t.name: getattr(torch, t.dtype) for t in spec.tensors}
            shards = {k: v.detach().to(dtypes[k]).contiguous() for k, v in weights.items()}
            version = self.gps.write("policy", self.training_ranks[:1], _tp1(), shards)
        if self._child_trainer:  # what restarted trainer children read back
            self._publish_optimizer()
        metrics = {**metrics, "publish_s": time.perf_counter() - t0, "version": version}
        self.send(msg.Trained(step, metrics))
        self._test_kill_trainer(step)

    def _test_kill_trainer(self, step: int) -> None:
        """The test hook (TEST_KILL_TRAINER_ENV): a trainer child's death between steps."""
        child = self._trainer_process()
        if child is not None and step in self.test_kill_trainer_after:
            child.kill()

    # ---------------------------------------------------------- checkpoints
    def _rng_state(self) -> dict:
        engines = {r: e.rng_state() for r, e in self.engines.items()}
        return {
            "torch": torch.get_rng_state(),
            "engines": {r: s for r, s in engines.items() if s is not None},
        }

    @contextlib.contextmanager
    def _optimizer_loaded(self):
        """The parameters and optimizer state in the trainer (where save/load find them),
        released and offloaded again afterwards if they were (a shifted-down trainer keeps
        its optimizer in host memory and, on a GPU, its parameters only in GPS)."""
        released = self.trainer.memory_released
        if released:
            self.trainer.resume_memory()
            tensors, _ = self.gps.read("policy", [self.comm.Get_rank()], _tp1(), device="cpu")
            self.trainer.load_weights(tensors)
        offloaded = self.trainer.optimizer_offloaded
        self.trainer.reload_optimizer()
        yield
        if offloaded:
            self.trainer.offload_optimizer()
        if released:
            self.trainer.release_memory()

    def save(self, path: str | None) -> None:
        """Checkpoint this rank's part: RNG states; training ranks also write the megatron
        distributed checkpoint (model + optimizer) under `path`/train (collectively)."""
        t0 = time.perf_counter()
        if self.trainer is not None and path is not None:
            with self._optimizer_loaded():
                self.trainer.save(os.path.join(path, "train"))
        self.send(msg.Saved(self._rng_state(), time.perf_counter() - t0))

    def restore(self, path: str) -> None:
        """Resume: this rank's RNG states; training ranks load model + optimizer state."""
        t0 = time.perf_counter()
        from pathlib import Path

        from pivot_hpc.runtime.checkpointing import RANKS, load_state

        state = load_state(Path(path), RANKS).get(self.comm.Get_rank())
        if state is not None:
            torch.set_rng_state(state["torch"])
            for role, gen_state in state["engines"].items():
                if role in self.engines:
                    self.engines[role].set_rng_state(gen_state)
        if self.trainer is not None:
            with self._optimizer_loaded():
                self.trainer.load(os.path.join(path, "train"))
            if self._child_trainer:
                self._publish_optimizer()  # at the checkpoint's version
        self.send(msg.Restored(time.perf_counter() - t0))

    # ------------------------------------------------------------- builders
    def _start_engine(self, role: str):
        """A new engine at a shift-up; an engine process that dies while it starts is a
        dead engine (reported, then shifted down and restarted, or excluded), not a dead
        rank."""
        from pivot_hpc.engines.child_engine import EngineProcessError

        try:
            return self._make_engine(role)
        except EngineProcessError as exc:
            return GuardedEngine.failed_start(exc)

    def _make_engine(self, role: str):
        from pivot_hpc.engines.child_engine import ChildEngine
        from pivot_hpc.engines.factory import make_inference_engine

        engine = make_inference_engine(
            self.cfg,
            role,
            self.dirs[role],
            # a distinct stream per worker; rl.trainer.seed varies the whole run
            seed=getattr(self.cfg.engines, role).seed
            + self.cfg.rl.trainer.seed
            + self.comm.Get_rank(),
            # the replica's first GPU on this node: the leader's own (runtime/devices.py)
            slot=self.comm.Get_rank() % self.cfg.cluster.ranks_per_node - 1,
            reclaim_signals=stop.reinstall,
        )
        # an engine process may die alone: its replica is then shifted down and restarted
        return GuardedEngine(engine) if isinstance(engine, ChildEngine) else engine

    def _make_trainer(self, address: tuple[str, int] | None = None) -> TrainEngine:
        import os

        from pivot_hpc.engines.train_factory import make_train_engine
        from pivot_hpc.models.qwen2 import model_config_of
        from pivot_hpc.models.zoo import load_model

        model, _ = load_model(self.dirs["rollout"])
        if self._child_trainer:  # the children of the training set make their own world
            from pivot_hpc.engines.child_engine import ChildTrainer

            rl = self.cfg.rl
            return ChildTrainer(
                model_config_of(model),
                rl.trainer,
                rl.grpo,
                max_response_tokens=rl.max_response_tokens,
                world=(self.world.ranks, self.world.tp),
                rank=self.comm.Get_rank(),
                world_env=self._child_world_env(address),
            )
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["RANK"] = str(self.world.torch_rank(self.comm.Get_rank()))
        os.environ["WORLD_SIZE"] = str(len(self.world.ranks))
        torch.set_num_threads(1)
        return make_train_engine(self.cfg, model_config_of(model))

    # --------------------------------------------------- trainer in a child process
    @property
    def _child_trainer(self) -> bool:
        """`rl.trainer.process: child` (engines/child_engine.py `ChildTrainer`)."""
        return self.cfg.rl.trainer.process == "child"

    def _trainer_process(self):
        """The trainer's child process (a `ChildTrainer`: its life beyond the TrainEngine
        contract), or None for a trainer in this rank."""
        from pivot_hpc.engines.child_engine import ChildTrainer

        return self.trainer if isinstance(self.trainer, ChildTrainer) else None

    def _publish_optimizer(self) -> None:
        """The trainer children's optimizer state at their policy version (after each
        step, at start and after a restore), where restarted children read it back: GPS,
        gathered over tensor parallelism by the training set's first replica, its first
        rank writing. Sharded (rl.trainer.distributed_optimizer): no rank holds the whole
        state, and gathering it would undo the sharding; each rank of the training set
        keeps its own child's range in its own memory instead (`_optimizer_shard`: the
        rank outlives its child), 12 B per parameter over the data-parallel size."""
        rank = self.comm.Get_rank()
        if self.cfg.rl.trainer.distributed_optimizer:
            if not self.extension:  # (an extension owns no range)
                shard = self._trainer_process().optimizer_shard()
                self._optimizer_shard = (self.trainer.version, shard)
        elif rank in self.training_ranks[: self.world.tp]:
            writer = self.training_ranks[0]
            publish_optimizer(self.gps, self.trainer, rank, writer, self.trainer.version)

    def _child_world_env(self, address: tuple[str, int] | None = None) -> dict[str, str]:
        """Where this generation of the training world's children meets (ChildTrainer's
        `world_env`). One child alone: its own private store. On one node: a new file in
        the private directory of world rank 0 that the ranks' own rendezvous made
        (runtime/main.py); across nodes: a TCP store on the first training rank's host, at
        start where the rendezvous put it, later at `address` (a port found free there
        for each generation: the last one's children are all gone by then)."""
        from pivot_hpc.engines.megatron_model import STORE_ENV

        size = len(self.world.ranks)
        if size == 1:
            return {}
        env = {
            "RANK": str(self.world.torch_rank(self.comm.Get_rank())),
            "WORLD_SIZE": str(size),
        }
        if os.environ.get(STORE_ENV):
            env[STORE_ENV] = f"{os.environ[STORE_ENV]}.trainers{self._trainer_generation}"
        elif address is not None:
            env["MASTER_ADDR"], env["MASTER_PORT"] = address[0], str(address[1])
        else:
            env["MASTER_ADDR"], env["MASTER_PORT"] = (
                os.environ["MASTER_ADDR"],
                os.environ["MASTER_PORT"],
            )
        return env

    def _next_world_address(self) -> tuple[str, int] | None:
        """Across nodes, on the first rank that may train: a port free on its host for the
        next world's store (`TrainerClosed`)."""
        from pivot_hpc.engines.megatron_model import STORE_ENV

        if os.environ.get(STORE_ENV) or self.comm.Get_rank() != self.world.ranks[0]:
            return None
        import socket

        with socket.socket() as sock:
            sock.bind(("", 0))
            return socket.gethostname(), sock.getsockname()[1]

    def _check_trainer(self) -> None:
        """A trainer child found dead between steps (the 0.5 s health check, or the start
        of a command) is reported to the coordinator (`EngineFailed`; it stops the job if
        one dies again within deployment.engine_restart_window_s). The coordinator asks
        every rank that may train before the next step, save or restore, and has them all
        replace their children then (runtime/live_cluster.py `_replace_lost_trainers`).
        Until then a shift leaves this one alone: its replacement is refit as the shift
        left the role. A death inside a call (a step, a save) is the call's
        EngineProcessError: the rank fails and the job stops, as it would with the
        trainer in the rank."""
        child = self._trainer_process()
        if child is None or self._trainer_lost or not child.dead:
            return
        self._trainer_lost = True
        self.send(msg.EngineFailed("training", str(child.death()), 0, 0, 0))

    def _start_trainer(self, generation: int, address: tuple[str, int] | None) -> None:
        """A new trainer child in the world of `generation` (every rank that may train
        starts one at once, after all closed theirs), with the step groups formed so far,
        refit from GPS as the role needs it: the current policy and the optimizer state
        published with it on the training set, and on an extension that is training now;
        an extension that is not reads them when it next joins, as always. A survivor's
        own state was that same state (the set's gradients are averaged), so the world
        trains on from exactly where it was."""
        t0 = time.perf_counter()
        self._trainer_generation = generation
        self.trainer = self._make_trainer(address)
        for members in self._formed:
            self._trainer_process().form_groups(members)
        training = self.role == "training"
        version = self.gps.version("policy")
        if self.cfg.rl.trainer.distributed_optimizer and not self.extension:
            kept = None if self._optimizer_shard is None else self._optimizer_shard[0]
            if kept != version:
                raise RuntimeError(
                    f"a training engine process died but this rank kept its optimizer range "
                    f"of policy v{kept}, not of v{version}: it cannot be restarted; run the "
                    "same command to resume from the last checkpoint"
                )
            self._load_policy_to_train(version)
            self._trainer_process().load_optimizer_shard(self._optimizer_shard[1], version=version)
        elif not self.extension or training:
            # (sharded: an extension training now holds no state, as when it joined)
            have = {
                k: self.gps.version(OPTIMIZER_MODELS[k])
                for k in self.trainer.optimizer_kinds()
                if k != "master"
            }
            if any(v != version for v in have.values()):
                raise RuntimeError(
                    f"a training engine process died but GPS holds the optimizer state of "
                    f"{have}, not of policy v{version}: it cannot be restarted; run the same "
                    "command to resume from the last checkpoint"
                )
            self._load_policy_to_train(version)
            read_optimizer(self.gps, self.trainer, self.comm.Get_rank(), version, timeout_s=5.0)
        if not training:  # shifted down: as a shift-down (or, on an extension, start) leaves it
            self.trainer.offload_optimizer()
            if self.trainer.device.type == "cuda":
                self.trainer.release_memory()
        self._trainer_lost = False
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


def _tp1():
    from pivot_hpc.gps import Parallelism

    return Parallelism(tp=1, pp=1, dp=1)


def report_error(comm) -> None:
    """Tell the coordinator why this worker is about to die, then abort the world."""
    try:
        failed = msg.Failed(f"rank {comm.Get_rank()}:\n{traceback.format_exc()}")
        comm.send(failed, dest=0, tag=EVT)
        time.sleep(2.0)  # let the coordinator print the cause before the abort lands
    finally:
        comm.Abort(1)
