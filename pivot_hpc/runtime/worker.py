"""A worker rank: a command loop over two seats (docs/design.md §2, §5.2).

The coordinator sends commands; the worker hands each to the seat it concerns — the
inference seats (runtime/inference_seat.py: the rollout and reward engines) or, on a rank
that may train, the training seat (runtime/training_seat.py) — and steps the engine of its
current role between commands. Every result goes back to the coordinator as an event.

Role shifting follows the four context categories of §5.2 (each seat for its role):
temporary (KV cache) discarded on shift down and re-allocated lazily on shift up;
parameters discarded and Read from GPS; offloadable (optimizer state) offloaded to host
memory and reloaded; preserved (the engine objects, torch.distributed groups) kept. Each
phase is timed and reported with the shift.

An idle worker polls with exponential back-off (1 ms → 5 ms) instead of a blocking
receive, which OpenMPI implements by spinning a core. The cap bounds how long a shift
command waits for an idle worker (a shift's own phases take milliseconds on CPU).
"""

from __future__ import annotations

import os
import time
import traceback

import torch
from mpi4py import MPI

from pivot_hpc.runtime import protocol as msg
from pivot_hpc.runtime.inference_seat import LENGTHS_EVERY_S, InferenceSeats
from pivot_hpc.runtime.protocol import CMD, EVT
from pivot_hpc.runtime.training_seat import TrainingSeat
from pivot_hpc.runtime.training_world import TrainingWorld

IDLE_POLL_MAX_S = 0.005


