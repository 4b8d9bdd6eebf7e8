"""The real `Cluster`: coordinator actions become MPI messages to worker ranks, and worker
messages become the coordinator's events (the same events the simulator produces).

Replica "<role>:<slot>" with tp GPUs maps to the worker ranks of those GPUs; its first
rank (the leader) runs the replica's engine and gets its sequences (the `hf` engine has
tp = 1; an `sglang` engine spans the replica's GPUs). "training" is the fixed training set;
with elastic training "training:<slot>" is an extension that joins the steps it is held
for (its ranks read the set's optimizer state from GPS, runtime/training_world.py).

Tool calls (tools.enabled, coordinator/turns.py) go to the sandbox service of a node: the
node with the fewest calls outstanding (ties: the lowest), leaving out nodes whose service
is gone. Node 0's service belongs to this rank (rank 0 is node 0's host rank): it is
called in-process and polled with MPI's events; the other nodes' host ranks take
`ToolCall` commands and send `ToolResult` events (runtime/host_tools.py). Each
`ToolReturned` names the node the call was sent to (telemetry `tool_calls.node`). `stop`
collects the results still owed by other nodes before it sends `Stop`.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict, deque
from collections.abc import Mapping, Sequence

from mpi4py import MPI

from pivot_hpc.agentic.messages import ToolCall, ToolResult
from pivot_hpc.coordinator.events import (
    ReplicaFailed,
    SequenceFinished,
    ShiftDone,
    ToolReturned,
    TrainingDone,
    WeightsUpdated,
)
from pivot_hpc.coordinator.rl_state import Sample
from pivot_hpc.errors import PivotError
from pivot_hpc.planner.snapshot import TRAINING, Topology, role_of, slot_of
from pivot_hpc.runtime import protocol as msg
from pivot_hpc.runtime.protocol import CMD, EVT
from pivot_hpc.runtime.training_world import TrainingWorld
from pivot_hpc.runtime.world import Layout


class WorkerFailed(PivotError, RuntimeError):
    """A worker rank raised; its traceback is in the message."""


class LiveCluster:
    def __init__(
        self,
        comm,
        layout: Layout,
        topology: Topology,
        samples,
        world: TrainingWorld,
        tools_enabled: bool = False,
        trainer_children: bool = False,
    ) -> None:
        self.comm = comm
        self.world = world  # the ranks that may train (runtime/training_world.py)
        # rl.trainer.process: child — their children are checked before every step, save
        # and restore, and replaced together after a death (_replace_lost_trainers)
        self.trainer_children = trainer_children
        self._trainer_generation = 0
        self._formed: set[tuple[int, ...]] = set()  # step member sets with process groups
        self.layout = layout
        self.topology = topology
        self.samples = samples
        self.t0 = time.monotonic()
        self.training_ranks = [layout.rank_of_gpu(g) for g in topology.training_gpus]
        self.rank_of: dict[str, list[int]] = {}  # replica -> its worker ranks
        self.role_of_rank: dict[int, str] = {}
        self._pending: list = []
        # Finishes not yet handled by the coordinator: an abort that comes too late finds
        # its sequence's finish here (`take_finished`).
        self._held: dict[tuple[str, int], SequenceFinished] = {}
        self._delivered: list[SequenceFinished] = []
        self._lengths: dict[int, dict[int, int]] = defaultdict(dict)  # rank -> seq -> length
        self._where: dict[tuple[str, int], int] = {}  # (role, seq) -> rank
        self._partial: dict[tuple[str, int], object] = {}  # aborted SeqResult, to resume
        self._shift_acks: dict[str, list[dict]] = defaultdict(list)
        # rank -> the replicas its shift commands were for, in order: a worker acknowledges
        # them in that order, also a chained shift-up sent before its shift-down's ack
        self._shift_expect: dict[int, deque[str]] = defaultdict(deque)
        self._after_down: dict[int, str] = {}  # rank -> replica chained after its down
        self._trained: dict[int, list[dict]] = defaultdict(list)
        self._members: dict[int, int] = {}  # step -> ranks training it
        self._optimizer_published = -1  # policy version whose optimizer state is in GPS
        self._tokens = {"rollout": 0, "reward": 0}
        self._steps: dict[str, list[tuple[float, int, int]]] = defaultdict(list)
        self._ready: dict[int, float] = {}  # worker rank -> its start-up seconds
        self._sending: list = []  # requests of commands not yet received (see _send)
        self._window = {"rollout": (0.0, 0), "reward": (0.0, 0)}
        # tool calls: call id -> the node running it; nodes whose service is gone
        self._tool_node: dict[int, int] = {}
        self._tool_gone: set[int] = set()
        self._nodes = max(1, comm.Get_size() // layout.ranks_per_node)
        self._local = None  # node 0's sandbox service: this rank's own
        if tools_enabled:
            from pivot_hpc.runtime.host_tools import ToolServiceError, local_service

            self._local = local_service()
            if self._local is None:
                raise ToolServiceError(
                    "tools.enabled=true but the coordinator rank has no sandbox service: it "
                    "is started before MPI by `pivot-hpc run`/`submit` (runtime/host_tools.py)"
                )
            self._local.wait_ready()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def wait_ready(self) -> float:
        """Wait until every worker has built its engines and trainer (the run starts then:
        a worker's start-up is not a shift); returns the slowest worker's seconds."""
        status = MPI.Status()
        while len(self._ready) < len(self.worker_ranks()):
            m = self.comm.recv(source=MPI.ANY_SOURCE, tag=EVT, status=status)
            self._convert(m, status.Get_source())
        return max(self._ready.values(), default=0.0)

    def _ranks(self, rid: str) -> list[int]:
        if rid == TRAINING:
            return self.training_ranks
        return [self.layout.rank_of_gpu(g) for g in self.topology.gpus_of(rid)]

    def _send(self, rank: int, cmd: msg.Command) -> None:
        """Non-blocking: a standard send of more than the eager limit (or to a worker whose
        shared-memory queue is full) waits until the worker, busy in an engine step,
        receives — the coordinator must not. MPI keeps the order of one sender's messages."""
        self._sending.append(self.comm.isend(cmd, dest=rank, tag=CMD))
        if len(self._sending) > 256:
            self._reap()

    def _reap(self) -> None:
        """Forget completed sends (their buffers are released with the requests)."""
        self._sending = [r for r in self._sending if not r.Test()]

    # ------------------------------------------------------------- actions
    def shift_up(self, rid: str, version: int, after: str | None = None) -> None:
        ranks = self._ranks(rid)
        role = role_of(rid)
        if after is not None and after not in self.rank_of:
            after = None  # its down is acknowledged already (the coordinator has yet to hear)
        if after is not None and (role == TRAINING or sorted(ranks) != sorted(self.rank_of[after])):
            raise ValueError(
                f"{rid} cannot chain after {after}: not an inference replica on its GPUs"
            )
        if role == TRAINING and rid != TRAINING and self._optimizer_published != version:
            # an extension joins: the set's first replica publishes its optimizer state
            # once per version (the joiners wait for it in GPS)
            for r in self.training_ranks[: self.topology.training_tp]:
                self._send(r, msg.PublishOptimizer(version))
            self._optimizer_published = version
        self.rank_of[rid] = ranks
        for i, r in enumerate(ranks):
            if after is None:
                self.role_of_rank[r] = rid
            else:  # the rank still serves `after` until its shift-down is acknowledged
                self._after_down[r] = rid
            self._shift_expect[r].append(rid)
            # a tp > 1 replica (sglang): its first rank leads the one engine over all its
            # GPUs; the others lend their GPUs and hold no engine (training: all train)
            self._send(r, msg.ShiftUp(role, version, leader=i == 0 or role == TRAINING))

    def _leader(self, rid: str) -> int:
        return self.rank_of[rid][0]

    def shift_down(self, rid: str) -> None:
        for r in self.rank_of[rid]:
            self._shift_expect[r].append(rid)
            self._send(r, msg.ShiftDown())

    def start(self, rid: str, sample: Sample, role: str) -> None:
        rank = self._leader(rid)
        pl = sample.payload
        partial = self._partial.pop((role, sample.sample_id), None)
        gen = list(partial.token_ids) if partial is not None else []
        lps = list(partial.logprobs) if partial is not None else []
        if role == "rollout":  # a tool-calling trajectory's turn: the context so far
            prompt, sampling = self.samples.rollout_turn(sample)
        else:
            prompt, sampling = pl.judge_ids, self.samples.judge_sampling
        self._where[(role, sample.sample_id)] = rank
        self._send(rank, msg.Start(sample.sample_id, prompt, gen, lps, sampling))

    def abort(self, where: Mapping[int, str]) -> dict[int, int | None]:
        """One `Abort` per worker for all of its sequences, sent to every worker before any
        reply is awaited: the round trips overlap instead of adding up."""
        by_rank: dict[int, list[int]] = defaultdict(list)
        role = {}
        for seq_id, rid in where.items():
            by_rank[self._leader(rid)].append(seq_id)
            role[seq_id] = role_of(rid)
        replies = self._gather(
            list(by_rank), {r: msg.Abort(tuple(ids)) for r, ids in by_rank.items()}, msg.Aborted
        )
        out: dict[int, int | None] = {}
        for reply in replies.values():
            for seq_id, res in reply.results.items():
                key = (role[seq_id], seq_id)
                self._where.pop(key, None)
                if res is None:
                    out[seq_id] = None
                else:
                    self._partial[key] = res
                    out[seq_id] = len(res.prompt_ids) + len(res.token_ids)
        return out

    def take_finished(self, role: str, seq_id: int) -> SequenceFinished:
        ev = self._held.pop((role, seq_id))
        if ev in self._pending:
            self._pending.remove(ev)
        return ev

    def call_tool(self, call: ToolCall) -> None:
        load = dict.fromkeys(range(self._nodes), 0)
        for node in self._tool_node.values():
            load[node] += 1
        usable = [n for n in load if n not in self._tool_gone] or list(load)
        node = min(usable, key=lambda n: (load[n], n))
        self._tool_node[call.call_id] = node
        if node == 0 and self._local is not None:
            self._local.submit(call)
        else:
            self._send(node * self.layout.ranks_per_node, call)

    def _tool_result(self, result: ToolResult) -> None:
        node = self._tool_node.pop(result.call_id, None)
        if node is None:
            raise WorkerFailed(f"a result for tool call {result.call_id}, which is not running")
        if result.status == "unavailable":  # its service is gone or unhealthy: no more calls
            self._tool_gone.add(node)
        self._pending.append(ToolReturned(self.now(), result, node))

    def _poll_local_tools(self) -> None:
        if self._local is not None:
            for result in self._local.poll():
                self._tool_result(result)

    def update_weights(self, rid: str, version: int) -> None:
        self._send(self._leader(rid), msg.UpdateWeights(version))

    def train(self, step: int, samples: Sequence[Sample], extensions: Sequence[str] = ()) -> None:
        batch = self.samples.batch(list(samples))
        members = list(self.training_ranks)
        for rid in sorted(extensions, key=slot_of):
            members += self._ranks(rid)
        self._members[step] = len(members)
        self._replace_lost_trainers()
        # with elastic training every step names its replicas (also the set alone), and
        # every rank that may train forms a new set's groups first, in one order
        named = tuple(members) if self.world.elastic else ()
        if named and named not in self._formed:
            self._formed.add(named)
            for r in self.world.ranks:
                self._send(r, msg.FormGroups(named))
        for r in members:
            self._send(r, msg.Train(step, batch, named))

    def lengths(self, role: str) -> dict[int, int]:
        out: dict[int, int] = {}
        for (r_role, seq_id), rank in self._where.items():
            if r_role == role and seq_id in self._lengths[rank]:
                out[seq_id] = self._lengths[rank][seq_id]
        return out

    def step_stats(self, role: str) -> list[tuple[float, int, int]]:
        out, self._steps[role] = self._steps[role], []
        return out

    def prefill_time(self, role: str, tokens: int) -> float:
        return 0.0  # the hf engine does not report re-prefill time separately

    def measured_throughput(self, role: str) -> float:
        t0, tok0 = self._window[role]
        now, tok = self.now(), self._tokens[role]
        self._window[role] = (now, tok)
        return (tok - tok0) / (now - t0) if now > t0 else 0.0

    def made_tokens(self) -> tuple[float, float]:
        # Only finished sequences' tokens are counted (`_count`); what running ones have
        # made is in the monitor's length reports minus their contexts, not summed here,
        # so the steady work share is not defined live.
        return math.nan, math.nan

    def _count(self, role: str, n: int) -> None:
        self._tokens[role] += n

    def stop(self, code: int = 0, tool_wait_s: float = 30.0) -> None:
        """End every other rank's loop (workers and the other nodes' host ranks); each
        returns `code` as its exit status. Tool calls other nodes still run are awaited
        first (at most `tool_wait_s`): their host ranks answer before they stop."""
        deadline = self.now() + tool_wait_s
        while any(n != 0 for n in self._tool_node.values()) and self.now() < deadline:
            self.poll(until=self.now() + 0.05)
        self._pending = []
        for r in range(1, self.comm.Get_size()):
            self._send(r, msg.Stop(code))
        # A worker's events travel non-blocking: take (and drop) what each still sends,
        # up to its last message, so that its sends complete and it can exit.
        for r in self.worker_ranks():
            while not isinstance(self.comm.recv(source=r, tag=EVT), msg.Stopped):
                pass
        MPI.Request.Waitall(self._sending)  # every command delivered before we go
        self._sending = []

    # --------------------------------------------------------- checkpoints
    def worker_ranks(self) -> list[int]:
        return [self.layout.rank_of_gpu(g) for g in range(self.topology.num_gpus)]

    def _gather(self, ranks: list[int], cmd, reply: type) -> dict[int, msg.Event]:
        """Send `cmd` (one for all, or one per rank) to `ranks` and collect each one's
        `reply`; what a worker sent before its reply becomes events, in order."""
        for r in ranks:
            self._send(r, cmd[r] if isinstance(cmd, dict) else cmd)
        out = {}
        status = MPI.Status()
        # from any rank: a rank that fails (its `Failed`) is heard even while the others
        # wait for it in a collective (a checkpoint's save spans every training rank)
        while len(out) < len(ranks):
            m = self.comm.recv(source=MPI.ANY_SOURCE, tag=EVT, status=status)
            r = status.Get_source()
            if isinstance(m, reply) and r in ranks and r not in out:
                out[r] = m
            else:
                self._convert(m, r)
        return out

    def partials(self) -> dict[tuple[str, int], object]:
        """Tokens generated so far by every unfinished sequence: those aborted and waiting
        to be re-dispatched, and (peeked without disturbing them) those running."""
        out: dict[tuple[str, int], object] = dict(self._partial)
        for m in self._gather(self.worker_ranks(), msg.Peek(), msg.Peeked).values():
            for res in m.results:
                out[(m.role, res.seq_id)] = res
        return out

    def set_partials(self, partials: dict[tuple[str, int], object]) -> None:
        """Resume: sequences start again from these tokens when next dispatched."""
        self._partial.update(partials)

    def save_ranks(self, path: str) -> tuple[dict[int, dict], float]:
        """Every worker's RNG states; the training ranks write `path`/train. Returns the
        states by rank and the slowest rank's save time."""
        self._replace_lost_trainers()
        got = self._gather(self.worker_ranks(), msg.Save(path), msg.Saved)
        return {r: m.rng_states for r, m in got.items()}, max(m.seconds for m in got.values())

    def restore_ranks(self, path: str) -> float:
        self._replace_lost_trainers()
        got = self._gather(self.worker_ranks(), msg.Restore(path), msg.Restored)
        return max(m.seconds for m in got.values())

    def _replace_lost_trainers(self) -> None:
        """Trainer children (`rl.trainer.process: child`) before the training world runs
        a command together (a step, a save, a restore): every rank that may train says
        whether its child lives. If one died (its rank reported it, or says so now) every
        rank closes its own, the survivors' too (their torch.distributed world lost a
        member), then all start new ones in a new world, refit as the role needs
        (runtime/worker.py `_start_trainer`).
        Asking first, rather than acting on the death reports alone, leaves no gap between
        a death and the next step's command for the step to fall into."""
        if not self.trainer_children:
            return
        ranks = list(self.world.ranks)
        checked = self._gather(ranks, msg.CheckTrainer(), msg.TrainerChecked)
        if all(m.alive for m in checked.values()):
            return
        self._gather(ranks, msg.CloseTrainer(), msg.TrainerClosed)
        self._trainer_generation += 1
        start = msg.StartTrainer(self._trainer_generation)
        self._gather(ranks, start, msg.TrainerStarted)

    # -------------------------------------------------------------- events
    def poll(self, until: float) -> list:
        # Finishes delivered by the previous poll have been handled by now.
        for ev in self._delivered:
            self._held.pop((ev.role, ev.seq_id), None)
        self._delivered = []
        backoff = 1e-3
        status = MPI.Status()
        self._reap()
        while True:
            while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=EVT, status=status):
                src = status.Get_source()
                self._convert(self.comm.recv(source=src, tag=EVT), src)
            self._poll_local_tools()
            if self._pending or self.now() >= until:
                out, self._pending = self._pending, []
                self._delivered = [e for e in out if isinstance(e, SequenceFinished)]
                return out
            time.sleep(min(backoff, max(0.0, until - self.now())))
            backoff = min(backoff * 2, 0.005)  # an event waits at most 5 ms for us

    def _convert(self, event: msg.Event, rank: int) -> None:
        t = self.now()
        rid = self.role_of_rank.get(rank)
        match event:
            case msg.Failed(text):
                raise WorkerFailed(f"worker {text}")
            case msg.Ready(seconds):
                self._ready[rank] = seconds
            case ToolResult():
                self._tool_result(event)
            case msg.Finished(results):
                role = role_of(rid)
                for res in results:
                    ev = SequenceFinished(
                        t,
                        role,
                        rid,
                        res.seq_id,
                        len(res.prompt_ids) + len(res.token_ids),
                        len(res.token_ids),
                        res,
                    )
                    self._where.pop((role, res.seq_id), None)
                    self._lengths[rank].pop(res.seq_id, None)
                    self._count(role, len(res.token_ids))
                    self._held[(role, res.seq_id)] = ev
                    self._pending.append(ev)
            case msg.Lengths(lengths, steps):
                self._lengths[rank] = dict(lengths)
                if steps and rid is not None:
                    self._steps[role_of(rid)].extend(steps)
            case msg.Shifted(kind, phases):
                rid = self._shift_expect[rank].popleft()
                acks = self._shift_acks[rid]
                acks.append(phases)
                if len(acks) == len(self.rank_of[rid]):
                    slowest = {k: max(a.get(k, 0.0) for a in acks) for a in acks for k in a}
                    del self._shift_acks[rid]
                    if kind == "down":
                        for r in self.rank_of.pop(rid):
                            if r in self._after_down:
                                self.role_of_rank[r] = self._after_down.pop(r)
                            else:
                                self.role_of_rank.pop(r, None)
                    self._pending.append(ShiftDone(t, rid, kind, slowest))
            case msg.EngineFailed(role, cause, sequences, kept, lost):
                serving = rid if rid is not None and role_of(rid) == role else ""
                if serving:
                    self._lengths[rank] = {}
                where = f"{role} engine of rank {rank}"
                self._pending.append(
                    ReplicaFailed(t, role, serving, where, cause, sequences, kept, lost)
                )
            case msg.WeightsLoaded(version):
                self._pending.append(WeightsUpdated(t, rid, version))
            case msg.Trained(step, metrics):
                done = self._trained[step]
                done.append(metrics)
                if len(done) == self._members[step]:
                    del self._trained[step], self._members[step]
                    published = next(m for m in done if m.get("version") is not None)
                    self._pending.append(TrainingDone(t, step, dict(published)))
            case _:
                raise WorkerFailed(f"unexpected message {event!r} from rank {rank}")
