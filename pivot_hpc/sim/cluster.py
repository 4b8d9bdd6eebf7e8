"""A discrete-event simulated cluster that speaks the coordinator's `Cluster` protocol.

Replicas advance by the engine's decode cost: with n running sequences holding tok tokens
an iteration takes A·tok + F(n) (F: the weight, per-sequence and fixed costs, see
sim/catalog.py) and gives every sequence one token. Between membership changes n is fixed
and tok grows by n per iteration, so the time for m iterations is m·(A·tok + F(n)) +
A·n·m²/2 (tokens treated as continuous) and its inverse is a quadratic root: each replica
jumps straight to its next finish. Admitting a sequence costs a (re-)prefill of its whole
context, during which the replica does not decode. The scheduler admits sequences within
KV capacity and the running-request cap; as admitted sequences grow, a full KV cache makes
the engine retract sequences (fewest generated tokens first, as SGLang's retract-decode
does) until every remaining one has room for RETRACT_HEADROOM more tokens. As in SGLang,
retracted sequences keep their tokens and wait in the engine's own queue (they stay
assigned to the replica, so the scheduler, which counts their length there, places
nothing new on a full engine); while any wait, new arrivals queue behind them. They are
re-admitted, with a re-prefill, when finishes free room for them and the headroom of
everything running. A shift-down or migration aborts waiting sequences like running ones.

GPS reads share their node's host link: a shift-up's parameter read and a weight update
read the node's host memory at `shift.host_read_gb_s` (fitted as a whole node's rate,
Figure 12), so reads of replicas on one node are served one after another (first come,
first served; the link is never idle while a read waits). A replica's wait is part of
its `read_s`. Training's own shift-ups are not queued with them (its GPUs read their
shards over every node of its set; they rarely meet an inference read on a node).

Engine deaths (`sim.failures`, sim/failures.py) strike GPUs at random; one on a GPU serving
an inference replica kills its engine. As the live engine guard does
(engines/process/guard.py), the dead replica decodes nothing more, keeps each sequence's
tokens as of its last refresh (REFRESH_S: what was decoded since is lost and generated
again), answers the coordinator's aborts with them, and takes sequences dispatched to it
before the death is heard with the tokens they came with. The coordinator's `on_failure`
then recovers it as it does live; a restart's shift-up takes `restart_s` more.
A death on a GPU that training holds (its set, or an elastic extension, from its shift-up
until its shift-down is asked) is a training rank's (issue 38, docs/guide/vllm.md): between
steps the rank's worker restarts its trainer and refits it from GPS, so the coordinator
hears a `ReplicaFailed` of role training and the next step starts `restart_s` plus that
group's shift-up later; inside a step — or when training's last reported death is within
`deployment.engine_restart_window_s`, where the live coordinator stops the job
(`Coordinator.stop_reason`: drained and saved) — the job stops and resumes from its last step's checkpoint: the
whole cluster, coordinator included, pauses for `job_restart_s` (every pending event and
engine clock moves on by it; no death falls in it) and the step starts over, its work so
far lost. Deaths on GPUs that idle or shift are counted (`deaths_elsewhere`), not dealt.

Tool calls (tools.enabled, coordinator/turns.py) take a latency the workload draws
(`tool_latency`, `sim.workload.tool_latency_s`) and use no GPU: a parked trajectory holds
nothing on any replica. A turn's sequence starts from its context so far (`Sample.
turn_context`) and generates that turn's share of the response (`SimPayload.turn_lens`).
A turn that calls a tool leaves its context in its replica's prefix cache: the next turn,
admitted on that same replica incarnation (not shifted down or restarted since, see
`_prefix`), prefills only the tokens after it (the observation); anywhere else its whole
context. Cache eviction is not modelled: the prefix is assumed to survive the wait (vLLM
evicts least-recently-used blocks only under KV pressure, which retraction models apart).

Events are ordered by (time, kind, id) with lazy invalidation (a replica's pending finish
event is dropped if its membership changed since), so a run is deterministic for a seed.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

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
from pivot_hpc.planner.snapshot import TRAINING, role_of
from pivot_hpc.scheduler import SeqLengths
from pivot_hpc.sim.catalog import InferenceCosts, TrainingCosts
from pivot_hpc.sim.config import FailureConfig
from pivot_hpc.sim.failures import MAX_STALLED_RESTARTS, REFRESH_S, DeathClock, JobStalled

# event kinds, in tie-breaking order (a death last: what finished at its instant is kept)
FINISH, SHIFT, WEIGHTS, TRAIN, DEATH, TOOL = 0, 1, 2, 3, 4, 5
RETRACT_HEADROOM = 20  # tokens per remaining sequence after a retraction (SGLang: 20 steps)


@dataclass(slots=True)
class _Seq:
    length0: float  # context tokens when admitted
    generated0: float  # tokens generated before admission (kept across aborts)
    base: float  # the replica's iteration count at admission
    finish_at: float  # iteration count at which it completes


class _Offsets:
    """seq id -> length0 − base of a replica's running sequences (a dict's item API), also
    held as two arrays (a deletion moves the last entry into the gap) so that `lengths`,
    asked every tick, reads them as they are instead of converting a dict per replica."""

    __slots__ = ("ids", "off", "pos")

    def __init__(self) -> None:
        self.pos: dict[int, int] = {}  # seq id -> its index in ids and off
        self.ids = np.empty(16, np.int64)
        self.off = np.empty(16)

    def __len__(self) -> int:
        return len(self.pos)

    def __setitem__(self, sid: int, value: float) -> None:
        i = self.pos.get(sid)
        if i is None:
            i = self.pos[sid] = len(self.pos)
            if i == len(self.ids):
                self.ids = np.concatenate([self.ids, np.empty(i, np.int64)])
                self.off = np.concatenate([self.off, np.empty(i)])
            self.ids[i] = sid
        self.off[i] = value

    def __delitem__(self, sid: int) -> None:
        i = self.pos.pop(sid)
        last = len(self.pos)
        if i != last:
            moved = int(self.ids[last])
            self.ids[i], self.off[i] = moved, self.off[last]
            self.pos[moved] = i

    def clear(self) -> None:
        self.pos.clear()

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, offsets) of the running sequences, in no particular order (views)."""
        n = len(self.pos)
        return self.ids[:n], self.off[:n]


