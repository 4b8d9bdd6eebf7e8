"""Elastic training (beyond the paper; `planner.elastic_training`): on how many
data-parallel replicas the next training step runs.

The paper shifts training as a whole ("0 or N" GPUs, Table 4), so whenever training is the
bottleneck no shift can help. Here, before each step, training may also hold extension
slots (aligned groups of its tp GPUs outside its own set, `Topology.elastic`); every slot it
holds takes part in the step, and slots go back to inference between steps (the inference
planner sees an idle extension as an occupant with no throughput, like idle training).

The decision minimises the makespan of the stage the pipeline is in — the time until both
this training step and the inference work already released are done: the next batch is
released only after the step (staleness bound), and its inference adds to what runs then.
For a candidate that trains on d replicas:

    t_d = S(d) + D_d                      S: the step-time model for this batch at d; D_d:
                                          if d takes new slots, the longer of R (a new
                                          slot's shift up: GPS Read of parameters and
                                          optimizer state, training's τ_shift) and the
                                          τ_shift of the occupants shifting down first
    τ_d = W / T_d                         inference drain: W the released work (tokens:
                                          each running or queued sequence at the mean
                                          length its role's sequences finished with, a
                                          rollout also at a judgement's), T_d the inference
                                          tokens/s with the candidate's GPUs (taken slots:
                                          the migration replay of the inference candidates;
                                          slots given back: the same replay shifting up
                                          the role further behind on them). Once each
                                          role's tokens per GPU-second while it had work
                                          are measured, T_d = W·G_d/P: P the GPU-seconds
                                          W needs at those rates, G_d the GPUs inference
                                          keeps (`inference_gpus`) — the inference
                                          planner moves GPUs between rollout and GenRM
                                          within the stage, so W drains as a pool
    B_d = T_ref · (max(t_0, τ_0) − max(t_d, τ_d)) − φ_d

with d_0 the replicas training holds now, φ_d the penalty of the occupants it shifts down
(§7.2: τ_shift·T_i) and T_ref the tokens/s the cluster makes when it has work (the larger
of Eq. 1's and what the run has measured), so that seconds and tokens are in one unit as
in B = G − φ. An unbounded makespan (a role with work and no GPU) loses to any bounded
one. The best positive B_d is executed; among equal B_d the shorter step t_d wins, then
more replicas, and at B = 0 a size is taken only if it shortens the step (GPUs nobody can
use are lent to training when that speeds up the step, whose end releases the next
batch). Slots are taken in whole groups of what occupies them (an 8-GPU reward replica
frees eight 1-GPU slots at one φ), cheapest per slot first; free GPUs and idle replicas
cost nothing.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from pivot_hpc.planner.pairs import group_by_occupants, penalty
from pivot_hpc.planner.plan import CandidateEval, PlannerTimings, ShiftPlan
from pivot_hpc.planner.planner import _Simulator, current_throughput, latency_tau
from pivot_hpc.planner.snapshot import (
    INFERENCE_ROLES,
    TRAINING,
    Snapshot,
    replica_id,
    role_of,
)


@dataclass(frozen=True)
class ElasticInputs:
    """What the coordinator knows about the step about to run."""

    step_time: Callable[[int], float] | None  # seconds of this batch's step on g GPUs
    reshard_s: float  # a new extension's shift up (parameters + optimizer state from GPS)
    work_tokens: float  # W: tokens inference still has to make (inf: unknown)
    value_rate: float  # T_ref, tokens/s
    unavailable: frozenset[int] = frozenset()  # GPUs in the middle of a shift
    # GPU-seconds of inference the released work needs, at each role's measured tokens
    # per GPU-second while it had work (None: nothing measured yet; see `_pool_drain`)
    inference_gpu_s: float | None = None


def inference_gpus(snap: Snapshot, extensions: list[str]) -> int:
    """GPUs the inference roles can use while training holds its set and `extensions`."""
    topo = snap.topology
    gpus = {g for spec in topo.roles.values() for slot in spec.slots.values() for g in slot}
    if snap.training.active:
        gpus -= set(topo.training_gpus)
    for rid in extensions:
        gpus -= set(topo.gpus_of(rid))
    return len(gpus)


def _groups(snap: Snapshot, occupancy: dict[int, str], inputs: ElasticInputs):
    """Extension slots training does not hold, grouped by what occupies them: each group
    (slots, occupants, φ) is taken whole; cheapest φ per slot first, then slot order."""
    topo, held = snap.topology, snap.training.extensions
    slots = []
    for s, gpus in sorted(topo.elastic.items()):
        rid = replica_id(TRAINING, s)
        if rid in held or inputs.unavailable & set(gpus):
            continue
        occ = {occupancy[g] for g in gpus if g in occupancy}
        if any(role_of(o) == TRAINING for o in occ):
            continue  # (another extension's GPUs: not a slot of this layout)
        slots.append((rid, occ))
    out = [(ups, downs, penalty(snap, downs)) for ups, downs in group_by_occupants(slots)]
    out.sort(key=lambda g: (g[2] / len(g[0]), g[0][0]))
    return out


def _inference_rate(snap: Snapshot, sim: _Simulator, up: list[str], down: list[str]) -> float:
    """Inference tokens/s (rollout + reward) after `down` shifts down and `up` up, by the
    migration replay the inference candidates use."""
    return sum(sim.role_throughput(r, up, down) for r in INFERENCE_ROLES)


def _given_back(snap: Snapshot, gpus: set[int]) -> list[str]:
    """The inference slots GPUs training gives back would serve: those of the role that
    is further behind (larger τ = N/T, §7.1 step 1) that fit in the freed GPUs."""
    tau = {r: latency_tau(snap.n_seq(r), snap.throughput(r)) for r in INFERENCE_ROLES}
    if tau["rollout"] == 0 and tau["reward"] == 0:
        return []
    role = "rollout" if tau["rollout"] > tau["reward"] else "reward"
    spec = snap.topology.roles[role]
    return [replica_id(role, s) for s, g in sorted(spec.slots.items()) if set(g) <= gpus]


def elastic_plan(
    snap: Snapshot, inputs: ElasticInputs, *, strategy: str, migration: bool = True
) -> ShiftPlan | None:
    """The data-parallel size of the next step as a shift plan (None: keep what it holds)."""
    tr = snap.training
    if inputs.step_time is None or not tr.active or tr.busy:
        return None
    t_start = time.perf_counter()
    occupancy = snap.validate()
    topo = snap.topology
    tp = topo.training_tp
    base = len(topo.training_gpus) // tp
    held = sorted(tr.extensions)
    d0 = base + len(held)
    sim = _Simulator(snap, migration)
    t_cur = current_throughput(snap)
    t_ref = max(inputs.value_rate, t_cur)
    rate0 = _inference_rate(snap, sim, [], [])
    pool = inputs.inference_gpu_s
    if pool is not None and not math.isfinite(inputs.work_tokens):
        pool = None
    if pool is not None:
        # The inference planner moves GPUs between rollout and GenRM through the stage,
        # so the released work drains as a pool: its GPU-seconds over the GPUs inference
        # keeps. Today's placement is no guide: when a batch is released pivot+ has just
        # moved every replica to the role that had the work, so the role that has it now
        # holds none (a replay of today's replicas then drains it never).
        rate0 = inputs.work_tokens * inference_gpus(snap, held) / pool if pool > 0 else 0.0

    def pool_rate(extensions: list[str]) -> float:
        gpus = inference_gpus(snap, extensions)
        return inputs.work_tokens * gpus / pool if pool else 0.0

    # (k replicas, up, down, φ, inference tokens/s meanwhile, seconds before the step)
    options: list[tuple[int, list[str], list[str], float, float, float]] = []
    # shrink: the last held extensions go back to the inference role further behind
    for keep in range(len(held)):
        back = held[keep:]
        if pool is not None:
            rate = pool_rate(held[:keep])
        else:
            given = _given_back(snap, {g for rid in back for g in topo.gpus_of(rid)})
            rate = _inference_rate(snap, sim, given, []) if given else rate0
        options.append((base + keep, [], back, 0.0, rate, 0.0))
    # grow: whole groups of slots, cheapest first; a new slot trains once its occupants
    # are down and it has read its state: the longer of R and the occupants' τ_shift
    # (their shift down plus a shift up) before the step can start
    ups: list[str] = []
    downs: list[str] = []
    phi = 0.0
    for group_ups, group_downs, group_phi in _groups(snap, occupancy, inputs):
        ups, downs, phi = ups + group_ups, downs + group_downs, phi + group_phi
        if pool is not None:
            rate = pool_rate(held + ups)
        else:
            rate = _inference_rate(snap, sim, [], downs) if downs else rate0
        wait = max([inputs.reshard_s, *(topo.tau(role_of(o)) for o in downs)])
        options.append((d0 + len(ups), list(ups), list(downs), phi, rate, wait))
    # Inference work a candidate leaves without a GPU waits for the step to end and then
    # runs at the rate it has with every held extension given back.
    rate_after = options[0][4] if held else rate0

    def train_s(i: int) -> float:
        """Option i's step, from now to its end (i = -1: the replicas held now)."""
        if i < 0:
            return inputs.step_time(d0 * tp)
        return inputs.step_time(options[i][0] * tp) + options[i][5]

    def span(i: int, rate: float) -> float:
        t_train = train_s(i)
        w = inputs.work_tokens
        if w <= 0:
            return t_train
        if rate > 0:
            return max(t_train, w / rate)
        return t_train + w / rate_after if rate_after > 0 else math.inf

    now = span(-1, rate0)
    spans = [span(i, opt[4]) for i, opt in enumerate(options)]
    bounded = [x for x in spans if math.isfinite(x)]
    # an unbounded stage today (work and no GPU for it): any bounded one is better, the
    # shorter the more, as if today's lasted as long as the longest bounded candidate
    ref = now if math.isfinite(now) else max(bounded, default=0.0)
    evals = [
        CandidateEval(
            k,
            up,
            down,
            phi_k,
            rate,
            t_ref * (ref - then) - phi_k if math.isfinite(then) else -math.inf,
        )
        for (k, up, down, phi_k, rate, _), then in zip(options, spans, strict=True)
    ]
    timings = PlannerTimings(simulate_s=time.perf_counter() - t_start)
    # Equal benefits (often 0: inference's drain is the makespan whatever training does):
    # the shorter step wins, then more replicas. The step's end releases the next batch,
    # so a size that does not shorten it is not taken at B = 0 (growing onto slots whose
    # occupants must first shift down delayed the step it was meant to speed up).
    pick = max(
        range(len(evals)), key=lambda i: (evals[i].benefit, -train_s(i), evals[i].k), default=-1
    )
    best = evals[pick] if pick >= 0 else None
    shorter = pick >= 0 and train_s(pick) < train_s(-1)
    if best is None or best.benefit < 0 or (best.benefit == 0 and not shorter):
        if not (best is not None and math.isinf(now) and math.isfinite(best.benefit)):
            return None
    return ShiftPlan(
        strategy=strategy,
        up_role=TRAINING,
        up=best.up,
        down=best.down,
        penalty=best.penalty,
        benefit=best.benefit,
        throughput_current=t_cur,
        throughput_expected=t_cur,
        reason=f"elastic training: {d0} → {best.k} data-parallel replicas",
        timings=timings,
        candidates=evals,
    )
