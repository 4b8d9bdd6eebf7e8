"""The planner (paper §7): five steps on a workload snapshot, and the ablation strategies.

pivot   §7.1: (1) shift-up role: training if its batch is ready, else the inference role
        with the larger τ = N_seq/T; (2) shift pairs sorted by penalty φ; (3) candidates
        by the DP of Alg. 1; (4) each candidate's throughput by replaying the migration
        with the scheduler's own code (Alg. 3 on the shift-down roles, Alg. 4 on the
        shift-up role), overall throughput by Eq. 1, benefit B = H·(T_cand − T_cur) − φ;
        (5) the best positive candidate, else no shift.
vanilla §8.4 ablation: the same procedure with a busy/idle throughput model (T ∈ {0, 1})
        and no shift-up migration.
static  §8.4: training GPUs go half to rollout, half to reward while its batch is not
        ready; nothing else moves.
rule    §8.4: a role above `rule_high_util` KV utilisation shifts one replica up, a role
        below `rule_low_util` shifts one replica down.
Every strategy shifts training up (as a whole) when its batch is ready.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Protocol

from pivot_hpc.planner.candidates import build_candidates
from pivot_hpc.planner.config import PlannerConfig
from pivot_hpc.planner.pairs import penalty, shift_pairs
from pivot_hpc.planner.plan import CandidateEval, PlannerTimings, ShiftPlan, overall_throughput
from pivot_hpc.planner.prewarm import prewarm_plan, training_return
from pivot_hpc.planner.snapshot import (
    INFERENCE_ROLES,
    TRAINING,
    Snapshot,
    replica_id,
    role_of,
)


class Strategy(Protocol):
    name: str
    # Plan at once when GPUs idle while there is work they could take (modes.stall_cues),
    # not only every planning interval (modes.Shifting).
    react: bool

    def plan(self, snap: Snapshot) -> ShiftPlan: ...


def current_throughput(snap: Snapshot) -> float:
    return overall_throughput(
        snap.n_seq("rollout"),
        snap.throughput("rollout"),
        snap.n_seq("reward"),
        snap.throughput("reward"),
    )


def latency_tau(n_seq: int, throughput: float) -> float:
    """τ = N_seq / T; a role with work and no throughput is infinitely behind."""
    if n_seq <= 0:
        return 0.0
    return math.inf if throughput <= 0 else n_seq / throughput


class _Simulator:
    """Replays migrations on copies of the schedulers; caches what repeats across candidates.

    The shift-up role's result depends only on how many replicas come up (§7.2: the
    migration is deterministic and slots of a role are identical), so it is cached by k;
    a shift-down role's result is cached by its set of leaving replicas.
    """

    def __init__(self, snap: Snapshot, migration: bool) -> None:
        self.snap = snap
        self.migration = migration
        # (throughput after, tokens lost to re-prefilling the sequences it moves)
        self._up: dict[tuple[str, int], tuple[float, float]] = {}
        self._down: dict[tuple[str, frozenset[str]], tuple[float, float]] = {}

    def role_throughput(self, role: str, up: list[str], down: list[str]) -> float:
        return self._role(role, up, down)[0]

    def reprefill_cost(self, up: list[str], down: list[str]) -> float:
        """Tokens the plan's migrations cost beyond φ: every sequence it moves re-prefills
        its context on the replica it lands on, which decodes nothing meanwhile (at the
        role's mean replica throughput after the shift)."""
        return sum(self._role(r, up, down)[1] for r in INFERENCE_ROLES)

    def _role(self, role: str, up: list[str], down: list[str]) -> tuple[float, float]:
        mine_down = frozenset(d for d in down if role_of(d) == role)
        mine_up = [u for u in up if role_of(u) == role]
        if mine_up and mine_down:
            raise ValueError(f"a plan cannot shift {role} both up and down")
        spec = self.snap.topology.roles[role]
        if mine_up:
            key_up = (role, len(mine_up))
            if key_up not in self._up:
                sched = self.snap.schedulers[role].clone()
                sched.migration = sched.migration and self.migration
                res = sched.shift_up(
                    ((rid, spec.kv_capacity, spec.model) for rid in mine_up), record=False
                )
                self._up[key_up] = self._outcome(sched, res.moved_tokens, spec)
            return self._up[key_up]
        if mine_down:
            key = (role, mine_down)
            if key not in self._down:
                sched = self.snap.schedulers[role].clone()
                res = sched.shift_down(sorted(mine_down), record=False)
                self._down[key] = self._outcome(sched, res.moved_tokens, spec)
            return self._down[key]
        return self.snap.throughput(role), 0.0

    @staticmethod
    def _outcome(sched, moved_tokens: int, spec) -> tuple[float, float]:
        t = sched.throughput()
        per_replica = t / len(sched.replicas) if sched.replicas else 0.0
        return t, moved_tokens * spec.prefill_s_per_token * per_replica

    def overall(self, up: list[str], down: list[str]) -> float:
        t = {r: self.role_throughput(r, up, down) for r in INFERENCE_ROLES}
        return overall_throughput(
            self.snap.n_seq("rollout"), t["rollout"], self.snap.n_seq("reward"), t["reward"]
        )


def training_plan(
    snap: Snapshot, occupancy: dict[int, str], strategy: str, horizon: float, migration: bool = True
) -> ShiftPlan | None:
    """Shift training up when its batch is ready (every strategy does this first)."""
    tr = snap.training
    if not tr.batch_ready or tr.active:
        return None
    t0 = time.perf_counter()
    down = sorted({occupancy[g] for g in snap.topology.training_gpus if g in occupancy})
    phi = penalty(snap, down)
    t1 = time.perf_counter()
    t_cur = current_throughput(snap)
    t_new = _Simulator(snap, migration).overall([], down)
    benefit = horizon * (t_new - t_cur) - phi
    timings = PlannerTimings(preprocess_s=t1 - t0, simulate_s=time.perf_counter() - t1)
    return ShiftPlan(
        strategy=strategy,
        up_role=TRAINING,
        up=[TRAINING],
        down=down,
        penalty=phi,
        benefit=benefit,
        throughput_current=t_cur,
        throughput_expected=t_new,
        mandatory=True,
        reason="training batch ready",
        timings=timings,
        candidates=[CandidateEval(1, [TRAINING], down, phi, t_new, benefit)],
    )


def search_candidates(n: int, evaluate: Callable[[int], float], max_exact: int) -> None:
    """Call `evaluate(i)` on candidates 0..n-1 (ordered by k) to find the best benefit.

    Up to `max_exact` candidates, every one is simulated (the paper's procedure). Past
    that (≳ 512 GPUs), a coarse-to-fine search: the first 8 counts, a geometric grid
    (×1.25) up to the largest, then bisection towards the best between its evaluated
    neighbours. Each step is deterministic; ~2·log(n) simulations instead of n.
    """
    if n <= max_exact:
        for i in range(n):
            evaluate(i)
        return
    seen: dict[int, float] = {}

    def visit(i: int) -> None:
        if i not in seen:
            seen[i] = evaluate(i)

    i = 0
    while i < n:
        visit(i)
        i = i + 1 if i < 8 else min(n - 1, max(i + 1, int(i * 1.25)))
        if i == n - 1:
            visit(i)
            break
    while True:
        best = max(seen, key=lambda j: (seen[j], -j))
        done = sorted(seen)
        at = done.index(best)
        gaps = [(done[at - 1], best)] if at > 0 else []
        gaps += [(best, done[at + 1])] if at + 1 < len(done) else []
        gaps = [(a, b) for a, b in gaps if b - a > 1]
        if not gaps:
            return
        for a, b in gaps:
            visit((a + b) // 2)


class PivotStrategy:
    """The five-step planner of §7.1 (also `vanilla` with migration off and a busy model)."""

    def __init__(
        self,
        cfg: PlannerConfig,
        *,
        name: str = "pivot",
        migration: bool = True,
        max_up: int | None = None,
        reprefill: bool = False,
        wait_repayment: bool = False,
        keep_reward: bool = False,
        react: bool = False,
        prewarm: bool = False,
    ) -> None:
        self.name = name
        self.horizon = cfg.horizon_s
        self.migration = migration
        self.reprefill = reprefill  # pivot+: migrations' re-prefill counts in the penalty
        # pivot+: GPUs a plan moved are not moved back before it has repaid its penalty
        self.wait_repayment = wait_repayment
        # pivot+: reward keeps its last replica while rollouts run. Their judgements arrive
        # soon, and with no reward replica Eq. 1 drops to 0, so the planner buys GPUs back
        # at once; a replica idle "for free" is not free (seen as a 38 s up/down cycle).
        self.keep_reward = keep_reward
        # pivot+: plan at once on a stall, not at the next interval. A live phase can end
        # within one interval (tiny rollouts all finish in one engine step), and the GPUs
        # then idle until the planner looks; the paper's planner looks every interval.
        self.react = react
        # pivot+: training shifts up ahead of its batch while its GPUs idle in the batch's
        # tail; lending idle training's GPUs while its batch is in flight costs its return
        # (prewarm.py)
        self.prewarm = prewarm
        self.max_up = max_up
        self.max_exact = cfg.max_exact_candidates

    def choose_role(self, snap: Snapshot) -> str | None:
        """Step 1 for inference: the role with the larger τ (ties: reward, downstream)."""
        tau = {r: latency_tau(snap.n_seq(r), snap.throughput(r)) for r in INFERENCE_ROLES}
        if tau["rollout"] == 0 and tau["reward"] == 0:
            return None
        return "rollout" if tau["rollout"] > tau["reward"] else "reward"

    def plan(self, snap: Snapshot) -> ShiftPlan:
        t0 = time.perf_counter()
        occupancy = snap.validate()
        forced = training_plan(snap, occupancy, self.name, self.horizon, self.migration)
        if forced is not None:
            return forced
        t_cur = current_throughput(snap)
        if self.prewarm:
            early = prewarm_plan(snap, occupancy, self.name, t_cur)
            if early is not None:
                return early
        role = self.choose_role(snap)
        if role is None:
            return ShiftPlan(
                self.name,
                reason="no work in rollout or reward",
                throughput_current=t_cur,
                throughput_expected=t_cur,
                timings=PlannerTimings(preprocess_s=time.perf_counter() - t0),
            )
        pairs = shift_pairs(
            snap,
            role,
            occupancy,
            wait_repayment=self.wait_repayment,
            training_return=training_return(snap) if self.prewarm else 0.0,
        )
        reward = snap.schedulers["reward"]
        if self.keep_reward and role != "reward" and reward.replicas and snap.n_seq("rollout"):
            # Reward keeps one replica, its busiest: pairs that would take it are left out
            # before Alg. 1, so each k still gets its cheapest plan that leaves it. (Rejecting
            # whole candidates afterwards left none when the kept replica's pair, at φ = 0,
            # won Alg. 1's ties for every k: a stall with idle GPUs free to take.)
            kept = max(reward.replica_views(), key=lambda v: (v.T, v.n_seq, -v.idx)).rid
            pairs = [p for p in pairs if kept not in p.down]
        t1 = time.perf_counter()
        k_max = sum(len(p.up) for p in pairs)
        if self.max_up is not None:
            k_max = min(k_max, self.max_up)
        cands = build_candidates(pairs, k_max)
        t2 = time.perf_counter()
        sim = _Simulator(snap, self.migration)
        evals = []
        # Both roles have work and no GPU (training holds them all after an elastic step):
        # Eq. 1 is 0 before and after any one-role candidate, so no benefit would ever be
        # positive and the run would stall. Each candidate is then worth what it lets the
        # chosen role make; the other role is served by the next round.
        both_starve = all(snap.n_seq(r) and snap.throughput(r) <= 0 for r in INFERENCE_ROLES)

        def evaluate(i: int) -> float:
            c = cands[i]
            t_new = sim.overall(c.up, c.down)
            gain = sim.role_throughput(role, c.up, c.down) if both_starve else t_new - t_cur
            phi = c.penalty + (sim.reprefill_cost(c.up, c.down) if self.reprefill else 0.0)
            ev = CandidateEval(c.k, list(c.up), list(c.down), phi, t_new, self.horizon * gain - phi)
            evals.append(ev)
            return ev.benefit

        search_candidates(len(cands), evaluate, self.max_exact)
        evals.sort(key=lambda e: e.k)
        t3 = time.perf_counter()
        timings = PlannerTimings(preprocess_s=t1 - t0, construct_s=t2 - t1, simulate_s=t3 - t2)
        best = max(evals, key=lambda e: e.benefit, default=None)
        if best is None or not best.benefit > 0:
            why = (
                "no eligible replica to shift up"
                if best is None
                else "no candidate with positive benefit"
            )
            return ShiftPlan(
                self.name,
                up_role=role,
                reason=why,
                throughput_current=t_cur,
                throughput_expected=t_cur,
                timings=timings,
                candidates=evals,
            )
        return ShiftPlan(
            self.name,
            up_role=role,
            up=best.up,
            down=best.down,
            penalty=best.penalty,
            benefit=best.benefit,
            throughput_current=t_cur,
            throughput_expected=best.throughput,
            reason=f"{role} τ is larger; best of {len(evals)} candidates",
            timings=timings,
            candidates=evals,
        )


def _evaluated(snap: Snapshot, plan: ShiftPlan, horizon: float, t_start: float) -> ShiftPlan:
    """Fill in penalty, expected throughput and benefit for a rule/static decision."""
    t1 = time.perf_counter()
    plan.throughput_current = current_throughput(snap)
    if plan.is_noop:
        plan.throughput_expected = plan.throughput_current
    else:
        plan.penalty = penalty(snap, plan.down)
        plan.throughput_expected = _Simulator(snap, True).overall(plan.up, plan.down)
        plan.benefit = horizon * (plan.throughput_expected - plan.throughput_current) - plan.penalty
    plan.timings = PlannerTimings(preprocess_s=t1 - t_start, simulate_s=time.perf_counter() - t1)
    return plan


class StaticStrategy:
    """§8.4 static: lend idle training GPUs half to rollout, half to reward."""

    name = "static"
    react = False

    def __init__(self, cfg: PlannerConfig) -> None:
        self.horizon = cfg.horizon_s

    def plan(self, snap: Snapshot) -> ShiftPlan:
        t0 = time.perf_counter()
        occupancy = snap.validate()
        forced = training_plan(snap, occupancy, self.name, self.horizon)
        if forced is not None:
            return forced
        tr = snap.training
        plan = ShiftPlan(self.name)
        if tr.active and not tr.busy and not tr.batch_ready:
            gpus = snap.topology.training_gpus
            halves = {"rollout": set(gpus[: len(gpus) // 2]), "reward": set(gpus[len(gpus) // 2 :])}
            for role in INFERENCE_ROLES:
                spec = snap.topology.roles[role]
                for slot, sg in sorted(spec.slots.items()):
                    if set(sg) <= halves[role]:
                        plan.up.append(replica_id(role, slot))
            plan.down = [TRAINING]
            plan.up_role = "rollout+reward"
            plan.reason = "training idle: split its GPUs evenly"
        return _evaluated(snap, plan, self.horizon, t0)


class RuleStrategy:
    """§8.4 rule-based: react to each role's KV-cache utilisation."""

    name = "rule"
    react = False

    def __init__(self, cfg: PlannerConfig) -> None:
        self.horizon = cfg.horizon_s
        self.high = cfg.rule_high_util
        self.low = cfg.rule_low_util

    def plan(self, snap: Snapshot) -> ShiftPlan:
        t0 = time.perf_counter()
        occupancy = snap.validate()
        forced = training_plan(snap, occupancy, self.name, self.horizon)
        if forced is not None:
            return forced
        util = {r: snap.schedulers[r].kv_utilization() for r in INFERENCE_ROLES}
        starving = {
            r
            for r in INFERENCE_ROLES
            if snap.schedulers[r].n_queued and not snap.schedulers[r].replicas
        }
        plan = ShiftPlan(self.name)
        for role in INFERENCE_ROLES:
            if util[role] <= self.high and role not in starving:
                continue
            other = "reward" if role == "rollout" else "rollout"
            for pair in shift_pairs(snap, role, occupancy):
                ok = all(
                    role_of(d) == TRAINING or (role_of(d) == other and util[other] < self.low)
                    for d in pair.down
                )
                if ok:
                    plan.up, plan.down, plan.up_role = [pair.up[0]], list(pair.down), role
                    plan.reason = f"{role} KV utilisation {util[role]:.2f} > {self.high}"
                    return _evaluated(snap, plan, self.horizon, t0)
        for role in INFERENCE_ROLES:
            reps = snap.schedulers[role].replica_views()
            if util[role] < self.low and len(reps) > 1:
                victim = min(reps, key=lambda r: (r.n_tok, r.idx))
                plan.down, plan.up_role = [victim.rid], None
                plan.reason = f"{role} KV utilisation {util[role]:.2f} < {self.low}"
                break
        return _evaluated(snap, plan, self.horizon, t0)


def make_strategy(cfg: PlannerConfig) -> Strategy:
    """The planner strategy named by `planner.strategy`."""
    if cfg.strategy == "pivot":
        return PivotStrategy(cfg)
    if cfg.strategy == "pivot+":
        return PivotStrategy(
            cfg,
            name="pivot+",
            reprefill=True,
            wait_repayment=True,
            keep_reward=True,
            react=True,
            prewarm=True,
        )
    if cfg.strategy == "vanilla":
        return PivotStrategy(cfg, name="vanilla", migration=False)
    if cfg.strategy == "static":
        return StaticStrategy(cfg)
    if cfg.strategy == "rule":
        return RuleStrategy(cfg)
    raise ValueError(
        f"planner.strategy={cfg.strategy!r} is unknown; valid: pivot, pivot+, static, rule, vanilla"
    )