class Worker:
    def __init__(self, comm, gps, cfg, policy_dir, genrm_dir, world: TrainingWorld) -> None:
        self.comm = comm
        self.cfg = cfg
        rank = comm.Get_rank()
        self.inference = InferenceSeats(
            rank, gps, cfg, {"rollout": policy_dir, "reward": genrm_dir}, self.send
        )
        # the ranks that may train (elastic training: beyond the training set) have a seat
        self.training = (
            TrainingSeat(rank, gps, cfg, policy_dir, world, self.send)
            if rank in world.ranks
            else None
        )
        self.role: str | None = None
        self._last_health = 0.0  # engine processes checked
        self._sending: list = []  # requests of events not yet received (see send)
        self.fault = os.environ.get("PIVOT_HPC_FAULT")  # tests: "<command>[@rank]" raises
        # tests: seconds added to every decode step, so that sequences are still running
        # when a test signals or kills the job
        self.decode_delay_s = float(os.environ.get("PIVOT_HPC_DECODE_DELAY_S", "0"))

    def yield_to_coordinator(self) -> None:
        """Where a node has fewer cores than ranks (a CPU workstation), workers run at a
        lower priority: the coordinator's short, latency-bound work (dispatch, shifts)
        then does not queue behind engine steps. No effect where cores are not shared."""
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        if cores is not None and cores < self.cfg.cluster.ranks_per_node:
            os.nice(5)

    def prepare(self) -> None:
        """Build the preserved context once — the inference engines (or, for GPU engines,
        nothing until the first shift up) and the trainer — then tell the coordinator
        (`Ready`)."""
        t0 = time.perf_counter()
        self.inference.prepare()
        if self.training is not None:
            self.training.prepare()
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
                    if self.training is not None:
                        self.training.close()  # (a child would die with the rank anyway)
                    return cmd.code
                self.handle(cmd)
                self.inference.report_failures()
                busy = True
            busy |= self.inference.step(self.decode_delay_s)
            now = time.monotonic()
            if now - self._last_health > LENGTHS_EVERY_S:
                self._last_health = now
                self.inference.check()  # a process gone between calls (an idle role's too)
                if self.training is not None:
                    self.training.check()
            self.inference.report_failures()
            if busy:
                backoff = 1e-3
            else:
                time.sleep(backoff)
                backoff = min(backoff * 2, IDLE_POLL_MAX_S)

    def send(self, event: msg.Event) -> None:
        """Non-blocking (a large `Finished` would otherwise wait for a busy coordinator);
        MPI keeps the order of this rank's messages."""
        self._sending.append(self.comm.isend(event, dest=0, tag=EVT))
        if len(self._sending) > 64:
            self._sending = [r for r in self._sending if not r.Test()]

    # ------------------------------------------------------------- commands
    def handle(self, cmd: msg.Command) -> None:
        training = self.training
        if training is not None:
            training.check()  # a trainer child dead between steps: reported first
        self._inject_fault(cmd)
        match cmd:
            case msg.ShiftUp(role, version, leader):
                phases: dict[str, float] = {}
                if role == "training":
                    training.shift_up(version, leader, phases)
                else:
                    self.inference.shift_up(role, version, leader, phases)
                self.role = role
                self.send(msg.Shifted("up", phases))
            case msg.ShiftDown():
                phases = {}
                if self.role == "training":
                    training.shift_down(phases)
                else:
                    self.inference.shift_down(phases)
                self.role = None
                self.send(msg.Shifted("down", phases))
            case msg.Start(seq_id, prompt, generated, logprobs, sampling):
                self.inference.add(seq_id, prompt, generated, logprobs, sampling)
            case msg.Abort(seq_ids):
                self.send(msg.Aborted({s: self.inference.abort(s) for s in seq_ids}))
            case msg.UpdateWeights():
                self.send(msg.WeightsLoaded(*self.inference.update_weights()))
            case msg.Train(step, batch, members):
                training.train(step, batch, members)
            case msg.FormGroups(members):
                training.form_groups(members)
            case msg.PublishOptimizer(version):
                training.publish_optimizer(version)
            case msg.Peek():  # checkpoint: tokens of the running sequences, undisturbed
                self.send(msg.Peeked(self.role, self.inference.peek()))
            case msg.Save(path):
                self.save(path)
            case msg.Restore(path):
                self.restore(path)
            case msg.CheckTrainer():
                self.send(msg.TrainerChecked(training.alive))
            case msg.CloseTrainer():
                training.close_for_replacement()
                self.send(msg.TrainerClosed())
            case msg.StartTrainer(generation):
                training.start(generation)
            case _:
                raise ValueError(f"worker: unknown command {cmd!r}")

    def _inject_fault(self, cmd: msg.Command) -> None:
        """The test hook PIVOT_HPC_FAULT: "train", "save", … (the command's name) raises."""
        kind = type(cmd).__name__.lower()
        if self.fault and self.fault.split("@")[0] == kind:
            target = self.fault.partition("@")[2]
            if not target or int(target) == self.comm.Get_rank():
                raise RuntimeError(f"injected fault on {kind!r} (PIVOT_HPC_FAULT)")

    # ---------------------------------------------------------- checkpoints
    def save(self, path: str | None) -> None:
        """Checkpoint this rank's part: RNG states; training ranks also write the megatron
        distributed checkpoint (model + optimizer) under `path`/train (collectively)."""
        t0 = time.perf_counter()
        if self.training is not None and path is not None:
            self.training.save(path)
        state = {"torch": torch.get_rng_state(), "engines": self.inference.rng_states()}
        self.send(msg.Saved(state, time.perf_counter() - t0))

    def restore(self, path: str) -> None:
        """Resume: this rank's RNG states; training ranks load model + optimizer state."""
        t0 = time.perf_counter()
        from pathlib import Path

        from pivot_hpc.runtime.checkpointing import RANKS, load_state

        state = load_state(Path(path), RANKS).get(self.comm.Get_rank())
        if state is not None:
            torch.set_rng_state(state["torch"])
            self.inference.set_rng_states(state["engines"])
        if self.training is not None:
            self.training.restore(path)
        self.send(msg.Restored(time.perf_counter() - t0))


def report_error(comm) -> None:
    """Tell the coordinator why this worker is about to die, then abort the world."""
    try:
        failed = msg.Failed(f"rank {comm.Get_rank()}:\n{traceback.format_exc()}")
        comm.send(failed, dest=0, tag=EVT)
        time.sleep(2.0)  # let the coordinator print the cause before the abort lands
    finally:
        comm.Abort(1)
