"""Shift execution (paper §5.2, §6.2): the coordinator's GPUs changing roles.

A shift down first aborts the replica's sequences on the cluster (their tokens come back),
updates the scheduler and lets Alg. 3 re-dispatch them; a shift up waits until its GPUs
are free (their previous occupants finished shifting down), then the replica loads
weights from GPS and Alg. 4 fills and balances it. An inference replica taking over
exactly the GPUs of one replica shifting down is sent up at once, chained after that
down (the cluster starts it when the down is done), instead of when the coordinator
hears the down is done. This object holds what is in motion —
which replica owns or is shifting on each GPU, the shift-ups waiting for GPUs, each
rollout replica's policy version — and logs every shift, migration, plan and allocation.
It works on its coordinator's schedulers, cluster and RL state (`c`).
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from pivot_hpc.coordinator.cluster import Cluster
from pivot_hpc.coordinator.events import ReplicaFailed, SequenceFinished, ShiftDone
from pivot_hpc.coordinator.monitor import ShiftClock
from pivot_hpc.coordinator.rl_state import ConservationError, RLState
from pivot_hpc.planner import ShiftPlan, Topology, TrainingState, role_of
from pivot_hpc.planner.snapshot import INFERENCE_ROLES, TRAINING, SnapshotError
from pivot_hpc.scheduler import MigrationResult, Scheduler


class ShiftHost(Protocol):
    """What shift execution uses of its coordinator."""

    cluster: Cluster
    topology: Topology  # replaced when τ_shift is refitted
    schedulers: Mapping[str, Scheduler]
    training: TrainingState
    rl: RLState
    capacity: Mapping[str, int]
    telemetry: Any
    # counters: shifts_up, shifts_down, shifts_chained, training_prewarms, plans, migrated,
    # rebalanced
    stats: Any
    draining: bool
    stop_reason: str | None  # set: the run stops itself (drains and saves, as on a signal)

    def dispatch(self, role: str) -> None: ...

    def maybe_train(self) -> None: ...

    def start_sequence(self, role: str, rid: str, seq_id: int) -> None: ...

    def finish_early(self, ev: SequenceFinished) -> None: ...


class ShiftExecutor:
    def __init__(
        self, coordinator: ShiftHost, clock: ShiftClock | None, restart_window_s: float = 600.0
    ) -> None:
        self.c = coordinator
        self.clock = clock  # τ_shift refit from the shifts measured here (None: off)
        self.owner: dict[int, str] = {}  # GPU -> replica holding or shifting on it
        self.shifting: dict[str, str] = {}  # rid -> "up" | "down"
        self.pending_up: list[str] = []  # replicas waiting for their GPUs to free
        self.chained: dict[str, str] = {}  # shifting-down rid -> the rid shifting up after it
        # Policy version each rollout replica decodes with: set when its load is requested,
        # because a replica applies a weight update before it decodes anything else.
        self.replica_version: dict[str, int] = {}
        self.up_version: dict[str, int] = {}  # version a shifting-up replica reads
        self.plan_of: dict[str, tuple[int, float, float]] = {}  # rid -> plan id, φ, benefit
        self.plan_id = 0
        self._allocation: tuple[int, ...] | None = None
        self._arrived: dict[str, list[str]] = {}  # replicas up, waiting for Alg. 4
        self._shift_t0: dict[str, float] = {}  # rid -> when its shift was requested
        self.hold_dispatch = False  # see take_down
        # (up role, down role) -> when the last plan that moved GPUs the other way repays
        # its penalty: its break-even φ / (T_expected − T_current) after the decision.
        # Until then a plan that moves them back undoes a shift that has not paid (pivot+).
        self.repaid_at: dict[tuple[str, str], float] = {}
        # Engine deaths (on_failure): when each replica last died; the replicas to start
        # again once their shift-down is done; those that died twice within the window.
        self.restart_window_s = restart_window_s
        self.died_at: dict[str, float] = {}
        self.restarting: set[str] = set()  # shifting down, to be started again
        self.excluding: set[str] = set()  # shifting down, their GPUs then leave inference
        self.reviving: set[str] = set()  # restarted: waiting for or shifting up again
        self.retiring: set[str] = set()  # reviving, superseded: down again once up

    def gpus_free(self, rid: str) -> bool:
        return all(g not in self.owner for g in self.c.topology.gpus_of(rid))

    def request_up(self, rids: Iterable[str]) -> None:
        for rid in rids:
            if rid in self.retiring:  # coming up again already: let it stay
                self.retiring.discard(rid)
                continue
            if rid in self.recovering():
                continue  # its restart brings it up (or its GPUs are leaving)
            if rid in self.shifting or self._is_up(rid):
                raise ConservationError(f"{rid} is already up or shifting")
            self._supersede_restarts(rid)
            self.pending_up.append(rid)
        self._start_pending()

    def recovering(self) -> set[str]:
        """Replicas in an engine recovery (on_failure): shifting down after their death,
        restarting, or excluded. They are no plan's doing and no plan waits for them."""
        return self.restarting | self.excluding | self.reviving | self.retiring

    def recovering_gpus(self) -> frozenset[int]:
        gpus = self.c.topology.gpus_of
        return frozenset(g for rid in self.recovering() for g in gpus(rid))

    def _supersede_restarts(self, rid: str) -> None:
        """`rid` is asked up on GPUs that a dead engine's restart holds: the GPUs go to
        `rid` instead (a mode moved on, e.g. colocated's next stage, or training needs
        its GPUs). A restart not yet begun is dropped; one shifting up goes down again as
        soon as it is up; an excluded replica's GPUs leave inference whatever happens."""
        for g in self.c.topology.gpus_of(rid):
            owner = self.owner.get(g)
            if owner in self.restarting:  # the GPUs' next engine is `rid`'s: still a restart
                self.restarting.discard(owner)
                self.c.stats.engine_restarts += 1
            elif owner in self.reviving and self.shifting.get(owner) == "up":
                self.retiring.add(owner)
        for other in [r for r in self.pending_up if r in self.reviving]:
            if set(self.c.topology.gpus_of(other)) & set(self.c.topology.gpus_of(rid)):
                self.pending_up.remove(other)
                self.reviving.discard(other)

    def _is_up(self, rid: str) -> bool:
        if role_of(rid) == TRAINING:
            return self.c.training.holds(rid)
        return rid in self.c.schedulers[role_of(rid)].replicas

    def _start_pending(self) -> None:
        waiting = []
        for rid in self.pending_up:
            free = self.gpus_free(rid)
            if not free and rid in self.reviving:  # its GPUs went to a replica asked up
                self.reviving.discard(rid)
                continue
            after = None if free else self._chainable(rid)
            if not free and after is None:
                waiting.append(rid)
                continue
            self.shifting[rid] = "up"
            self.up_version[rid] = self.c.rl.version
            if after is None:
                for g in self.c.topology.gpus_of(rid):
                    self.owner[g] = rid
                self._shift_t0[rid] = self.c.cluster.now()
                self.c.cluster.shift_up(rid, self.c.rl.version)
            else:  # its GPUs pass to it when `after` is down (on_shift_done)
                self.chained[after] = rid
                self.c.stats.shifts_chained += 1
                self.c.cluster.shift_up(rid, self.c.rl.version, after=after)
        self.pending_up = waiting

    def _chainable(self, rid: str) -> str | None:
        """The replica shifting down on exactly `rid`'s GPUs, if `rid` may follow it at
        once: the up command goes out with the down, so the GPUs do not wait for the down's
        acknowledgement to reach the coordinator and the up command to reach them (two
        messages to busy processes; on the live tiny run they were ~15 of the ~40 ms a GPU
        spent changing roles)."""
        if role_of(rid) == TRAINING:
            return None  # a joining trainer waits for the optimizer state it reads
        gpus = self.c.topology.gpus_of(rid)
        owners = {self.owner.get(g) for g in gpus}
        if len(owners) != 1:
            return None
        (down,) = owners
        if (
            down is None
            or self.shifting.get(down) != "down"
            or down in self.chained
            or down in self.excluding  # its GPUs leave inference when it is down
            or sorted(self.c.topology.gpus_of(down)) != sorted(gpus)
        ):
            return None
        return down

    def take_down(self, rids: Iterable[str]) -> None:
        """Shift replicas down: abort + migrate their sequences (Alg. 3), then release GPUs."""
        by_role: dict[str, list[str]] = defaultdict(list)
        now = self.c.cluster.now()
        for rid in rids:
            if rid in self.shifting:
                raise ConservationError(f"{rid} is already shifting")
            by_role[role_of(rid)].append(rid)
            self._shift_t0[rid] = now  # its GPUs are lost from here (aborts included)
        for role, group in by_role.items():
            if role == TRAINING:
                if self.c.training.busy:
                    raise ConservationError("training cannot shift down while it trains")
                for rid in group:
                    if not self.c.training.holds(rid):
                        raise ConservationError(f"{rid} shifts down but training does not hold it")
                    if rid == TRAINING:
                        self.c.training.active = False
                    else:
                        self.c.training.extensions.discard(rid)
                    self.shifting[rid] = "down"
                    self.c.cluster.shift_down(rid)
                continue
            sched = self.c.schedulers[role]
            t0 = time.perf_counter()
            where = {seq.seq_id: rid for rid in group for seq in sched.running_on(rid)}
            lengths, finished = {}, []
            for seq_id, length in self.c.cluster.abort(where).items():
                if length is None:  # it finished before the abort reached it
                    finished.append(self.c.cluster.take_finished(role, seq_id))
                else:
                    lengths[seq_id] = length
            sched.set_lengths(lengths)
            abort_s = time.perf_counter() - t0
            # Late finishes leave the scheduler before it migrates the rest; nothing may be
            # dispatched onto the replicas going down meanwhile (their finish handling
            # dispatches), so dispatching waits until they are gone.
            self.hold_dispatch = True
            try:
                for ev in finished:
                    self.c.finish_early(ev)
            finally:
                self.hold_dispatch = False
            res = sched.shift_down(group)
            for seq_id, rid in res.dispatched:
                self.c.start_sequence(role, rid, seq_id)
            self._log_migration(role, "down", res, abort_s)
            for rid in group:
                self.shifting[rid] = "down"
                self.c.cluster.shift_down(rid)
            if finished:
                for r in INFERENCE_ROLES:
                    self.c.dispatch(r)

    def on_shift_done(self, ev: ShiftDone) -> None:
        rid = ev.rid
        if self.shifting.pop(rid, None) != ev.kind:
            raise ConservationError(f"unexpected shift-{ev.kind} completion of {rid}")
        role = role_of(rid)
        started = self._shift_t0.pop(rid, None)
        if self.clock is not None and started is not None:
            self.clock.observe(role, ev.kind, ev.t - started)
            self.c.topology = self.c.topology.with_shift_time(self.clock.shift_times())
        plan_id, phi, benefit = self.plan_of.pop(rid, (0, 0.0, 0.0))
        gpus = len(self.c.topology.gpus_of(rid))
        ph = ev.phases
        self.c.telemetry.shift(
            ev.t,
            kind=ev.kind,
            role=role,
            replica=rid,
            gpus=gpus,
            plan_id=plan_id,
            penalty=phi,
            benefit=benefit,
            discard_s=ph.get("discard_s", 0.0),
            read_s=ph.get("read_s", 0.0),
            offload_s=ph.get("offload_s", 0.0),
            reload_s=ph.get("reload_s", 0.0),
            total_s=sum(ph.values()),
        )
        if ev.kind == "down":
            self.c.stats.shifts_down += 1
            follower = self.chained.pop(rid, None)
            for g in self.c.topology.gpus_of(rid):
                if self.owner.get(g) == rid:
                    del self.owner[g]
                    if follower is not None:
                        self.owner[g] = follower
            if follower is not None:  # its own shift starts now (τ_shift measures this)
                self._shift_t0[follower] = ev.t
            self.replica_version.pop(rid, None)
            self.retiring.discard(rid)
            if rid in self.excluding:  # its GPUs leave the inference roles
                self.excluding.discard(rid)
                self.c.topology = self.c.topology.without_gpus(self.c.topology.gpus_of(rid))
                self._drop_vanished()
            if rid in self.restarting:  # a fresh engine, refit from GPS before it serves
                self.restarting.discard(rid)
                self.c.stats.engine_restarts += 1
                self.reviving.add(rid)
                self.pending_up.append(rid)
            self._start_pending()
        elif rid in self.retiring:  # superseded while it came up: its GPUs are wanted
            self.c.stats.shifts_up += 1
            self.reviving.discard(rid)
            self._shift_t0[rid] = ev.t
            self.shifting[rid] = "down"
            self.c.cluster.shift_down(rid)
        else:
            self.c.stats.shifts_up += 1
            self.reviving.discard(rid)
            if role == TRAINING:
                if rid == TRAINING:
                    self.c.training.active = True
                else:
                    self.c.training.extensions.add(rid)
                self.c.maybe_train()
            else:
                if role == "rollout":  # a step trained while it read: load that policy
                    self.send_version(rid, have=self.up_version.pop(rid, self.c.rl.version))
                self._arrived.setdefault(role, []).append(rid)
        self._log_allocation()

    def _drop_vanished(self) -> None:
        """Shift-ups waiting for GPUs an exclusion took out of the topology: their slot
        is gone, so they never come (the mode or planner sees the smaller cluster)."""
        keep = []
        for rid in self.pending_up:
            try:
                self.c.topology.gpus_of(rid)
            except SnapshotError:
                self.plan_of.pop(rid, None)
                continue
            keep.append(rid)
        self.pending_up = keep

    def on_failure(self, ev: ReplicaFailed) -> None:
        """An engine process died: for a serving replica, an unplanned shift-down. Its
        sequences come back with the tokens kept for them and run elsewhere (Alg. 3; the
        dead engine's worker answers the aborts); the replica is then started again on its
        GPUs (the shift-up reads the current policy from GPS before it serves), or, dying
        within the restart window of its last death, excluded. The engine of a role its
        GPU was not serving is replaced at that GPU's next shift-up (the worker drops it)."""
        if ev.role == TRAINING:
            self._training_failed(ev)
            return
        stats = self.c.stats
        stats.engine_failures += 1
        stats.sequences_recovered += ev.sequences
        stats.tokens_regenerated += ev.tokens_lost
        rid, role = ev.rid, ev.role
        arrived = rid in self._arrived.get(role, [])  # up, not yet filled (Alg. 4)
        serving = bool(rid) and rid not in self.shifting
        serving = serving and (rid in self.c.schedulers[role].replicas or arrived)
        last = self.died_at.get(rid) if serving else None
        again = last is not None and ev.t - last < self.restart_window_s
        if serving:
            self.died_at[rid] = ev.t
        self.c.telemetry.failure(
            ev.t,
            replica=rid or ev.where,
            role=role,
            action="excluded" if again else "restart" if serving else "replaced",
            sequences=ev.sequences,
            tokens_kept=ev.tokens_kept,
            tokens_lost=ev.tokens_lost,
            cause=ev.cause[:200],
        )
        print(f"pivot-hpc: {rid or ev.where}: {ev.cause}", flush=True)
        if not serving:
            return
        if again:
            stats.excluded.append(rid)
            print(
                f"pivot-hpc: {rid} died again {ev.t - last:.0f}s after its last death "
                f"(deployment.engine_restart_window_s={self.restart_window_s:g}): its GPUs "
                f"{list(self.c.topology.gpus_of(rid))} leave the inference roles",
                flush=True,
            )
        (self.excluding if again else self.restarting).add(rid)
        if arrived:  # nothing runs on it yet: straight down
            self._arrived[role].remove(rid)
            self._shift_t0[rid] = self.c.cluster.now()
            self.shifting[rid] = "down"
            self.c.cluster.shift_down(rid)
        else:
            self.take_down([rid])

    def _training_failed(self, ev: ReplicaFailed) -> None:
        """A training engine's process died between steps (`rl.trainer.process: child`):
        the training set replaces its children on the same GPUs, refit from GPS (the policy
        and the optimizer state of the current version), before its next step or
        checkpoint (runtime/worker.py), so nothing moves here. Training counts as one
        engine: a death of any of its processes within the restart window of the last
        stops the job (the coordinator drains and the job saves a checkpoint, as on a stop
        signal): training cannot be excluded (nothing else would train)."""
        stats = self.c.stats
        stats.engine_failures += 1
        last = self.died_at.get(TRAINING)
        again = last is not None and ev.t - last < self.restart_window_s
        self.died_at[TRAINING] = ev.t
        self.c.telemetry.failure(
            ev.t,
            replica=TRAINING,
            role=TRAINING,
            action="stopped" if again else "restart",
            sequences=0,
            tokens_kept=0,
            tokens_lost=0,
            cause=ev.cause[:200],
        )
        print(f"pivot-hpc: {ev.where}: {ev.cause}", flush=True)
        if again:  # drained and checkpointed like a stop signal (its worker restarted it)
            self.c.stop_reason = (
                f"the {ev.where} died {ev.t - last:.0f}s after the last training engine death "
                f"(deployment.engine_restart_window_s={self.restart_window_s:g}): training "
                "cannot be excluded, so the job stops"
            )
            print(
                f"pivot-hpc: {self.c.stop_reason}; saving a checkpoint to resume from", flush=True
            )
        stats.engine_restarts += 1

    def send_version(self, rid: str, have: int | None = None) -> None:
        """The one place a rollout replica is told the current policy version (it loads
        it from GPS before it decodes anything else; commands reach it in order). `have`:
        the version it is known to hold — nothing is sent when that is current."""
        version = self.c.rl.version
        if have is None or have < version:
            self.c.cluster.update_weights(rid, version)
        self.replica_version[rid] = version

    def activate_arrived(self) -> None:
        """Alg. 4 once per role for every replica that finished shifting up at this instant."""
        if self.c.draining:
            return  # they stay idle; a resumed run starts its own allocation
        arrived, self._arrived = self._arrived, {}
        for role, rids in arrived.items():
            for rid in rids if role == "rollout" else []:
                # a step that ended after its shift completed (the same batch of events)
                # updated only the replicas the scheduler had: load that policy before
                # anything is dispatched here (commands reach it in order)
                self.send_version(rid, have=self.replica_version.get(rid, self.c.rl.version))
            sched = self.c.schedulers[role]
            if sched.n_running:
                sched.set_lengths(self.c.cluster.lengths(role))
            spec = self.c.topology.roles[role]
            t0 = time.perf_counter()
            res = sched.shift_up([(rid, self.c.capacity[role], spec.model) for rid in rids])
            self._carry_out(role, "up", res, time.perf_counter() - t0)

    def rebalance(self, role: str) -> None:
        """`scheduler.rebalance`: move sequences onto the role's idle replicas (see
        `Scheduler.rebalance`) — not while the role shifts, whose Alg. 3/4 will."""
        if self.c.draining or any(role_of(r) == role for r in self.shifting):
            return
        sched = self.c.schedulers[role]
        t0 = time.perf_counter()
        res = sched.rebalance()
        if res.migrations:
            self.c.stats.rebalanced += self._carry_out(
                role, "rebalance", res, time.perf_counter() - t0
            )

    def _carry_out(self, role: str, kind: str, res: MigrationResult, plan_s: float) -> int:
        """Make the cluster follow the scheduler's moves (Alg. 4): the net effect of each —
        stop a moved sequence where it runs, start it where it ends up (it may have moved
        twice within one migration) — with a sequence that finished before its abort
        arrived finished where the scheduler has it now. Returns how many sequences moved."""
        sched = self.c.schedulers[role]
        moving, starts = res.net_moves()
        t1 = time.perf_counter()
        lengths, finished = {}, []
        for seq_id, length in self.c.cluster.abort(moving).items():
            if length is None:  # finished on its source before the abort reached it
                finished.append(self.c.cluster.take_finished(role, seq_id))
            else:
                lengths[seq_id] = length
        abort_s = time.perf_counter() - t1 + plan_s
        if lengths:
            sched.set_lengths(lengths)
        for ev in finished:  # the scheduler already moved it: finish it where it is now
            self.c.finish_early(dataclasses.replace(ev, rid=sched.location(ev.seq_id)))
        done = {ev.seq_id for ev in finished}
        for seq_id, dst in starts.items():
            if seq_id not in done:
                self.c.start_sequence(role, dst, seq_id)
        self._log_migration(role, kind, res, abort_s)
        return len(starts)

    def _log_migration(self, role: str, kind: str, res: MigrationResult, abort_s: float) -> None:
        moved = len(res.dispatched)
        if not moved and not res.aborted:
            return
        self.c.stats.migrated += len(res.aborted)
        per_dst: dict[str, int] = defaultdict(int)
        sched = self.c.schedulers[role]
        for seq_id, dst in dict(res.dispatched).items():
            if seq_id in sched:  # (not if it finished before its abort landed)
                per_dst[dst] += sched.sequence(seq_id).length
        reprefill = max(
            (self.c.cluster.prefill_time(role, n) for n in per_dst.values()), default=0.0
        )
        self.c.telemetry.migration(
            self.c.cluster.now(),
            role=role,
            kind=kind,
            sequences=moved,
            abort_s=abort_s,
            dispatch_s=res.dispatch_s + res.migrate_s,
            reprefill_s=reprefill,
        )

    def idle(self) -> bool:
        """No shift in flight or waiting: the allocation is what the schedulers say."""
        return not self.shifting and not self.pending_up

    def settled(self) -> bool:
        """No shift in flight or waiting but engine recoveries: a mode may move on and
        the planner may plan (around the recovering GPUs: `recovering_gpus`). Waiting for
        `idle` instead starved both when engines died faster than they restart."""
        moving = self.recovering()
        return all(r in moving for r in self.shifting) and all(r in moving for r in self.pending_up)

    def execute(self, plan: ShiftPlan) -> None:
        """Log a planner decision and carry it out (shift down first, then up)."""
        self.plan_id += 1
        self.c.stats.plans += 1
        t = plan.timings
        self.c.telemetry.planner(
            self.c.cluster.now(),
            plan_id=self.plan_id,
            strategy=plan.strategy,
            up_role=plan.up_role or "",
            n_up=len(plan.up),
            n_down=len(plan.down),
            candidates=len(plan.candidates),
            preprocess_s=t.preprocess_s,
            construct_s=t.construct_s,
            simulate_s=t.simulate_s,
            benefit=plan.benefit,
            throughput_current=plan.throughput_current,
            throughput_expected=plan.throughput_expected,
        )
        if plan.is_noop:
            return
        for rid in plan.up + plan.down:
            self.plan_of[rid] = (self.plan_id, plan.penalty, plan.benefit)
        if TRAINING in plan.up and not plan.mandatory:
            self.c.stats.training_prewarms += 1  # (not for its batch: planner/prewarm.py)
        self._note_repayment(plan)
        self.take_down(plan.down)
        self.request_up(plan.up)
        self._log_allocation()

    def _note_repayment(self, plan: ShiftPlan) -> None:
        gain = plan.throughput_expected - plan.throughput_current
        if plan.mandatory or plan.penalty <= 0 or gain <= 0:
            return  # free or forced: nothing to repay
        at = self.c.cluster.now() + plan.penalty / gain
        for role in {role_of(rid) for rid in plan.down} - {plan.up_role}:
            back = (role, plan.up_role)  # the reverse plan: `role` up, the up role down
            self.repaid_at[back] = max(at, self.repaid_at.get(back, 0.0))

    def unrepaid(self) -> frozenset[tuple[str, str]]:
        """(up role, down role) shifts that would undo a plan before it has repaid φ."""
        now = self.c.cluster.now()
        self.repaid_at = {k: t for k, t in self.repaid_at.items() if t > now}
        return frozenset(self.repaid_at)

    def allocation(self) -> dict[str, int]:
        count = {"rollout": 0, "reward": 0, "training": 0, "transition": 0}
        for rid in set(self.owner.values()):
            gpus = len(self.c.topology.gpus_of(rid))
            count["transition" if rid in self.shifting else role_of(rid)] += gpus
        count["idle"] = self.c.topology.num_gpus - sum(count.values())
        return count

    def _log_allocation(self) -> None:
        a = self.allocation()
        key = (a["rollout"], a["reward"], a["training"], a["idle"], a["transition"])
        if key != self._allocation:
            self._allocation = key
            self.c.telemetry.allocation(
                self.c.cluster.now(), **{f"{role}_gpus": n for role, n in a.items()}
            )
