"""Step 2 of the planner (§7.1, App. D.1): shift pairs for the chosen shift-up role.

An inactive slot of the shift-up role can be brought up once every replica on its GPUs
shifts down (free GPUs cost nothing; idle training — its set or an elastic extension —
counts as a replica with no token throughput; busy training cannot shift). Slots and the replicas in their way form a
bipartite graph; each connected component is one shift pair: its eligible slots
(ordered by slot index) share one shift-down set whose penalty φ = Σ τ_shift·T_i is paid
once. Components are disjoint, so penalties add (App. D.1). Beyond the paper, φ also
counts the prefix cache a shift-down loses for tool-calling trajectories parked with
affinity to the replica (`lost_prefix`, issue 37).

With a 4-GPU reward slot and 1-GPU rollout replicas this yields "four rollout replicas →
one reward replica" pairs, and an idle 8-GPU training set yields one pair of two reward
slots at φ = 0 — the pairs of Figure 8.
"""

from __future__ import annotations

from pivot_hpc.planner.candidates import ShiftPair
from pivot_hpc.planner.snapshot import TRAINING, Snapshot, replica_id, role_of


def replica_throughput(snap: Snapshot, rid: str) -> float:
    if role_of(rid) == TRAINING:  # training (and its extensions) make no tokens
        return 0.0
    return snap.schedulers[role_of(rid)].replica(rid).T


def lost_prefix(snap: Snapshot, rid: str) -> float:
    """Tokens of output the prefix cache lost by shifting `rid` down costs (issue 37):
    trajectories parked with affinity to it and due back within H (`Snapshot.
    parked_prefix`) re-prefill their cached context next turn instead of only their
    observation. In φ's unit (τ·T: seconds × tokens/s = tokens not made): their prefill
    seconds (context × the role's prefill s/token) times the throughput of a replica
    running what `rid` runs now plus those trajectories — the replica that prefills
    decodes nothing meanwhile, as the planner's re-prefill cost of migrated sequences
    counts it (planner.py `_Simulator.reprefill_cost`). Not `rid`'s T_i now: with every
    trajectory parked it is 0, and the cache would look free to lose."""
    n, tokens = snap.parked_prefix.get(rid, (0, 0))
    role = role_of(rid)
    if not tokens or role == TRAINING:
        return 0.0
    v = snap.schedulers[role].replica(rid)
    t_back = v.model.throughput(v.n_seq + n, v.n_tok + tokens)
    return tokens * snap.topology.roles[role].prefill_s_per_token * t_back


def penalty(snap: Snapshot, down: list[str]) -> float:
    """φ = Σ τ_shift(role)·T_i over the replicas that shift down, plus the prefix cache
    they lose for parked trajectories due back within H (`lost_prefix`)."""
    topo = snap.topology
    return sum(
        topo.tau(role_of(rid)) * replica_throughput(snap, rid) + lost_prefix(snap, rid)
        for rid in down
    )


def group_by_occupants(
    slots: list[tuple[str, set[str]]],
) -> list[tuple[list[str], list[str]]]:
    """Slots (id, the replicas occupying its GPUs) grouped into connected components of
    the slot–occupant graph: (slots in the given order, their occupants sorted). Taking
    any slot of a group means shifting down every occupant of the group."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        root = x
        while parent[root] != root:
            root = parent[root]
        while parent[x] != root:
            parent[x], x = root, parent[x]
        return root

    for rid, occupants in slots:
        parent.setdefault(rid, rid)
        for occ in occupants:
            parent.setdefault(occ, occ)
            ra, rb = find(rid), find(occ)
            if ra != rb:
                parent[rb] = ra
    slot_ids = {rid for rid, _ in slots}
    groups: dict[str, tuple[list[str], set[str]]] = {}
    for rid, _ in slots:
        groups.setdefault(find(rid), ([], set()))[0].append(rid)
    for node in parent:
        if node not in slot_ids:  # an occupant, not a slot
            groups[find(node)][1].add(node)
    return [(ups, sorted(downs)) for ups, downs in groups.values()]


def shift_pairs(
    snap: Snapshot,
    up_role: str,
    occupancy: dict[int, str],
    *,
    wait_repayment: bool = False,
    training_return: float = 0.0,
) -> list[ShiftPair]:
    """Disjoint shift pairs for `up_role`, sorted by ascending penalty (ties: slot order).
    `wait_repayment` (pivot+): no pair takes GPUs from a role that a plan not yet repaid
    moved them to from `up_role` (`Snapshot.unrepaid`), unless `up_role` starves (work and
    no replica: Eq. 1 is 0, there is no throughput left to protect; a plan of small gain
    repays slowly, and once a new batch queued its rollouts they waited for it with every
    GPU of the cluster idle or training). `training_return` (pivot+, planner/prewarm.py):
    tokens added to the penalty of a pair that takes idle training's GPUs while its next
    batch is in flight (training comes back for it, its shift up then on the critical
    path)."""
    spec = snap.topology.roles[up_role]
    active = snap.schedulers[up_role].replicas
    busy_training = snap.training.busy
    wait_repayment = wait_repayment and not (snap.n_seq(up_role) and not active)
    eligible: list[tuple[str, set[str]]] = []
    for slot in sorted(spec.slots):
        rid = replica_id(up_role, slot)
        if rid in active:
            continue
        occupants = {occupancy[g] for g in spec.slots[slot] if g in occupancy}
        if busy_training and any(role_of(o) == TRAINING for o in occupants):
            continue
        if wait_repayment and any((up_role, role_of(o)) in snap.unrepaid for o in occupants):
            continue
        eligible.append((rid, occupants))
    pairs = [
        (penalty(snap, down) + (training_return if TRAINING in down else 0.0), ups, down)
        for ups, down in group_by_occupants(eligible)
    ]
    pairs.sort(key=lambda p: (p[0], p[1][0]))
    return [ShiftPair(up=ups, down=down, penalty=phi) for phi, ups, down in pairs]