@dataclass
class _Replica:
    """Sequences advance together: one replica-wide iteration counter, O(1) to advance."""

    rid: str
    role: str
    costs: InferenceCosts
    seqs: dict[int, _Seq] = field(default_factory=dict)
    finishing: list[tuple[float, int]] = field(default_factory=list)  # lazy heap
    iters: float = 0.0
    tok: float = 0.0
    t_last: float = 0.0
    busy_until: float = 0.0  # prefill or weight load: no decoding before this
    version: int = 0  # event stamp for lazy invalidation
    offsets: _Offsets = field(default_factory=_Offsets)  # seq id -> length0 − base
    waiting: dict[int, tuple[float, float, float]] = field(default_factory=dict)
    # ^ engine queue: seq id -> (context, generated, target), retracted or arrived while full
    fixed_n: int = -1  # membership size `fixed` was computed for
    fixed: float = 0.0  # F(n): the step time at zero tokens held
    # a dead engine (sim.failures): seq id -> (context, generated) it answers aborts with
    dead: dict[int, tuple[float, float]] | None = None
    # seq id -> prefix tokens this engine caches for an arrival (its last turn ran here):
    # its admission prefills only the rest (consumed by `SimCluster._admit`)
    cached: dict[int, float] = field(default_factory=dict)

    def step_fixed(self) -> float:
        n = len(self.seqs)
        if n != self.fixed_n:
            self.fixed_n = n
            self.fixed = self.costs.fixed(n)
        return self.fixed

    def next_event(self) -> float:
        """Iteration count of the next finish or of a full KV cache, whichever is first."""
        at = self.next_finish()
        n = len(self.seqs)
        if n > 1:  # one sequence alone is never retracted (the scheduler admitted it)
            room = self.costs.kv_capacity_tokens - self.tok
            at = min(at, self.iters + max(0.0, room) / n)
        return at

    def next_finish(self) -> float:
        heap = self.finishing
        while heap:
            at, sid = heap[0]
            s = self.seqs.get(sid)
            if s is not None and s.finish_at == at:
                return at
            heapq.heappop(heap)
        return math.inf

    def length(self, s: _Seq) -> float:
        return s.length0 + (self.iters - s.base)


@dataclass(slots=True)
class _Step:
    """The training step in flight: it computes from `start` (after any restarting
    trainer engine is ready) for `seconds`; `stamp` voids the TRAIN events of its earlier
    tries."""

    step: int
    start: float
    seconds: float
    groups: tuple[str, ...]  # "training" and the elastic extensions it trains on
    stamp: int


def _iterations(elapsed: float, a_n: float, c: float) -> float:
    """m with c·m + a_n·m²/2 = elapsed."""
    if elapsed <= 0:
        return 0.0
    if a_n <= 0:
        return elapsed / c
    return (-c + math.sqrt(c * c + 2.0 * a_n * elapsed)) / a_n


