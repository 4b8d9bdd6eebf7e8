"""Training pre-warm (pivot+, beyond the paper): load training while its batch finishes.

Every strategy shifts training up once its batch is ready (§7.1 step 1). Its shift up
(parameters and optimizer state read from GPS) then lies on the pipeline's critical path:
the next batch is released only after this step trains, and the step waits for the
shift. On a short step the wait is a large part of it (16 H200s, 64 × 8 short samples:
2.3 s of reload per ~20 s step; pivot lost to the disaggregated split there, whose
training never leaves its GPUs).

Yet in a batch's tail its GPUs are usually idle: nothing is queued, the replicas on them
wait for work that will not come before the batch is done. pivot+ brings training up
then, so its reload overlaps the tail instead of following it. The plan fires when

- training does not hold its GPUs, its next batch is released and not yet ready;
- no role has a queued sequence (queued work would use the GPUs: the §7 planner decides);
- the sequences running on training's GPUs can each move to an idle replica of their
  role elsewhere (so nobody decodes slower), re-prefilling in less than training's
  τ_shift (else the move costs the tail more than the reload it hides);
- each inference role with work keeps a replica (reward too while rollouts run: their
  judgements come next);
- the reload it hides is worth its penalty: τ_shift(training) at the tokens/s inference
  makes now (`reload_worth`) ≥ φ of the replicas it shifts down;
- every plan that moved these GPUs from training has repaid its penalty (pivot+'s
  repayment wait, `Snapshot.unrepaid`).

Lending idle training's GPUs while its next batch is in flight is not free either: training
comes back for the batch, and its shift up then lies on that path. The §7 penalty counts
only the tokens a shifting replica stops making (idle training: none), so pivot+ adds the
return to the penalty of a pair that takes training's GPUs (`training_return`, the same
`reload_worth`). The planner still lends them when the gain over H is larger (a role
swamped with work), not to spread a tail's few sequences.
"""

from __future__ import annotations

import time

from pivot_hpc.planner.pairs import penalty
from pivot_hpc.planner.plan import PlannerTimings, ShiftPlan
from pivot_hpc.planner.snapshot import INFERENCE_ROLES, TRAINING, Snapshot, role_of


def nothing_queued(snap: Snapshot) -> bool:
    return all(snap.schedulers[r].n_queued == 0 for r in INFERENCE_ROLES)


def reload_worth(snap: Snapshot) -> float:
    """Tokens training's shift up is worth on the critical path: τ_shift(training) at the
    tokens/s the inference replicas make now (both roles; not Eq. 1, which is 0 while a
    role with work has no replica, and the wait is not free then)."""
    return snap.topology.tau(TRAINING) * sum(snap.throughput(r) for r in INFERENCE_ROLES)


def training_return(snap: Snapshot) -> float:
    """Penalty (tokens) of taking idle training's GPUs while its next batch is in flight:
    its return's `reload_worth`; 0 when training has no batch coming (or is not idle on
    its GPUs)."""
    tr = snap.training
    if not tr.active or tr.busy or tr.batch_ready or not tr.batch_pending:
        return 0.0
    return reload_worth(snap)


def prewarm_plan(
    snap: Snapshot, occupancy: dict[int, str], strategy: str, t_cur: float
) -> ShiftPlan | None:
    """Shift training up ahead of its batch, when its GPUs are idle (see the module doc).
    Its benefit is the reload it hides (`reload_worth`) minus φ of what it shifts down; it
    fires only when that is not negative. `t_cur`: Eq. 1's throughput now (unchanged)."""
    tr = snap.training
    if tr.active or tr.busy or tr.batch_ready or not tr.batch_pending:
        return None
    if not nothing_queued(snap):
        return None
    t0 = time.perf_counter()
    topo = snap.topology
    down = sorted({occupancy[g] for g in topo.training_gpus if g in occupancy})
    if any(role_of(rid) not in INFERENCE_ROLES for rid in down):
        return None  # (an elastic extension on these GPUs cannot exist; be safe)
    if any((TRAINING, role_of(rid)) in snap.unrepaid for rid in down):
        return None  # a plan that lent them (and paid for the return) has not repaid yet
    for role in INFERENCE_ROLES:
        sched = snap.schedulers[role]
        leaving = [rid for rid in down if role_of(rid) == role]
        moving = [seq for rid in leaving for seq in sched.running_on(rid)]
        staying = [v for v in sched.replica_views() if v.rid not in leaving]
        needs_replica = sched.n_seq > 0 or (role == "reward" and snap.n_seq("rollout") > 0)
        if needs_replica and not staying:
            return None
        if len(moving) > sum(1 for v in staying if v.n_seq == 0):
            return None
        prefill = topo.roles[role].prefill_s_per_token
        if any(prefill * seq.length >= topo.tau(TRAINING) for seq in moving):
            return None
    phi = penalty(snap, down)
    benefit = reload_worth(snap) - phi
    if benefit < 0:
        return None
    return ShiftPlan(
        strategy=strategy,
        up_role=TRAINING,
        up=[TRAINING],
        down=down,
        penalty=phi,
        benefit=benefit,
        throughput_current=t_cur,
        throughput_expected=t_cur,
        reason="training pre-warm: its GPUs idle while its batch finishes",
        timings=PlannerTimings(preprocess_s=time.perf_counter() - t0),
    )
