"""The coordinator: the RL loop over the schedulers, the planner and shift execution.

One event loop over an abstract `Cluster` (docs/design.md §2). The simulator and the live MPI
runtime provide clusters; this class, its two schedulers and the planner are the same
objects in both. A deployment `Mode` (modes.py) decides when replicas shift; everything
else — dispatching sequences, migrating them on shifts (`shifts.ShiftExecutor`),
rewarding, training within the staleness bound, publishing versions, telemetry — is done
here the same way for all.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pivot_hpc.coordinator.cluster import Cluster
from pivot_hpc.coordinator.events import (
    ReplicaFailed,
    SequenceFinished,
    ShiftDone,
    ToolReturned,
    TrainingDone,
    WeightsUpdated,
)
from pivot_hpc.coordinator.hooks import Hooks
from pivot_hpc.coordinator.inference_rates import InferenceRates
from pivot_hpc.coordinator.mode_api import Mode
from pivot_hpc.coordinator.monitor import OnlineFit, ShiftClock, TrainingTime
from pivot_hpc.coordinator.rl_state import ConservationError, RLState, Sample
from pivot_hpc.coordinator.shifts import ShiftExecutor
from pivot_hpc.coordinator.turns import TurnLoop
from pivot_hpc.planner import ShiftPlan, Snapshot, Topology, TrainingState, role_of
from pivot_hpc.planner.elastic import ElasticInputs, elastic_plan
from pivot_hpc.planner.snapshot import INFERENCE_ROLES, TRAINING
from pivot_hpc.scheduler import Scheduler, SeqState
from pivot_hpc.scheduler.admission import PipelineAdmission

if TYPE_CHECKING:  # h5py is imported only by runs that write telemetry
    from pivot_hpc.telemetry import TelemetryWriter

Rewarder = Callable[[Sample, Any], tuple[float, float]]


class NullTelemetry:
    """Telemetry that records nothing (tests, dry runs): same methods as TelemetryWriter."""

    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *a, **k: None


@dataclass
class StepLog:
    start: float = 0.0
    rollout_tokens: int = 0
    reward_tokens: int = 0


@dataclass
class Stats:
    """Counters the tests and the final summary read."""

    shifts_up: int = 0
    shifts_down: int = 0
    shifts_chained: int = 0  # shift-ups sent with the shift-down on their GPUs
    training_prewarms: int = 0  # training shifted up before its batch was ready (pivot+)
    plans: int = 0
    migrated: int = 0
    rebalanced: int = 0  # sequences moved onto idle replicas (scheduler.rebalance)
    engine_failures: int = 0  # replicas whose engine died while serving
    engine_restarts: int = 0  # of those, restarted (refit from GPS) on their GPUs
    sequences_recovered: int = 0  # sequences of dead replicas kept with their tokens
    tokens_regenerated: int = 0  # decoded after the last refresh before a death (bound)
    excluded: list[str] = field(default_factory=list)  # replicas that died twice too soon
    events: int = 0  # cluster events handled
    # (step, start, end, rollout tokens, reward tokens, trained tokens) per trained step
    # (step, start, end, rollout, reward, train tokens, made rollout, made reward tokens)
    steps: list[tuple[int, float, float, int, int, int, float, float]] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)  # per step mean reward
    refits: int = 0  # throughput models refitted from measured decode steps
    trained_with_calls: int = 0  # trained samples whose trajectory called a tool


class Coordinator:
    def __init__(
        self,
        *,
        cluster: Cluster,
        topology: Topology,
        rl: RLState,
        mode: Mode,
        capacity: dict[str, int],
        rewarder: Rewarder,
        telemetry: TelemetryWriter | None = None,
        tick_s: float = 1.0,
        priority: str = "seq_id",
        migration: bool = True,
        hooks: Hooks | None = None,
        refit_shift_time: bool = False,
        refit_throughput: bool = False,
        training_time: TrainingTime | None = None,
        strategy: str = "",
        admission: PipelineAdmission | None = None,
        rebalance: bool = False,
        restart_window_s: float = 600.0,
        tool_timeout_s: float | None = None,
        horizon_s: float = 0.0,
        affinity_slack: float = 0.0,
        affinity_wait_s: float = 0.0,
    ) -> None:
        self.cluster = cluster
        self.topology = topology
        self.rl = rl
        self.mode = mode
        self.capacity = capacity
        self.rewarder = rewarder
        self.telemetry: TelemetryWriter | NullTelemetry = telemetry or NullTelemetry()
        self.tick_s = tick_s
        self.hooks = hooks or Hooks()  # checkpoints, step log, stop requests (hooks.py)
        self.schedulers = {
            # affinity_slack: a tool-calling turn's soft affinity to its last replica;
            # affinity_wait_s: how long it may wait for that replica's room (cluster time)
            r: Scheduler(
                r,
                priority=priority,
                migration=migration,
                affinity_slack=affinity_slack,
                affinity_wait_s=affinity_wait_s,
                clock=cluster.now,
            )
            for r in INFERENCE_ROLES
        }
        self.admission = admission  # scheduler.admission=pipeline: the role's running cap
        self.rebalance = rebalance  # scheduler.rebalance: idle replicas take sequences
        self.training = TrainingState()
        self.samples: dict[int, Sample] = {}
        self.steps: dict[int, StepLog] = {}
        self.stats = Stats()
        self._finished: set[tuple[str, int, float]] = set()  # see _on_finished
        self.tokens_total = 0  # rollout + reward tokens of completed steps (§8.1 throughput)
        self.first_step_start = float("inf")
        self.last_step_end = 0.0
        # no event for this long while work remains (and no training step runs): a bug
        self.stall_s = 3600.0
        # Graceful stop (a signal): once `hooks.stop_requested()` is true the coordinator
        # drains — no new rollouts, dispatches, shifts or training — until no training step
        # runs, then `run` returns with `stopped` set, leaving a state a checkpoint can hold.
        self.draining = False
        self.stopped = False
        # A stop the run asks of itself (a training engine that died twice within
        # deployment.engine_restart_window_s: shifts.py): drained and saved like a signal's,
        # with this line as its reason.
        self.stop_reason: str | None = None
        # The monitor's refits (monitor.py): τ_shift from measured shifts (the shift
        # executor's clock), A–D from the engines' decode steps; the planner sees them
        # through `self.topology`.
        self.fits = {r: OnlineFit() for r in INFERENCE_ROLES} if refit_throughput else {}
        self.shifts = ShiftExecutor(
            self,
            ShiftClock(topology.shift_time) if refit_shift_time else None,
            restart_window_s=restart_window_s,
        )
        # Elastic training (planner.elastic_training; the topology has extension slots):
        # before each step the planner picks its data-parallel size (planner/elastic.py)
        self.training_time = training_time
        self.strategy = strategy
        self._elastic_step: int | None = None  # the step whose size was decided
        self._executing = False  # a plan is being carried out (execute)
        self._train_deferred = False  # maybe_train was asked meanwhile
        self._train_t0 = 0.0
        self._generated = {r: [0, 0] for r in INFERENCE_ROLES}  # finished: tokens, count
        # tools.enabled: multi-turn rollouts (turns.py); a call's deadline is tool_timeout_s
        self.turns = (
            None
            if tool_timeout_s is None
            else TurnLoop(
                self,
                rl.source,
                call_timeout_s=tool_timeout_s,
                rolled_out=self._rolled_out,
                horizon_s=horizon_s,
            )
        )
        self.rates = InferenceRates()  # tokens per GPU-second while a role has work
        self._holdable: dict[str, tuple[Topology, bool, int]] = {}  # see _slots
        self._plannable: tuple[Topology, frozenset[int], Topology] | None = None

    # ------------------------------------------------------------- loop
    def run(self, progress: Callable[[int], None] | None = None) -> None:
        """Drive the cluster until the configured number of RL steps is trained (or, after
        a stop request, until the cluster is drained: `stopped` is then set)."""
        self.mode.start(self)
        self.release()
        self.mode.on_change(self)
        next_tick = self.cluster.now()
        last_event = next_tick
        while not self.rl.done:
            if not self.draining and (self.stop_reason or self.hooks.stop_requested()):
                self.draining = True
            if self.draining and not self.training.busy:
                self.stopped = True
                break
            # a turn waiting for its cached replica (scheduler.affinity_wait_s) is
            # dispatched when its wait ends, even if no event comes before
            wake = self._wait_until()
            now = self.cluster.now()
            events = self.cluster.poll(until=min(next_tick, wake) if wake > now else next_tick)
            self.stats.events += len(events)
            before = self.rl.version
            for ev in events:
                self.handle(ev)
            self.shifts.activate_arrived()
            if events or self.training.busy:  # a training step may take hours: not a stall
                last_event = self.cluster.now()
                if not self.draining:
                    self.mode.on_change(self)
            elif self.cluster.now() - last_event > self.stall_s:
                raise ConservationError(f"no progress for {self.stall_s:.0f} s: {self.describe()}")
            if self.cluster.now() >= self._wait_until():
                self._dispatch_waits()
            if self.cluster.now() >= next_tick:
                self.tick()
                next_tick = self.cluster.now() + self.tick_s
            if progress is not None and self.rl.version != before:
                progress(self.rl.version - before)
        self.telemetry.flush()

    def _wait_until(self) -> float:
        """When the earliest wait of a queued sequence for its preferred replica ends."""
        return min(self.schedulers[r].wait_until for r in INFERENCE_ROLES)

    def _dispatch_waits(self) -> None:
        """Dispatch the roles with a wait that ended (the scheduler recomputes theirs)."""
        now = self.cluster.now()
        for r in INFERENCE_ROLES:
            if self.schedulers[r].wait_until <= now:
                self.dispatch(r)

    def tick(self) -> None:
        self.rates.advance(self.cluster.now(), self.schedulers, self.topology)
        for role in INFERENCE_ROLES:
            self.schedulers[role].set_lengths(self.cluster.lengths(role))
        for role, fit in self.fits.items():
            fit.add(self.cluster.step_stats(role))
            model = fit.refit(max_running=self.topology.roles[role].model.max_running)
            if model is not None:
                self._set_model(role, model)
        if self.rebalance:
            for role in INFERENCE_ROLES:
                self.shifts.rebalance(role)
        self._log_throughput()
        if not self.draining:
            self.mode.on_tick(self)

    def handle(self, ev) -> None:
        self.rates.advance(self.cluster.now(), self.schedulers, self.topology)
        if isinstance(ev, SequenceFinished):
            self._on_finished(ev)
        elif isinstance(ev, ShiftDone):
            self.shifts.on_shift_done(ev)
        elif isinstance(ev, TrainingDone):
            self._on_trained(ev)
        elif isinstance(ev, WeightsUpdated):
            pass  # the replica_version was set when the update was requested (see below)
        elif isinstance(ev, ReplicaFailed):
            self.shifts.on_failure(ev)
        elif isinstance(ev, ToolReturned) and self.turns is not None:
            self.turns.on_result(ev)
        else:
            raise TypeError(f"unknown event {ev!r}")

    def _set_model(self, role: str, model) -> None:
        """A refitted throughput model: the planner and the scheduler use it from now on."""
        spec = dataclasses.replace(self.topology.roles[role], model=model)
        roles = {**self.topology.roles, role: spec}
        self.topology = dataclasses.replace(self.topology, roles=roles)
        self.schedulers[role].set_model(model)
        self.stats.refits += 1

    # ------------------------------------------------------- sequences
    def release(self) -> None:
        """Release every batch the staleness bound and the mode allow to rollout."""
        while (
            not self.draining
            and self.rl.can_release()
            and self.mode.may_release(self, self.rl.released)
        ):
            batch = self.rl.release()
            self.steps[batch[0].step] = StepLog(start=self.cluster.now())
            for s in batch:
                self.samples[s.sample_id] = s
                self._submit_rollout(s, s.prompt_len)
        self.dispatch("rollout")

    def _submit_rollout(self, s: Sample, length: int) -> None:
        """Queue `s`'s rollout (its turn, with tools: the turn loop times it)."""
        self.schedulers["rollout"].submit(SeqState(s.sample_id, length, s))
        if self.turns is not None:
            self.turns.queued(s.sample_id)

    def restore(
        self, batches: dict[int, list[Sample]], generated: dict[tuple[str, int], int]
    ) -> None:
        """Re-queue a checkpoint's unfinished samples (RLState already restored): rollouts
        and reward sequences continue from `generated[(role, sample_id)]` tokens (their
        tokens are with the cluster); rewarded samples wait for training. A group with a
        trajectory that cannot continue is first sampled again (`TurnLoop.resample_on_resume`;
        `batches` is the RL state's, so its fresh samples are queued below)."""
        if self.turns is not None:
            self.turns.resample_on_resume(self.rl)
        for step in sorted(batches):
            self.steps[step] = StepLog(start=self.cluster.now())
            for s in batches[step]:
                self.samples[s.sample_id] = s
                if s.rewarded:
                    continue
                if not s.rolled_out and self.turns is not None and self.turns.resume(s):
                    continue  # parked on a tool call: the call is issued again
                role = "reward" if s.rolled_out else "rollout"
                context = s.reward_context if s.rolled_out else s.turn_context
                length = context + generated.get((role, s.sample_id), 0)
                if role == "rollout":
                    self._submit_rollout(s, length)
                else:
                    self.schedulers[role].submit(SeqState(s.sample_id, length, s))

    def dispatch(self, role: str) -> None:
        if self.draining or self.shifts.hold_dispatch:
            return
        for seq_id, rid in self.schedulers[role].dispatch():
            self.start_sequence(role, rid, seq_id)

    def start_sequence(self, role: str, rid: str, seq_id: int) -> None:
        s = self.samples[seq_id]
        if role == "rollout" and s.version_start < 0:
            s.version_start = self.shifts.replica_version.get(rid, self.rl.version)
        if role == "rollout" and self.turns is not None:
            self.turns.dispatched(seq_id)
        self.cluster.start(rid, s, role)

    def finish_early(self, ev: SequenceFinished) -> None:
        """Handle a finish found by a too-late abort; skip it if it is delivered again."""
        self._on_finished(ev)
        self._finished.add((ev.role, ev.seq_id, ev.t))

    def _on_finished(self, ev: SequenceFinished) -> None:
        key = (ev.role, ev.seq_id, ev.t)
        if key in self._finished:  # handled early, when an abort came too late
            self._finished.discard(key)
            return
        sched = self.schedulers[ev.role]
        if sched.location(ev.seq_id) != ev.rid:
            raise ConservationError(
                f"{ev.role} sequence {ev.seq_id} finished on {ev.rid} but the scheduler has it "
                f"on {sched.location(ev.seq_id)}"
            )
        sched.finish(ev.seq_id)
        gen = self._generated[ev.role]
        gen[0] += ev.generated
        gen[1] += 1
        self.rates.finished(ev.role, ev.generated)
        if self.admission is not None:
            self.admission.observe(ev.role, ev.generated)
            sched.replica_limit = self.admission.replica_limit(ev.role, self._slots(ev.role))
        s = self.samples[ev.seq_id]
        log = self.steps[s.step]
        if ev.role == "rollout":
            log.rollout_tokens += ev.generated
            if self.turns is None:
                self._rolled_out(s, ev.generated, ev.result)
            elif self.turns.on_turn(s, ev):  # the trajectory's last turn
                self._rolled_out(s, self.turns.source.response_len(s), ev.result)
        else:
            verifiable, genrm = self.rewarder(s, ev.result)
            self.rl.reward_done(s, verifiable, genrm, ev.generated)
            log.reward_tokens += ev.generated
            dropped, fresh = self.rl.resample(s)
            for x in dropped:  # uninformative: never trained (DAPO dynamic sampling)
                del self.samples[x.sample_id]
            for x in fresh:
                self.samples[x.sample_id] = x
                self._submit_rollout(x, x.prompt_len)
            if fresh:
                self.dispatch("rollout")
        self.dispatch(ev.role)
        self.maybe_train()

    def _rolled_out(self, s: Sample, generated: int, result: Any) -> None:
        """`s`'s rollout is over (`generated`: its response's tokens): judge it next."""
        self.rl.rollout_done(s, generated)
        context = self.rl.source.on_rollout(s, generated, result)
        s.reward_context = context
        self.schedulers["reward"].submit(SeqState(s.sample_id, context, s))
        self.dispatch("reward")

    def _slots(self, role: str) -> int:
        """Slots `role` can hold: not training's own GPUs (training holds them but for a
        "0 or N" shift-down, so sizing pipeline admission over them halved its cap).
        Asked at every finish: counted once per topology and training state."""
        topo, active = self.topology, self.training.active
        cached = self._holdable.get(role)
        if cached is None or cached[0] is not topo or cached[1] != active:
            busy = set(topo.training_gpus) if active else set()
            n = sum(not busy & set(g) for g in topo.roles[role].slots.values())
            cached = self._holdable[role] = (topo, active, n)
        return cached[2]

    # ---------------------------------------------------------- training
    def maybe_train(self) -> None:
        tr = self.training
        if self._executing:  # (a late finish inside a plan's take_down: see execute)
            self._train_deferred = True
            return
        if self.draining or not tr.active or tr.busy or TRAINING in self.shifts.shifting:
            return
        if not self.rl.batch_ready():
            return
        if self.topology.elastic:
            if self._extensions_coming():
                return  # the step's size is decided: it starts once they are up
            if self._elastic_step != self.rl.version:
                self._elastic_step = self.rl.version
                plan = self._elastic_plan()
                if plan is not None:
                    self.execute(plan)
                    if self._extensions_coming() or tr.busy:
                        return
        batch = self.rl.begin_training()
        tr.busy = True
        self._train_t0 = self.cluster.now()
        self.cluster.train(batch[0].step, batch, sorted(tr.extensions))

    def _extensions_coming(self) -> bool:
        return any(
            role_of(r) == TRAINING and kind == "up" for r, kind in self.shifts.shifting.items()
        ) or any(role_of(r) == TRAINING for r in self.shifts.pending_up)

    def _elastic_plan(self) -> ShiftPlan | None:
        """The planner's data-parallel size for the step about to start (elastic.py)."""
        lengths = [s.prompt_len + s.response_len for s in self.rl.batches[self.rl.version]]
        model = self.training_time
        step_time = None
        if model is not None and model.ready():
            # asked for a few sizes, each many times (elastic.py): each costs a pass
            step_time = functools.cache(lambda gpus: model.step_time(lengths, gpus))
        moving = [*self.shifts.shifting, *self.shifts.pending_up]
        work = self._inference_work()
        inputs = ElasticInputs(
            step_time=step_time,
            reshard_s=self.topology.shift_time.training,
            work_tokens=sum(work.values()),
            value_rate=self._measured_rate(),
            unavailable=frozenset(g for rid in moving for g in self.topology.gpus_of(rid)),
            inference_gpu_s=self.rates.gpu_seconds(work),
        )
        return elastic_plan(self.snapshot(), inputs, strategy=self.strategy)

    def _inference_work(self) -> dict[str, float]:
        """Tokens each inference role still has to make for the released work: every
        sequence at the mean length its role's sequences finished with (a rollout also
        needs its judgement); inf while a role with work has finished none."""
        n_ro, n_rm = self.schedulers["rollout"].n_seq, self.schedulers["reward"].n_seq
        need = {"rollout": n_ro, "reward": n_ro + n_rm}
        work = dict.fromkeys(need, 0.0)
        for role, n in need.items():
            if not n:
                continue
            tokens, count = self._generated[role]
            work[role] = n * tokens / count if count else float("inf")
        return work

    def _measured_rate(self) -> float:
        """Rollout + reward tokens/s over the steps trained so far (0 before the first)."""
        span = self.last_step_end - self.first_step_start
        return self.tokens_total / span if span > 0 else 0.0

    def _on_trained(self, ev: TrainingDone) -> None:
        batch = self.rl.end_training(ev.step)
        self.training.busy = False
        if self.training_time is not None:
            gpus = len(self.topology.training_gpus) + self.topology.training_tp * len(
                self.training.extensions
            )
            lengths = [s.prompt_len + s.response_len for s in batch]
            self.training_time.observe(lengths, gpus, ev.t - self._train_t0)
        log = self.steps.pop(ev.step)
        stale = [self.rl.version - 1 - s.version_start for s in batch]
        if max(stale) > self.rl.staleness:
            raise ConservationError(
                f"step {ev.step}: staleness {max(stale)} exceeds the bound {self.rl.staleness}"
            )
        self.stats.staleness.extend(stale)
        self.stats.trained_with_calls += sum(s.tool_calls > 0 for s in batch)
        n = len(batch)
        rewards = [s.reward for s in batch]
        mean = sum(rewards) / n
        self.stats.rewards.append(mean)
        self.tokens_total += log.rollout_tokens + log.reward_tokens
        self.first_step_start = min(self.first_step_start, log.start)
        self.last_step_end = ev.t
        train_tokens = sum(s.prompt_len + s.response_len for s in batch)
        made = self.cluster.made_tokens()
        self.stats.steps.append(
            (ev.step, log.start, ev.t, log.rollout_tokens, log.reward_tokens, train_tokens, *made)
        )
        self.telemetry.step(
            ev.step,
            start=log.start,
            end=ev.t,
            rollout_tokens=log.rollout_tokens,
            reward_tokens=log.reward_tokens,
            train_tokens=train_tokens,
            samples=n,
            reward_mean=mean,
            reward_verifiable_mean=sum(s.reward_verifiable for s in batch) / n,
            reward_genrm_mean=sum(s.reward_genrm for s in batch) / n,
            loss=float(ev.metrics.get("loss", float("nan"))),
            staleness_max=max(stale),
            staleness_mean=sum(stale) / n,
            version=self.rl.version,
            made_rollout_tokens=made[0],
            made_reward_tokens=made[1],
            skipped_nonfinite=int(ev.metrics.get("skipped_nonfinite", 0)),
        )
        for s in batch:
            self.telemetry.trained(
                ev.step,
                sample_id=s.sample_id,
                prompt_index=s.prompt_index,
                group=s.group,
                version_start=s.version_start,
                response_tokens=s.response_len,
                reward=s.reward,
                tool_calls=s.tool_calls,
            )
        self.telemetry.flush()
        for s in batch:
            del self.samples[s.sample_id]
        self.hooks.on_step(
            self,
            ev.step,
            {
                "reward": mean,
                "filtered_groups": float(self.rl.filtered.get(ev.step, 0)),
                "t": ev.t,
                "start": log.start,
                "rollout_tokens": log.rollout_tokens,
                "reward_tokens": log.reward_tokens,
                **ev.metrics,
            },
        )
        for rid in list(self.schedulers["rollout"].replicas):
            if rid not in self.shifts.shifting:
                self.shifts.send_version(rid)
        self.release()
        self.maybe_train()

    def describe(self) -> str:
        """One line of state for error messages."""
        ro, rm = self.schedulers["rollout"], self.schedulers["reward"]
        return (
            f"version {self.rl.version}/{self.rl.steps}, released {self.rl.released}, "
            f"rollout {len(ro.replicas)} replicas {ro.n_running} running {ro.n_queued} queued, "
            f"reward {len(rm.replicas)} replicas {rm.n_running} running {rm.n_queued} queued, "
            f"training active={self.training.active} busy={self.training.busy} "
            f"extensions={sorted(self.training.extensions)}, "
            f"shifting {sorted(self.shifts.shifting)}, pending {self.shifts.pending_up}"
        )

    # ------------------------------------------- what modes and the run ask (ModeView)
    def request_up(self, rids: Iterable[str]) -> None:
        self.shifts.request_up(rids)

    def take_down(self, rids: Iterable[str]) -> None:
        self.shifts.take_down(rids)

    def idle(self) -> bool:
        return self.shifts.idle()

    def settled(self) -> bool:
        return self.shifts.settled()

    def execute(self, plan: ShiftPlan) -> None:
        """Carry out a plan. Training does not start in the middle of one: a sequence that
        finished just before its abort landed is handled inside the plan's take-down, and
        its `maybe_train` would start the step between the plan's downs and its ups (an
        elastic extension then joins with the previous policy version)."""
        self._executing = True
        try:
            self.shifts.execute(plan)
        finally:
            self._executing = False
        if self._train_deferred:
            self._train_deferred = False
            self.maybe_train()

    def training_waits(self) -> bool:
        return not self.training.active and self.rl.batch_ready()

    def training_idle(self) -> bool:
        return self.training.active and not self.training.busy

    def allocation(self) -> dict[str, int]:
        return self.shifts.allocation()

    @property
    def shift_clock(self) -> ShiftClock | None:
        return self.shifts.clock

    # ----------------------------------------------------------- planner
    def snapshot(self) -> Snapshot:
        self.training.batch_ready = self.rl.batch_ready()
        self.training.batch_pending = not self.training.batch_ready and (
            self.rl.released > self.rl.version
        )
        parked = {}
        prefix: dict[str, tuple[int, int]] = {}  # replica -> prefixes it caches (parked)
        if self.turns is not None and self.turns.parked:
            due = self.turns.due_within(self.cluster.now(), self.turns.horizon_s)
            parked = {"rollout": due}
            prefix = self.turns.prefix_due(self.cluster.now(), self.turns.horizon_s)
        return Snapshot(
            self._plannable_topology(),
            self.schedulers,
            self.training,
            self.shifts.unrepaid(),
            parked_due=parked,
            parked_prefix=prefix,
        )

    def _plannable_topology(self) -> Topology:
        """The topology without the GPUs of engines in recovery (ShiftExecutor.settled):
        the planner plans around them (training keeps its own GPUs: a training shift-up
        that needs them takes them over from the restart)."""
        gpus = self.shifts.recovering_gpus()
        if not gpus:
            return self.topology
        cached = self._plannable
        if cached is None or cached[0] is not self.topology or cached[1] != gpus:
            cached = self._plannable = (self.topology, gpus, self.topology.without_gpus(gpus))
        return cached[2]

    # --------------------------------------------------------- telemetry
    def _log_throughput(self) -> None:
        t = self.cluster.now()
        for role in INFERENCE_ROLES:
            s = self.schedulers[role]
            n_tok = sum(v.n_tok for v in s.replica_views())
            self.telemetry.throughput(
                t,
                role=role,
                replicas=len(s.replicas),
                gpus=len(s.replicas) * self.topology.roles[role].tp,
                n_seq=s.n_seq,
                n_queued=s.n_queued,
                n_tok=n_tok,
                tokens_per_s=self.cluster.measured_throughput(role),
                est_tokens_per_s=s.throughput(),
                n_parked=self.turns.n_parked if self.turns and role == "rollout" else 0,
            )