class SimCluster:
    def __init__(
        self,
        *,
        inference: dict[str, InferenceCosts],
        training: TrainingCosts,
        late_finish_share: float = 0.0,
        seed: int = 0,
        failures: FailureConfig | None = None,
        gpus: int = 0,
        tool_latency: Callable[[ToolCall], float] | None = None,
        training_gpus: Sequence[int] = (),
        restart_window_s: float = 600.0,
    ) -> None:
        """`late_finish_share`: the fraction of aborted running sequences that finish just
        before their abort arrives (a live engine's race; 0 = never). Tests set it so the
        coordinator's late-abort path runs deterministically (seeded by `seed`).
        `failures`: engine deaths on the cluster's `gpus` GPUs (None or an MTBF of 0:
        none; seeded by `seed`). `tool_latency`: seconds a tool call takes (the
        workload's draw; None: calls are refused). `training_gpus`: training's own GPU
        set (where its deaths fall; an extension's are its slot's); `restart_window_s`:
        deployment.engine_restart_window_s (a second training death within it stops the
        job)."""
        self.inference = inference
        self.tool_latency = tool_latency
        self.tool_calls = 0  # calls made (all answered unless the run ended first)
        self.late_finish_share = late_finish_share
        self._late = random.Random(seed) if late_finish_share > 0 else None
        self._held: dict[tuple[str, int], SequenceFinished] = {}
        self.late_finishes = 0
        self.training = training
        self.t = 0.0
        self._heap: list[tuple[float, int, str, int, object]] = []
        self._replicas: dict[str, _Replica] = {}
        self._progress: dict[tuple[str, int], float] = {}  # generated tokens kept by aborts
        self._targets: dict[tuple[str, int], tuple[float, object]] = {}
        self._tokens = {"rollout": 0.0, "reward": 0.0}
        # Prefix cache of tool-calling turns: sample id -> (the replica incarnation — the
        # _Replica object, new at each shift-up — and the context it caches) for a
        # trajectory whose turn ended there and which waits on a tool; consumed when its
        # next turn starts (an entry of a trajectory that ended on its observation stays:
        # a few bytes each). `_parking`: rollout sequences whose turn ends in a call.
        self._prefix: dict[int, tuple[_Replica, float]] = {}
        self._parking: set[int] = set()
        self.prefill_tokens = {"rollout": 0.0, "reward": 0.0}  # prefilled at admissions
        self.prefix_hit_tokens = 0.0  # rollout context not prefilled: found in the cache
        self.preempted = 0  # sequences the engines retracted for KV space
        self._window = {"rollout": (0.0, 0.0), "reward": (0.0, 0.0)}  # (t, tokens) last read
        self._node_free: dict[int, float] = {}  # node -> when its host read link is free
        self.read_wait_s = 0.0  # seconds reads waited for their node's link (all replicas)
        self._after_down: dict[str, tuple[str, int]] = {}  # down rid -> chained shift-up
        self._going_down: set[str] = set()  # replicas whose shift-down has not fired
        # Engine deaths: GPU -> the inference replica serving on it (its shift-up has
        # fired, its shift-down not been asked); replicas whose next shift-up restarts them
        self._serving: dict[int, str] = {}
        self._restart: set[str] = set()
        self.restart_s = failures.restart_s if failures is not None else 0.0
        self.deaths = 0  # engines killed while serving
        self.deaths_elsewhere = 0  # deaths on GPUs that idled or shifted
        # Training deaths: training's GPU set; the training groups up ("training" and
        # extensions, from their shift-up's end until their shift-down is asked); when each
        # restarted trainer engine is ready; the step in flight; the last training death
        # reported to the coordinator (its restart window counts from it)
        self._training_gpus = frozenset(training_gpus)
        self._trains: set[str] = set()
        self._train_ready: dict[str, float] = {}
        self._step: _Step | None = None
        self._train_stamp = 0
        self._training_reported: float | None = None
        self.restart_window_s = restart_window_s
        self.job_restart_s = failures.job_restart_s if failures is not None else 0.0
        # sim.failures.training: false leaves training's GPUs to deaths_elsewhere
        self._training_deaths_on = failures is None or failures.training
        self.training_deaths = 0  # deaths on GPUs training held
        self.training_restarts = 0  # of them, trainer engines restarted between steps
        self.job_restarts = 0  # job stops: a training death inside a step or in the window
        self.lost_train_s = 0.0  # step seconds computed, then lost to job stops
        self._stalled = 0  # job stops since the last step trained
        self._deaths = None
        if failures is not None and failures.enabled:
            self._deaths = DeathClock(failures, gpus, seed)
            self._push_death(0.0)

    # ----------------------------------------------------------- engine
    def now(self) -> float:
        return self.t

    def _push(self, t: float, kind: int, key: str, stamp: int, payload: object) -> None:
        heapq.heappush(self._heap, (t, kind, key, stamp, payload))

    def _push_death(self, t: float) -> None:
        at, gpu, since = self._deaths.next(t)
        self._push(at, DEATH, "", gpu, since)

    def kill(self, rid: str, at: float, since_refresh: float = REFRESH_S) -> None:
        """Kill `rid`'s engine at time `at`, `since_refresh` seconds after its last token
        refresh, if it is serving then (tests: a death where and when they choose). `rid`
        "training" or an extension: a training death if training holds it then (a job
        stop moves later kills on with everything else)."""
        self._push(at, DEATH, rid, -1, since_refresh)

    def _gpus(self, rid: str) -> range:
        """An inference replica's GPUs: slot s of a role of tp GPUs holds [s·tp, (s+1)·tp)."""
        tp = self.inference[role_of(rid)].tp
        slot = int(rid.split(":", 1)[1])
        return range(slot * tp, (slot + 1) * tp)

    def _training_group(self, gpu: int) -> str | None:
        """The training group holding `gpu` now ("training" or an extension), if any (none
        while `sim.failures.training` is off)."""
        if not self._training_deaths_on:
            return None
        if gpu in self._training_gpus:
            return TRAINING if TRAINING in self._trains else None
        if self.training is None:
            return None
        rid = f"{TRAINING}:{gpu // self.training.tp}"
        return rid if rid in self._trains else None

    def _training_death(self, group: str, where: str) -> list:
        """A trainer engine of `group` dies now. Inside the step it computes: the job stops.
        Between steps: its worker restarts it and refits it from GPS (the policy and the
        optimizer state), a `restart_s` start-up plus the group's shift-up, and no step
        starts on it before; the coordinator hears of it as live — unless training's last
        reported death is within the restart window, where the live coordinator stops the
        job (`Coordinator.stop_reason`): the job stops here instead (the coordinator, never
        told, does not end the simulated run)."""
        self.training_deaths += 1
        step = self._step
        if step is not None and group in step.groups and self.t >= step.start:
            self._job_restart()
            return []
        last = self._training_reported
        if last is not None and self.t - last < self.restart_window_s:
            self._job_restart()
            return []
        self._training_reported = self.t
        self.training_restarts += 1
        up = self.training.shift_up_s if group == TRAINING else self.training.extension_up_s
        ready = self.t + self.restart_s + sum(up.values())
        self._train_ready[group] = max(ready, self._train_ready.get(group, 0.0))
        if step is not None and group in step.groups:  # waits for this engine too now
            self._start_step(step, max(step.start, ready))
        return [
            ReplicaFailed(
                self.t,
                TRAINING,
                TRAINING,
                where,
                "injected engine death (sim.failures) between training steps: the worker "
                "restarts its trainer and refits it from GPS",
            )
        ]

    def _job_restart(self) -> None:
        """The job stops and resumes from its last checkpoint (the last step boundary):
        the whole cluster pauses for `job_restart_s` — every engine's clock, every pending
        event (shifts, weight loads, tool calls, the next death) and the node links move
        on by it — and the step in flight starts over, its work so far lost. Simplified:
        the resumed job keeps its allocation, engines and sequences (tokens included) as
        they were; a live one starts in a new allocation from the checkpoint."""
        self.job_restarts += 1
        self._stalled += 1
        if self._stalled > MAX_STALLED_RESTARTS:
            raise JobStalled(
                f"{self._stalled - 1} job stops in a row without a training step completing "
                f"(t={self.t:.0f} s): at this sim.failures.mtbf_gpu_hours a training step "
                "is almost never free of deaths"
            )
        t, pause = self.t, self.job_restart_s
        for r in self._replicas.values():
            self._advance(r)
        step = self._step
        if step is not None and t > step.start:
            self.lost_train_s += t - step.start
        # FINISH events are scheduled again below, the step's TRAIN event with it (in
        # place: `poll` holds the list)
        heap = self._heap
        heap[:] = [(at + pause, *rest) for at, *rest in heap if rest[0] not in (FINISH, TRAIN)]
        heapq.heapify(heap)
        self.t = t + pause
        for r in self._replicas.values():
            r.t_last = self.t
            if r.busy_until > t:
                r.busy_until += pause
            self._schedule(r)
        self._node_free = {n: f + pause if f > t else f for n, f in self._node_free.items()}
        self._train_ready.clear()  # the new job's engines started within the pause
        if step is not None:
            self._start_step(step, self.t)

    def _start_step(self, step: _Step, start: float) -> None:
        """(Re)schedule `step` to compute from `start`; its earlier TRAIN event is void."""
        self._train_stamp += 1
        step.start, step.stamp = start, self._train_stamp
        self._step = step
        self._push(start + step.seconds, TRAIN, TRAINING, step.step, step.stamp)

    def _die(self, r: _Replica, since_refresh: float) -> ReplicaFailed:
        """`r`'s engine dies now: it decodes nothing more; each sequence keeps its tokens as
        of the last refresh, `since_refresh` seconds ago (those it came with if it was
        admitted since), and loses the rest (generated again where it runs next)."""
        self._advance(r)
        n = len(r.seqs)
        # decode iterations since the refresh: its decoding seconds (none while it
        # prefilled or loaded weights) at the current step time (the window's longest)
        decoding = max(0.0, self.t - max(self.t - since_refresh, r.busy_until))
        step = r.costs.A * r.tok + r.step_fixed() if n else math.inf
        window = decoding / step
        kept: dict[int, tuple[float, float]] = {}
        lost = kept_tokens = 0.0
        for sid, s in r.seqs.items():
            mine = r.iters - s.base  # generated since it was admitted here
            gone = min(window, mine)
            kept[sid] = (r.length(s) - gone, s.generated0 + mine - gone)
            lost += gone
        for sid, (context, done, _) in r.waiting.items():  # retracted: nothing decoding
            kept[sid] = (context, done)
        kept_tokens = sum(done for _, done in kept.values())
        r.seqs.clear()
        r.offsets.clear()
        r.finishing.clear()
        r.waiting.clear()
        r.tok = 0.0
        r.cached.clear()
        r.dead = kept
        r.version += 1  # its pending finish is void
        self.deaths += 1
        self._restart.add(r.rid)
        return ReplicaFailed(
            self.t,
            r.role,
            r.rid,
            f"{r.role} engine of {r.rid}",
            f"injected engine death (sim.failures), {since_refresh:.2f} s after its last "
            "token refresh",
            sequences=len(kept),
            tokens_kept=round(kept_tokens),
            tokens_lost=round(lost),
        )

    def _advance(self, r: _Replica) -> None:
        start = max(r.t_last, r.busy_until)
        if self.t > start and r.seqs:
            n = len(r.seqs)
            a = r.costs.A
            c = a * r.tok + r.step_fixed()
            it = _iterations(self.t - start, a * n, c)
            it = min(it, max(0.0, r.next_event() - r.iters))
            r.iters += it
            r.tok += it * n
            self._tokens[r.role] += it * n
        r.t_last = self.t

    def _schedule(self, r: _Replica) -> None:
        r.version += 1
        if not r.seqs:
            return
        n = len(r.seqs)
        a = r.costs.A
        c = a * r.tok + r.step_fixed()
        it = max(0.0, r.next_event() - r.iters)
        start = max(self.t, r.busy_until)
        self._push(start + c * it + a * n * it * it / 2.0, FINISH, r.rid, r.version, None)

    def _read(self, rid: str, seconds: float) -> float:
        """A GPS read of `seconds` alone on `rid`'s node, queued behind the node's other
        reads: the seconds from now until it is done."""
        costs = self.inference[role_of(rid)]
        per_node = self.training.gpus_per_node if self.training is not None else 8
        node = int(rid.split(":", 1)[1]) * costs.tp // per_node
        start = max(self.t, self._node_free.get(node, 0.0))
        self._node_free[node] = start + seconds
        self.read_wait_s += start - self.t
        return start + seconds - self.t

    # -------------------------------------------------------- cluster API
    def shift_up(self, rid: str, version: int, after: str | None = None) -> None:
        if after in self._going_down:  # starts when `after`'s shift-down fires (see _fire)
            self._after_down[after] = (rid, version)
            return
        if rid == TRAINING:
            phases = dict(self.training.shift_up_s)
        elif role_of(rid) == TRAINING:  # an elastic extension
            phases = dict(self.training.extension_up_s)
        else:
            role = role_of(rid)
            costs = self.inference[role]
            phases = dict(costs.shift_up_s)
            if "read_s" in phases:
                phases["read_s"] = self._read(rid, phases["read_s"])
            if rid in self._restart:  # a fresh engine process, not a sleeping one
                self._restart.discard(rid)
                phases["restart_s"] = self.restart_s
            self._replicas[rid] = _Replica(rid, role, costs, t_last=self.t)
        self._push(self.t + sum(phases.values()), SHIFT, rid, 0, ("up", phases))

    def shift_down(self, rid: str) -> None:
        if rid == TRAINING:
            self._trains.discard(rid)
            phases = dict(self.training.shift_down_s)
        elif role_of(rid) == TRAINING:
            self._trains.discard(rid)
            phases = dict(self.training.extension_down_s)
        else:
            r = self._replicas.pop(rid)
            if r.seqs or r.waiting or r.dead:
                left = len(r.seqs) + len(r.waiting) + len(r.dead or ())
                raise RuntimeError(f"{rid} shifted down with {left} sequences left")
            for g in self._gpus(rid):
                if self._serving.get(g) == rid:
                    del self._serving[g]
            r.version += 1
            phases = dict(r.costs.shift_down_s)
        self._going_down.add(rid)
        self._push(self.t + sum(phases.values()), SHIFT, rid, 0, ("down", phases))

    def start(self, rid: str, sample: Sample, role: str) -> None:
        r = self._replicas[rid]
        self._advance(r)
        key = (role, sample.sample_id)
        payload = sample.payload
        if role == "reward":
            target = payload.judgement_len
        elif payload.turn_lens:  # a tool-calling trajectory: this turn's share
            target = payload.turn_lens[sample.turn]
        else:
            target = payload.response_len
        done = self._progress.pop(key, 0.0)
        if role == "reward":
            context = sample.prompt_len + sample.response_len + done
        else:
            context = sample.turn_context + done
            if payload.turn_lens and sample.turn < len(payload.turn_lens) - 1:
                self._parking.add(sample.sample_id)  # this turn ends in a tool call
            else:
                self._parking.discard(sample.sample_id)
            prefix = self._prefix.pop(sample.sample_id, None)
            if prefix is not None and prefix[0] is r and r.dead is None:
                r.cached[sample.sample_id] = min(prefix[1], context)
        self._targets[key] = (target, sample.payload)
        if r.dead is not None:  # sent before its death was heard: kept as it came
            r.dead[sample.sample_id] = (context, done)
        elif r.waiting:  # the engine is full: arrivals queue behind the retracted sequences
            r.waiting[sample.sample_id] = (context, done, target)
        else:
            self._admit(r, sample.sample_id, context, done, target)
        self._schedule(r)

    def _admit(self, r: _Replica, sid: int, context: float, done: float, target: float) -> None:
        seq = _Seq(context, done, r.iters, r.iters + max(target - done, 1e-9))
        r.seqs[sid] = seq
        r.offsets[sid] = seq.length0 - seq.base
        heapq.heappush(r.finishing, (seq.finish_at, sid))
        r.tok += context
        cached = r.cached.pop(sid, 0.0)
        self.prefill_tokens[r.role] += context - cached
        self.prefix_hit_tokens += cached
        r.busy_until = max(r.busy_until, self.t) + self.prefill_time(r.role, int(context - cached))

    def _resume(self, r: _Replica) -> None:
        """Re-admit waiting sequences, oldest first, while they and the running ones fit."""
        cap = r.costs.kv_capacity_tokens
        while r.waiting:
            sid, (context, done, target) = next(iter(r.waiting.items()))
            room = cap - r.tok - RETRACT_HEADROOM * (len(r.seqs) + 1)
            if r.seqs and context > room:
                return
            del r.waiting[sid]
            self._admit(r, sid, context, done, target)

    def abort(self, where: Mapping[int, str]) -> dict[int, int | None]:
        out: dict[int, int | None] = {}
        for seq_id, rid in where.items():
            if self._late is not None and seq_id in self._replicas[rid].seqs:
                if self._late.random() < self.late_finish_share:
                    self._finish_late(self._replicas[rid], seq_id)
                    out[seq_id] = None
                    continue
            out[seq_id] = self._abort(rid, seq_id)
        return out

    def _finish_late(self, r: _Replica, seq_id: int) -> None:
        """The sequence ends (EOS) just before the abort reaches it, as a live engine's
        sequence can: its finish is held back for `take_finished`."""
        self._advance(r)
        s = r.seqs.pop(seq_id)
        del r.offsets[seq_id]
        length = r.length(s)
        r.tok -= length
        _, payload = self._targets.pop((r.role, seq_id))
        self._cache_prefix(r, seq_id, length)
        generated = s.generated0 + (r.iters - s.base)
        self._held[(r.role, seq_id)] = SequenceFinished(
            self.t, r.role, r.rid, seq_id, round(length), round(generated), payload
        )
        self.late_finishes += 1
        self._resume(r)
        self._schedule(r)

    def _abort(self, rid: str, seq_id: int) -> int:
        r = self._replicas[rid]
        if r.dead is not None:  # its tokens as last refreshed
            context, done = r.dead.pop(seq_id)
            self._progress[(r.role, seq_id)] = done
            return round(context)
        self._advance(r)
        if seq_id in r.waiting:
            context, done, _ = r.waiting.pop(seq_id)
            r.cached.pop(seq_id, None)  # (re-prefilled in full wherever it goes next)
            self._progress[(r.role, seq_id)] = done
            self._resume(r)
            self._schedule(r)
            return round(context)
        s = r.seqs.pop(seq_id)
        del r.offsets[seq_id]
        length = r.length(s)
        r.tok -= length
        self._progress[(r.role, seq_id)] = s.generated0 + (r.iters - s.base)
        self._resume(r)
        self._schedule(r)
        return round(length)

    def _retract(self, r: _Replica) -> None:
        """KV cache full: retract sequences with the fewest generated tokens (ties: the
        longest context) into the engine queue until the rest have RETRACT_HEADROOM tokens
        of room each; they keep their tokens."""
        order = sorted(
            r.seqs.items(),
            key=lambda kv: (kv[1].generated0 + r.iters - kv[1].base, -r.length(kv[1]), kv[0]),
        )
        cap = r.costs.kv_capacity_tokens
        retracted = {}
        for sid, s in order:
            if len(r.seqs) <= 1 or r.tok + RETRACT_HEADROOM * len(r.seqs) <= cap:
                break
            del r.seqs[sid]
            del r.offsets[sid]
            length = r.length(s)
            r.tok -= length
            target = self._targets[(r.role, sid)][0]
            retracted[sid] = (length, s.generated0 + (r.iters - s.base), target)
            self.preempted += 1
        r.waiting = {**retracted, **r.waiting}  # retracted first: they are the oldest work

    def _cache_prefix(self, r: _Replica, sid: int, length: float) -> None:
        """A rollout turn that ends in a tool call leaves its context cached on `r`."""
        if r.role == "rollout" and sid in self._parking:
            self._parking.discard(sid)
            self._prefix[sid] = (r, length)

    def step_stats(self, role: str) -> list[tuple[float, int, int]]:
        return []  # the simulated engine follows its model: nothing to refit

    def call_tool(self, call: ToolCall) -> None:
        if self.tool_latency is None:
            raise RuntimeError("a tool call, but this SimCluster has no tool_latency")
        seconds = max(0.0, float(self.tool_latency(call)))
        self.tool_calls += 1
        result = ToolResult(call.call_id, "ok", "0", seconds)
        self._push(self.t + seconds, TOOL, "", call.call_id, result)

    def take_finished(self, role: str, seq_id: int) -> SequenceFinished:
        return self._held.pop((role, seq_id))

    def lengths(self, role: str) -> SeqLengths:
        """Context lengths of `role`'s sequences on the engines: running ones (in no
        particular order; the scheduler indexes them by id), then those an engine queues."""
        ids, offs, adds, counts = [], [], [], []
        for r in self._replicas.values():
            if r.role != role or not (r.seqs or r.waiting):
                continue  # (an empty engine's clock is brought forward when work arrives)
            self._advance(r)
            sid, off = r.offsets.arrays()
            ids.append(sid)
            offs.append(off)
            adds.append(r.iters)  # running sequences grow with the replica's iterations
            counts.append(len(sid))
            if r.waiting:  # waiting ones do not (x + 0.0 is x)
                w = len(r.waiting)
                ids.append(np.fromiter(r.waiting, np.int64, w))
                offs.append(np.fromiter((x[0] for x in r.waiting.values()), float, w))
                adds.append(0.0)
                counts.append(w)
        if not ids:
            return SeqLengths(np.zeros(0, np.int64), np.zeros(0, np.int64))
        cur = np.concatenate(offs) + np.repeat(adds, counts)
        rounded = np.floor(cur + 0.5).astype(np.int64)
        return SeqLengths(np.concatenate(ids), rounded)

    def update_weights(self, rid: str, version: int) -> None:
        r = self._replicas[rid]
        self._advance(r)
        # the read queues behind the node's other reads (the wait is 0 on a quiet node)
        r.busy_until = max(r.busy_until, self.t) + self._read(rid, r.costs.weight_update_s)
        self._push(r.busy_until, WEIGHTS, rid, 0, version)
        self._schedule(r)

    def train(self, step: int, samples: Sequence[Sample], extensions: Sequence[str] = ()) -> None:
        gpus = self.training.gpus + self.training.tp * len(extensions)
        lengths = [s.prompt_len + s.response_len for s in samples]
        groups = (TRAINING, *extensions)
        # a restarted trainer engine (sim.failures) computes nothing before it is ready
        start = max(self.t, *(self._train_ready.get(g, 0.0) for g in groups))
        seconds = self.training.step_time(lengths, gpus)
        self._start_step(_Step(step, start, seconds, groups, 0), start)

    def prefill_time(self, role: str, tokens: int) -> float:
        return self.inference[role].prefill_s_per_token * tokens

    def measured_throughput(self, role: str) -> float:
        for r in self._replicas.values():
            if r.role == role:
                self._advance(r)
        t0, tok0 = self._window[role]
        now, tok = self.t, self._tokens[role]
        self._window[role] = (now, tok)
        return (tok - tok0) / (now - t0) if now > t0 else 0.0

    def poll(self, until: float) -> list:
        """Events at the next event time (≤ until); else advance the clock to `until`."""
        heap = self._heap
        while heap:
            t, kind, key, stamp, payload = heap[0]
            if kind == FINISH:
                r = self._replicas.get(key)
                if r is None or r.version != stamp:
                    heapq.heappop(heap)
                    continue
            if t > until:
                break
            self.t = max(self.t, t)
            out = []
            while heap and heap[0][0] <= self.t:
                t, kind, key, stamp, payload = heapq.heappop(heap)
                ev = self._fire(kind, key, stamp, payload)
                if ev:
                    out.extend(ev)
            if out:
                return out
        self.t = max(self.t, until)
        return []

    def _fire(self, kind: int, key: str, stamp: int, payload: object) -> list:
        if kind == FINISH:
            r = self._replicas.get(key)
            if r is None or r.version != stamp:
                return []
            self._advance(r)
            out: list = []
            while r.next_finish() <= r.iters + 1e-6:
                _, sid = heapq.heappop(r.finishing)
                s = r.seqs.pop(sid)
                del r.offsets[sid]
                length = r.length(s)
                r.tok -= length
                target, payload_ = self._targets.pop((r.role, sid))
                self._cache_prefix(r, sid, length)
                out.append(
                    SequenceFinished(
                        self.t, r.role, r.rid, sid, round(length), round(target), payload_
                    )
                )
            if len(r.seqs) > 1 and r.tok >= r.costs.kv_capacity_tokens - 1e-6:
                self._retract(r)
            elif out:
                self._resume(r)
            self._schedule(r)
            return out
        if kind == SHIFT:
            direction, phases = payload
            if direction == "down":
                self._going_down.discard(key)
                if key in self._after_down:
                    self.shift_up(*self._after_down.pop(key))
            elif role_of(key) != TRAINING:  # serving from now: its GPUs' deaths kill it
                for g in self._gpus(key):
                    self._serving[g] = key
            else:  # training holds its GPUs from now
                self._trains.add(key)
            return [ShiftDone(self.t, key, direction, phases)]
        if kind == WEIGHTS:
            return [WeightsUpdated(self.t, key, int(payload))]
        if kind == TOOL:
            return [ToolReturned(self.t, payload)]
        if kind == DEATH:
            if stamp >= 0:  # the clock's: on GPU `stamp`, whatever it serves then
                self._push_death(self.t)
                rid = self._serving.get(stamp)
                group = self._training_group(stamp) if rid is None else None
                where = f"training engine on GPU {stamp}"
            else:  # kill(): that replica, if it serves then
                rid = key if key in self._serving.values() else None
                group = key if rid is None and key in self._trains else None
                where = f"training engine of {key}"
            if group is not None:
                return self._training_death(group, where)
            r = self._replicas.get(rid) if rid is not None else None
            if r is None or r.dead is not None:
                self.deaths_elsewhere += 1
                return []
            return [self._die(r, float(payload))]
        if self._step is None or payload != self._step.stamp:
            return []  # a try a job stop voided
        self._step = None
        self._stalled = 0
        return [TrainingDone(self.t, stamp, {"loss": float("nan")})]

    def made_tokens(self) -> tuple[float, float]:
        """(rollout, reward) tokens the engines have made so far, unfinished sequences
        included (each step's telemetry row records them: the steady work share counts
        the work done in a window; a step's own tokens may be older)."""
        for r in self._replicas.values():
            self._advance(r)
        return self._tokens["rollout"], self._tokens["reward"]
