"""The shift-aware scheduler of one inference role (paper §6, App. C, Alg. 2–4).

A shared waiting queue feeds replicas through Dispatch: each sequence goes to the replica
with enough KV capacity whose throughput gain ΔT is largest (§6.1; ties: the replica
added first). Abort returns sequences to the queue with their tokens (their length
includes what they generated). Shift down = Abort(all) on the leaving replicas, then
Dispatch (Alg. 3). Shift up = Dispatch the queue to the new replicas, then, if the queue
drained, migrate the shortest sequence of the highest-throughput replica while the
aggregate throughput improves (Alg. 4); the one move that does not improve it is undone.

The queue is strict priority order (default: ascending sequence id): Dispatch stops at
the first sequence no replica can hold, so a long resumed sequence is never starved by
short new ones.

Soft affinity (beyond the paper, issue 37): a sequence may name a preferred replica
(`SeqState.affinity`: a tool-calling trajectory's last replica, which still caches its
prefix). Dispatch places it there instead of the argmax when that replica has room and
its ΔT is within `affinity_slack` of the best (`kernels.prefer`). The preference is a
replica position, which names one incarnation of the replica (positions are never
reused): once it shifted down — even if the same slot came back up since, its cache
gone — it is no preference. Alg. 4's migration ignores affinity.

Bounded wait (issue 37, `affinity_wait_s`; needs the scheduler's `clock`): a sequence
whose preferred replica is up but has no room for it (its running cap, or KV) stays
queued for up to `affinity_wait_s` seconds from its submit instead of going elsewhere.
Dispatch skips it and goes on with the sequences behind it, so it blocks none of them;
it goes to its replica at the first Dispatch that finds room there (a slot freed), and
to the argmax once its deadline passed: `wait_until` tells the caller when the earliest
wait ends, so that it dispatches then even if nothing frees (Coordinator.run). A
preference that is no candidate (shifted down, or a shift-up's dispatch onto the new
replicas only) is never waited for.

State lives in flat arrays (replica position p, sequence position q) so the planner can
copy it cheaply and the compiled loops in `kernels.py` can run over it.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, NamedTuple

import numpy as np

from pivot_hpc.errors import PivotError
from pivot_hpc.scheduler import kernels
from pivot_hpc.scheduler.throughput import ReplicaModel

# Queue order: one int64 key per sequence, ascending (lengths < 2^31, ids < 2^32), computed
# from the length and id arrays in bulk.
_ID_BITS = 32


def _key_seq_id(length: np.ndarray, seq_id: np.ndarray) -> np.ndarray:
    return seq_id


def _key_longest(length: np.ndarray, seq_id: np.ndarray) -> np.ndarray:
    return -(length << _ID_BITS) + seq_id


def _key_shortest(length: np.ndarray, seq_id: np.ndarray) -> np.ndarray:
    return (length << _ID_BITS) + seq_id


PriorityKey = Callable[[np.ndarray, np.ndarray], np.ndarray]

PRIORITIES: dict[str, PriorityKey] = {
    "seq_id": _key_seq_id,  # ascending sequence id (the paper's)
    "longest_first": _key_longest,  # longest context first, then id
    "shortest_first": _key_shortest,  # shortest context first, then id
}

QUEUED = -1
GONE = -2
# Dispatch into a long queue reads its first _HEAD entries with the submissions not yet
# merged (`_head`), which are merged into the queue itself once _MERGE_PENDING wait.
_HEAD = 32
_MERGE_PENDING = 32
DENSE_IDS = 1 << 24  # sequence ids below this are also indexed by a dense array


class SeqLengths(NamedTuple):
    """Context lengths of sequences, as two aligned int64 arrays (the monitor's data)."""

    ids: np.ndarray
    lengths: np.ndarray

    @staticmethod
    def of(mapping: Mapping[int, int]) -> SeqLengths:
        n = len(mapping)
        return SeqLengths(
            np.fromiter(mapping.keys(), np.int64, n), np.fromiter(mapping.values(), np.int64, n)
        )


@dataclass(slots=True)
class SeqState:
    """A sequence as the scheduler sees it.

    `length` is the KV context the sequence needs: prompt plus tokens generated so far,
    so an aborted sequence keeps its progress and needs that much capacity elsewhere.
    `payload` is opaque to the scheduler (token ids, sampling params, policy version).
    """

    seq_id: int
    length: int
    payload: Any = None
    # the replica preferred for its prefix cache, by position (`ReplicaView.idx`, the
    # incarnation; -1: none): a tool-calling trajectory's last replica
    # (coordinator/turns.py). Kept while the sequence is scheduled.
    affinity: int = -1


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """Read-only state of one active replica."""

    rid: str
    idx: int  # insertion order: the tie-breaker
    n_seq: int
    n_tok: int
    capacity: int
    T: float
    model: ReplicaModel


@dataclass(slots=True)
class MigrationResult:
    """What a shift did: sequences aborted from, and dispatched to, which replicas."""

    aborted: list[tuple[int, str]] = field(default_factory=list)  # (seq_id, from replica)
    dispatched: list[tuple[int, str]] = field(default_factory=list)  # (seq_id, to replica)
    migrations: int = 0  # shift-up moves kept by Alg. 4's loop
    # shift up: the first `from_queue` entries of `dispatched` placed waiting sequences;
    # the rest are migration moves of running ones (a sequence may move more than once)
    from_queue: int = 0
    throughput_before: float = 0.0
    throughput_after: float = 0.0
    moved_tokens: int = 0  # context of the running sequences aborted (their re-prefill)
    abort_s: float = 0.0
    dispatch_s: float = 0.0
    migrate_s: float = 0.0

    def net_moves(self) -> tuple[dict[int, str], dict[int, str]]:
        """What a shift up asks of the cluster, net of intermediate moves: (moved: running
        sequences to stop where they run, seq_id -> that replica; started: sequences to
        start, seq_id -> the replica they end up on — the moved ones and those that came
        from the queue)."""
        placed = {sid for sid, _ in self.dispatched[: self.from_queue]}
        origin: dict[int, str] = {}
        for seq_id, src in self.aborted:
            if seq_id not in placed:
                origin.setdefault(seq_id, src)
        final = dict(self.dispatched)
        moved = {sid: src for sid, src in origin.items() if final.get(sid) != src}
        started = {sid: dst for sid, dst in final.items() if origin.get(sid) != dst}
        return moved, started


class SchedulerError(PivotError, ValueError):
    """Inconsistent use of the scheduler (unknown replica, duplicate sequence, …)."""


# "no limit" for `_knee` (a model whose iterations never get compute-bound)
_NO_KNEE = 1 << 40


def _knee(kind: int, b: float, c: float) -> int:
    """Running sequences up to which one more does not lengthen a decode iteration beyond
    attention: ⌈B/C⌉, where T's max(B, C·N_seq) turns from streaming the weights once to
    per-sequence compute. A pipeline cap below it (scheduler/admission.py) saves the
    longest sequence almost no time per iteration and makes the batch's sequences wait in
    the queue. 0 where the model has no such flat part (B = 0, as fitted for MoE models
    whose every sequence touches more experts, or the `vanilla` busy/idle model)."""
    if kind != kernels.KIND_MODEL or b <= 0:
        return 0
    ratio = b / c if c > 0 else math.inf
    return _NO_KNEE if ratio >= _NO_KNEE else math.ceil(ratio)


def _grow(arr: np.ndarray, size: int, fill: float | int = 0) -> np.ndarray:
    if size <= arr.shape[0]:
        return arr
    new = np.full(max(size, 2 * arr.shape[0], 16), fill, dtype=arr.dtype)
    new[: arr.shape[0]] = arr
    return new


class Scheduler:
    """Shared waiting queue + replica states for one role (rollout or reward)."""

    _REPLICA_ARRAYS = (
        "active",
        "n",
        "tok",
        "cap",
        "nmax",
        "knee",
        "kind",
        "A",
        "B",
        "C",
        "D",
        "T",
    )
    _SEQ_ARRAYS = ("seq_len", "seq_rep", "seq_id", "seq_pref", "seq_wait")

    def __init__(
        self,
        role: str,
        *,
        priority: str = "seq_id",
        migration: bool = True,
        affinity_slack: float = 0.0,
        affinity_wait_s: float = 0.0,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.role = role
        if priority not in PRIORITIES:
            raise SchedulerError(
                f"scheduler priority {priority!r} is unknown; valid: {', '.join(PRIORITIES)}"
            )
        self.priority_key: PriorityKey = PRIORITIES[priority]
        self.migration = migration
        if not 0.0 <= affinity_slack <= 1.0:
            raise SchedulerError(f"{self.role}: affinity_slack {affinity_slack} not in [0, 1]")
        self.affinity_slack = affinity_slack  # 0: no soft affinity (kernels.prefer)
        if not (math.isfinite(affinity_wait_s) and affinity_wait_s >= 0):
            raise SchedulerError(
                f"{self.role}: affinity_wait_s {affinity_wait_s} is not a finite number >= 0"
            )
        # how long a sequence may wait for its preferred replica (0: never; see the module
        # docstring), measured on `clock` (the cluster's; None: no waits)
        self.affinity_wait_s = affinity_wait_s
        self.clock = clock
        # the earliest deadline of a sequence the last dispatches left waiting (inf: none);
        # never later than the true one (a dispatch recomputes it)
        self.wait_until = math.inf
        self.replica_limit = 0  # running sequences per replica on top of the engine's cap
        # replicas, by position p (never reused: p is also the tie-breaking order)
        self.replicas: dict[str, int] = {}  # active replica id -> p
        self._rid_of: list[str] = []
        self._model_of: list[ReplicaModel] = []
        self.active = np.zeros(0, np.uint8)
        self.n = np.zeros(0, np.int64)
        self.tok = np.zeros(0, np.int64)
        self.cap = np.zeros(0, np.int64)
        self.nmax = np.zeros(0, np.int64)  # running-request cap (0: none)
        self.knee = np.zeros(0, np.int64)  # `replica_limit` never caps below this (_knee)
        self.kind = np.zeros(0, np.int64)
        self.A = np.zeros(0)
        self.B = np.zeros(0)
        self.C = np.zeros(0)
        self.D = np.zeros(0)
        self.T = np.zeros(0)
        # sequences, by position q
        self.seq_len = np.zeros(0, np.int64)
        self.seq_rep = np.zeros(0, np.int64)
        self.seq_id = np.zeros(0, np.int64)
        self.seq_pref = np.zeros(0, np.int64)  # preferred replica position (<0: none)
        self.seq_wait = np.zeros(0)  # may wait for seq_pref until this clock time
        self._seqs: list[SeqState | None] = []
        self._q_of: dict[int, int] = {}
        # the same map as a dense array (seq_id -> q, -1: none) for bulk lookups of the
        # monitor's lengths; None once an id is too large for a dense index
        self._q_arr: np.ndarray | None = np.zeros(0, np.int64)
        # The waiting queue: positions q in dispatch order and their keys (ascending).
        # Both arrays are replaced, never written in place, so clones may share them.
        self._qpos = np.zeros(0, np.int64)
        self._qkey = np.zeros(0, np.int64)
        # Copy on write of _seqs, _q_of, _q_arr, seq_len, seq_id, seq_pref and seq_wait: a
        # clone copies them before it changes them (`_shared`); the original only while a
        # clone sharing them is alive (the planner's clones live for one decision, so the
        # original rarely copies).
        self._shared = False
        self._sharers: weakref.WeakSet[Scheduler] = weakref.WeakSet()
        self._pending: list[int] = []  # submitted, not yet merged into the queue arrays
        # running positions sorted by (replica, length, id), for Alg. 4; None: stale
        self._run_order: np.ndarray | None = None
        self._n_running = 0

    # ------------------------------------------------------------------ state
    @property
    def n_running(self) -> int:
        return self._n_running

    @property
    def n_queued(self) -> int:
        return len(self._qpos) + len(self._pending)

    @property
    def n_seq(self) -> int:
        """N_seq of the role for Eq. 1: running plus waiting sequences."""
        return self._n_running + len(self._qpos) + len(self._pending)

    @property
    def n_idle_replicas(self) -> int:
        """Active replicas running no sequence."""
        # asked at every event batch: an inactive replica runs nothing (check_invariants),
        # so the idle ones are the active ones less those running something
        return len(self.replicas) - int(np.count_nonzero(self.n[: len(self._rid_of)]))

    def throughput(self) -> float:
        """Aggregate estimated throughput of the role (sum of replica T_i)."""
        m = len(self._rid_of)
        return float(self.T[:m][self.active[:m] != 0].sum())

    def kv_utilization(self) -> float:
        m = len(self._rid_of)
        act = self.active[:m] != 0
        cap = int(self.cap[:m][act].sum())
        return int(self.tok[:m][act].sum()) / cap if cap else 0.0

    def replica(self, rid: str) -> ReplicaView:
        p = self._pos(rid)
        return ReplicaView(
            rid,
            p,
            int(self.n[p]),
            int(self.tok[p]),
            int(self.cap[p]),
            float(self.T[p]),
            self._model_of[p],
        )

    def replica_views(self) -> list[ReplicaView]:
        return [self.replica(rid) for rid in self.replicas]

    def _synced(self, q: int) -> SeqState:
        """The SeqState of position q with its length refreshed from the arrays."""
        seq = self._seqs[q]
        seq.length = int(self.seq_len[q])
        return seq

    def queued(self) -> list[SeqState]:
        """Waiting sequences in dispatch order."""
        self._flush()
        return [self._synced(int(q)) for q in self._qpos]

    def running_on(self, rid: str) -> list[SeqState]:
        p = self._pos(rid)
        qs = np.flatnonzero(self.seq_rep[: len(self._seqs)] == p)
        return [self._synced(int(q)) for q in qs]

    def location(self, seq_id: int) -> str | None:
        """The replica running `seq_id`; None if it waits in the queue or is unknown."""
        q = self._q_of.get(seq_id)
        p = -1 if q is None else int(self.seq_rep[q])
        return None if p < 0 else self._rid_of[p]

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._q_of

    def sequence(self, seq_id: int) -> SeqState:
        q = self._q_of.get(seq_id)
        if q is None:
            raise SchedulerError(f"{self.role}: sequence {seq_id} is not known to the scheduler")
        return self._synced(q)

    def _pos(self, rid: str) -> int:
        try:
            return self.replicas[rid]
        except KeyError:
            raise SchedulerError(
                f"{self.role}: replica {rid!r} is not active; active: {sorted(self.replicas)}"
            ) from None

    def set_model(self, model: ReplicaModel) -> None:
        """The role's constants were refitted: every active replica uses `model` now."""
        kind, a, b, c, d = model.kernel_params()
        for p in self.replicas.values():
            self._model_of[p] = model
            self.kind[p], self.A[p], self.B[p], self.C[p], self.D[p] = kind, a, b, c, d
            self.nmax[p] = model.max_running
            self.knee[p] = _knee(kind, b, c)
            self._refresh(p)

    def _refresh(self, p: int) -> None:
        self.T[p] = kernels.throughput(
            int(self.kind[p]),
            float(self.A[p]),
            float(self.B[p]),
            float(self.C[p]),
            float(self.D[p]),
            int(self.n[p]),
            int(self.tok[p]),
        )

    # ------------------------------------------------------------ replicas
    def add_replica(self, rid: str, capacity: int, model: ReplicaModel) -> None:
        """Register an active, empty replica (no dispatch; see `shift_up`)."""
        if rid in self.replicas:
            raise SchedulerError(f"{self.role}: replica {rid!r} is already active")
        if capacity < 0:
            raise SchedulerError(f"{self.role}: replica {rid!r} KV capacity {capacity} < 0")
        kind, a, b, c, d = model.kernel_params()
        p = len(self._rid_of)
        if p >= self.active.shape[0]:
            for name in self._REPLICA_ARRAYS:
                setattr(self, name, _grow(getattr(self, name), p + 1))
        self._rid_of.append(rid)
        self._model_of.append(model)
        self.active[p], self.n[p], self.tok[p], self.cap[p] = 1, 0, 0, capacity
        self.kind[p], self.A[p], self.B[p], self.C[p], self.D[p] = kind, a, b, c, d
        self.nmax[p] = model.max_running
        self.knee[p] = _knee(kind, b, c)
        self.T[p] = 0.0
        self.replicas[rid] = p

    def remove_replica(self, rid: str) -> None:
        p = self._pos(rid)
        if self.n[p]:
            raise SchedulerError(
                f"{self.role}: replica {rid!r} still runs {self.n[p]} sequences; abort them first"
            )
        self.active[p] = 0
        del self.replicas[rid]

    # ----------------------------------------------------------- sequences
    def submit(self, seq: SeqState) -> None:
        """Put a new (or resumed) sequence in the waiting queue."""
        if seq.seq_id in self._q_of:
            raise SchedulerError(f"{self.role}: sequence {seq.seq_id} is already scheduled")
        if seq.length < 0:
            raise SchedulerError(f"{self.role}: sequence {seq.seq_id} has negative length")
        self._own()
        q = len(self._seqs)
        for name in self._SEQ_ARRAYS:
            setattr(self, name, _grow(getattr(self, name), q + 1, GONE))
        self._seqs.append(seq)
        self._q_of[seq.seq_id] = q
        if self._q_arr is not None:
            if 0 <= seq.seq_id < DENSE_IDS:
                self._q_arr = _grow(self._q_arr, seq.seq_id + 1, -1)
                self._q_arr[seq.seq_id] = q
            else:
                self._q_arr = None
        self.seq_len[q], self.seq_id[q] = seq.length, seq.seq_id
        # a replica that is not active (shifted down since) is no preference
        pref = seq.affinity
        live = 0 <= pref < len(self._rid_of) and self.active[pref]
        self.seq_pref[q] = pref if live else -1
        wait = live and self.affinity_wait_s > 0 and self.clock is not None
        self.seq_wait[q] = self.clock() + self.affinity_wait_s if wait else -math.inf
        self.seq_rep[q] = QUEUED
        self._pending.append(q)  # merged in bulk before the queue is next read

    def _keys(self, qs: np.ndarray) -> np.ndarray:
        return self.priority_key(self.seq_len[qs], self.seq_id[qs])

    def _flush(self) -> None:
        if self._pending:
            qs = np.array(self._pending, np.int64)
            self._pending = []
            self._enqueue_many(qs)

    def _enqueue_many(self, qs: np.ndarray) -> None:
        """Put positions `qs` in the queue at their priority (merged, O(queue + k log k))."""
        self._flush()
        if not len(qs):
            return
        self.seq_rep[qs] = QUEUED
        keys = self._keys(qs)
        if len(qs) == 1:  # the common case (a submit, then a dispatch): two copies, no mask
            i = int(np.searchsorted(self._qkey, keys[0], side="right"))
            self._qkey = np.concatenate((self._qkey[:i], keys, self._qkey[i:]))
            self._qpos = np.concatenate((self._qpos[:i], qs, self._qpos[i:]))
            return
        order = np.argsort(keys)  # keys are unique (they end in the sequence id)
        keys, qs = keys[order], qs[order]
        # merge two sorted runs: new item i lands at (old items before it) + i
        dest = np.searchsorted(self._qkey, keys, side="right") + np.arange(len(keys))
        old = np.ones(len(self._qkey) + len(keys), bool)
        old[dest] = False
        for name, new in (("_qkey", keys), ("_qpos", qs)):
            merged = np.empty(len(old), np.int64)
            merged[dest] = new
            merged[old] = getattr(self, name)
            setattr(self, name, merged)

    def _enqueue(self, q: int) -> None:
        self._enqueue_many(np.array([q], np.int64))

    def _dequeue(self, q: int) -> None:
        self._flush()
        (i,) = np.flatnonzero(self._qpos == q)
        self._qkey = np.delete(self._qkey, i)
        self._qpos = np.delete(self._qpos, i)

    def _own(self) -> None:
        """Copy what a clone shares before changing it (submit, lengths, finish)."""
        if self._shared or len(self._sharers):
            self._seqs = list(self._seqs)
            self._q_of = dict(self._q_of)
            if self._q_arr is not None:
                self._q_arr = self._q_arr.copy()
            self.seq_len = self.seq_len.copy()
            self.seq_id = self.seq_id.copy()
            self.seq_pref = self.seq_pref.copy()
            self.seq_wait = self.seq_wait.copy()
            self._shared = False
            self._sharers = weakref.WeakSet()

    def set_lengths(self, lengths: SeqLengths | Mapping[int, int]) -> None:
        """Bulk update of context lengths (monitor data: tokens generated since dispatch)."""
        if not isinstance(lengths, SeqLengths):
            lengths = SeqLengths.of(lengths)
        if not len(lengths.ids):
            return
        self._own()
        self._run_order = None
        qs = self._positions(lengths.ids)
        new = lengths.lengths
        if self.n_queued and (self.seq_rep[qs] == QUEUED).any():
            for seq_id, length in zip(lengths.ids.tolist(), new.tolist(), strict=True):
                self.grow(seq_id, length)  # queued: priority keys may change
            return
        self.seq_len[qs] = new
        m = len(self._rid_of)
        nq = len(self._seqs)
        rep = self.seq_rep[:nq]
        running = rep >= 0
        self.tok[:m] = np.bincount(rep[running], weights=self.seq_len[:nq][running], minlength=m)[
            :m
        ]
        kernels.refresh_all(
            np.flatnonzero(self.active[:m]),
            self.n[:m],
            self.tok[:m],
            self.kind[:m],
            self.A[:m],
            self.B[:m],
            self.C[:m],
            self.D[:m],
            self.T[:m],
        )

    def _positions(self, ids: np.ndarray) -> np.ndarray:
        """Positions of sequence ids (SchedulerError naming one that is not scheduled)."""
        arr = self._q_arr
        if arr is not None and len(ids) and 0 <= ids.min() and ids.max() < len(arr):
            qs = arr[ids]
            if (qs >= 0).all():
                return qs
        else:
            qs = np.fromiter(map(self._q_of.get, ids.tolist(), repeat(-1)), np.int64, len(ids))
            if (qs >= 0).all():
                return qs
        missing = ids[qs < 0] if len(qs) == len(ids) else ids
        for seq_id in missing.tolist():
            if seq_id not in self._q_of:
                raise SchedulerError(f"{self.role}: sequence {seq_id} is not scheduled")
        raise AssertionError("dense index out of step with _q_of")

    def grow(self, seq_id: int, length: int) -> None:
        """A running or queued sequence now holds `length` tokens of context."""
        self._own()
        self._run_order = None
        q = self._q_of.get(seq_id)
        if q is None:
            raise SchedulerError(f"{self.role}: sequence {seq_id} is not scheduled")
        p = int(self.seq_rep[q])
        if p == QUEUED:
            self._dequeue(q)
        elif p >= 0:
            self.tok[p] += length - int(self.seq_len[q])
            self._refresh(p)
        self.seq_len[q] = length
        if p == QUEUED:
            self._enqueue(q)

    def _release(self, q: int) -> SeqState:
        self._own()
        self._run_order = None
        seq = self._synced(q)
        self.seq_rep[q] = GONE
        self._seqs[q] = None
        del self._q_of[seq.seq_id]
        if self._q_arr is not None:
            self._q_arr[seq.seq_id] = -1
        if len(self._seqs) > 4096 and len(self._q_of) * 4 < len(self._seqs):
            self._compact()
        return seq

    def finish(self, seq_id: int) -> SeqState:
        """A running sequence completed; it leaves the scheduler."""
        q = self._q_of.get(seq_id)
        if q is None or self.seq_rep[q] < 0:
            raise SchedulerError(f"{self.role}: sequence {seq_id} is not running")
        p = int(self.seq_rep[q])
        self.n[p] -= 1
        self.tok[p] -= int(self.seq_len[q])
        self._refresh(p)
        self._n_running -= 1
        return self._release(q)

    def cancel(self, seq_id: int) -> SeqState:
        """Drop a waiting sequence from the queue."""
        q = self._q_of.get(seq_id)
        if q is None or self.seq_rep[q] != QUEUED:
            raise SchedulerError(f"{self.role}: sequence {seq_id} is not waiting")
        self._dequeue(q)
        return self._release(q)

    def _compact(self) -> None:
        """Drop positions of finished sequences (keeps arrays proportional to live work)."""
        live = [q for q in range(len(self._seqs)) if self._seqs[q] is not None]
        self._flush()
        self._run_order = None
        idx = np.asarray(live, np.int64)
        remap = np.full(len(self._seqs), -1, np.int64)
        remap[idx] = np.arange(len(idx))
        for name in self._SEQ_ARRAYS:
            setattr(self, name, getattr(self, name)[idx].copy())
        self._seqs = [self._seqs[q] for q in live]
        self._q_of = {s.seq_id: i for i, s in enumerate(self._seqs)}
        if self._q_arr is not None:
            self._q_arr = np.full(len(self._q_arr), -1, np.int64)
            self._q_arr[self.seq_id[: len(idx)]] = np.arange(len(idx))
        self._qpos = remap[self._qpos]

    # ----------------------------------------------- Alg. 2: Abort, Dispatch
    def abort(self, rid: str, which: str = "all") -> list[int]:
        """Stop sequences on `rid` (all, or the shortest) and return them to the queue."""
        if which not in ("all", "shortest"):
            raise SchedulerError(f"abort: which={which!r}; valid: 'all', 'shortest'")
        return self.seq_id[self._abort([self._pos(rid)], which)].tolist()

    def _abort(self, ps: list[int], which: str) -> np.ndarray:
        rep = self.seq_rep[: len(self._seqs)]
        if len(ps) > 1:
            leaving = np.zeros(len(self._rid_of) + 1, bool)  # index -1 (queued/gone): False
            leaving[ps] = True
            qs = np.flatnonzero(leaving[np.maximum(rep, -1)])
        else:
            qs = np.flatnonzero(rep == ps[0])
        if which == "shortest" and len(qs):
            qs = qs[np.lexsort((self.seq_id[qs], self.seq_len[qs]))[:1]]
        if not len(qs):
            return qs
        self._run_order = None
        on = rep[qs]  # (bincount: np.subtract.at is ~10x slower here)
        self.n -= np.bincount(on, minlength=len(self.n))
        self.tok -= np.bincount(on, self.seq_len[qs], len(self.tok)).astype(np.int64)
        for p in ps:
            self._refresh(p)
        self._n_running -= len(qs)
        self._enqueue_many(qs)
        return qs

    def _caps(self, m: int) -> np.ndarray:
        """Running-request cap per replica: the engine's, and `replica_limit` when set
        (scheduler/admission.py) but never below the replica's knee (`_knee`)."""
        lim = self.replica_limit
        if not lim:
            return self.nmax[:m]
        caps = self.nmax[:m].copy()
        lims = np.maximum(self.knee[:m], lim)
        over = (caps == 0) | (caps > lims)
        caps[over] = lims[over]
        return caps

    def _candidates(self, targets: Iterable[str] | None) -> np.ndarray:
        """Positions a dispatch may choose from, ascending (the tie-breaking order)."""
        if targets is None:
            return np.flatnonzero(self.active[: len(self._rid_of)])
        return np.unique(np.fromiter((self._pos(t) for t in targets), np.int64))

    def dispatch(
        self, targets: Iterable[str] | None = None, *, record: bool = True
    ) -> list[tuple[int, str]]:
        """Dispatch waiting sequences in priority order to the max-ΔT replica with room
        (or a sequence's preferred one within `affinity_slack`, or none yet while it may
        wait for that one: see the module docstring)."""
        if not self.n_queued:
            self.wait_until = math.inf
            return []
        m = len(self._rid_of)
        cand, caps = self._candidates(targets), self._caps(m)
        now = self.clock() if self.clock is not None and self.affinity_wait_s > 0 else math.inf
        done = []  # positions placed, in dispatch order
        wake = math.inf
        while self.n_queued:
            order, merged = self._head()
            stop, placed, waiting, w = kernels.dispatch_order(
                order,
                self.seq_len,
                self.seq_rep,
                self.seq_pref,
                self.seq_wait,
                self.affinity_slack,
                now,
                cand,
                self.n[:m],
                self.tok[:m],
                self.cap[:m],
                caps,
                self.kind[:m],
                self.A[:m],
                self.B[:m],
                self.C[:m],
                self.D[:m],
                self.T[:m],
            )
            wake = min(wake, w)
            if waiting:
                done.append(self._take_past(order[:stop], merged))
            else:
                self._take(order[:placed], merged)
                done.append(order[:placed])
            if stop < len(order) or merged is None:
                break  # one fits nowhere (the rest waits behind it), or the whole queue seen
            if waiting:  # the waiting ones stay at the head: next, the whole queue
                self._flush()
        # a dispatch onto some replicas only does not see every wait
        self.wait_until = wake if targets is None else min(self.wait_until, wake)
        qs = np.concatenate(done)
        if not len(qs):
            return []
        self._run_order = None
        self._n_running += len(qs)
        if not record:
            return []
        rid_of = self._rid_of
        ids, reps = self.seq_id[qs].tolist(), self.seq_rep[qs].tolist()
        return [(i, rid_of[p]) for i, p in zip(ids, reps, strict=True)]

    def _head(self) -> tuple[np.ndarray, np.ndarray | None]:
        """The waiting queue in priority order, for a dispatch: all of it; or, while a few
        submissions wait to be merged into a long queue, only its first `_HEAD` entries
        with those of them that come before the rest (merging into a queue of Q costs
        O(Q); at every submit, a long reward queue made that quadratic). A dispatch rarely
        places more than a few; when it places all, `dispatch` asks for the next head.
        Also returns, for a head, which of its entries are merged ones (else None)."""
        pending = self._pending
        if not pending or len(pending) >= _MERGE_PENDING or len(self._qkey) <= 4 * _HEAD:
            self._flush()
            return self._qpos, None
        qs = np.array(pending, np.int64)
        keys = self._keys(qs)
        before = keys < self._qkey[_HEAD]  # the others come after the head: they wait
        qs, keys = qs[before], keys[before]
        order = np.argsort(np.concatenate((self._qkey[:_HEAD], keys)))  # keys are unique
        return np.concatenate((self._qpos[:_HEAD], qs))[order], order < _HEAD

    def _take(self, placed: np.ndarray, merged: np.ndarray | None) -> None:
        """Drop the dispatched first entries `placed` of a `_head` from the queue."""
        n = len(placed)
        c = n if merged is None else int(np.count_nonzero(merged[:n]))
        self._qpos = self._qpos[c:]
        self._qkey = self._qkey[c:]
        if c < n:  # merged is not None: some were pending
            gone = set(placed[~merged[:n]].tolist())
            self._pending = [q for q in self._pending if q not in gone]

    def _take_past(self, seen: np.ndarray, merged: np.ndarray | None) -> np.ndarray:
        """Drop from the queue those of the first entries `seen` of a `_head` that were
        placed, past the ones left waiting; returns them (in `seen`'s order)."""
        placed = self.seq_rep[seen] >= 0
        from_q = np.ones(len(seen), bool) if merged is None else merged[: len(seen)]
        k = int(np.count_nonzero(from_q))  # those of `seen` that are _qpos[:k], in order
        keep = ~placed[from_q]
        self._qpos = np.concatenate((self._qpos[:k][keep], self._qpos[k:]))
        self._qkey = np.concatenate((self._qkey[:k][keep], self._qkey[k:]))
        if k < len(seen):  # some were pending
            gone = set(seen[~from_q & placed].tolist())
            self._pending = [q for q in self._pending if q not in gone]
        return seen[placed]

    # ------------------------------------------------ Alg. 3 and Alg. 4
    def shift_down(self, rids: Iterable[str], *, record: bool = True) -> MigrationResult:
        """Alg. 3: abort everything on the leaving replicas, remove them, re-dispatch."""
        rids = list(rids)
        for rid in rids:
            self._pos(rid)
        res = MigrationResult(throughput_before=self.throughput())
        t0 = time.perf_counter()
        if rids:
            ps = [self.replicas[rid] for rid in rids]
            res.moved_tokens = int(self.tok[ps].sum())
            if record:
                rep = self.seq_rep[: len(self._seqs)]
                res.aborted = [
                    (int(self.seq_id[q]), self._rid_of[rep[q]])
                    for q in np.flatnonzero(np.isin(rep, ps))
                ]
            self._abort(ps, "all")
            for rid in rids:
                self.remove_replica(rid)
        t1 = time.perf_counter()
        res.dispatched = self.dispatch(record=record)
        res.abort_s, res.dispatch_s = t1 - t0, time.perf_counter() - t1
        res.throughput_after = self.throughput()
        return res

    def shift_up(
        self, new: Iterable[tuple[str, int, ReplicaModel]], *, record: bool = True
    ) -> MigrationResult:
        """Alg. 4: add replicas (id, KV capacity, model), fill them from the queue, migrate."""
        res = MigrationResult(throughput_before=self.throughput())
        t0 = time.perf_counter()
        added = []
        base = self._running_order() if self.migration else None
        for rid, capacity, model in new:
            self.add_replica(rid, capacity, model)
            added.append(rid)
        self._flush()
        queued = self._qpos
        res.dispatched = self.dispatch(added, record=record)
        res.from_queue = len(res.dispatched)
        t1 = time.perf_counter()
        res.dispatch_s = t1 - t0
        if self.migration and added and not self.n_queued:
            # the new replicas come last in position order: their sequences (just placed
            # from the queue) extend the cached order of everything that already ran
            placed = queued[self.seq_rep[queued] >= 0]
            assert base is not None
            self._migrate(res, record, np.concatenate([base, self._sorted_running(placed)]))
        res.migrate_s = time.perf_counter() - t1
        res.throughput_after = self.throughput()
        return res

    def rebalance(self, *, record: bool = True) -> MigrationResult:
        """Alg. 4's migration among the replicas the role already has, when one of them is
        idle while another runs two or more sequences and nothing is queued (beyond the
        paper, `scheduler.rebalance`): sequences finish unevenly, and without a shift §6
        never moves them, so a batch's long tail can crowd one replica while the rest of
        the role idles. Moves the shortest sequences (cheapest re-prefill) while the
        role's throughput rises; no move otherwise."""
        res = MigrationResult(throughput_before=self.throughput())
        m = len(self._rid_of)
        live = self.active[:m] != 0
        if not self.migration or self.n_queued or not live.any():
            return res  # (no migration at all: the `vanilla` ablation)
        n = self.n[:m][live]
        if n.min() > 0 or n.max() < 2:
            return res
        t0 = time.perf_counter()
        self._migrate(res, record, self._running_order())
        res.migrate_s = time.perf_counter() - t0
        res.throughput_after = self.throughput()
        return res

    def _sorted_running(self, qs: np.ndarray) -> np.ndarray:
        """Positions `qs` (running) sorted by (replica, length, id)."""
        if not len(qs):
            return qs
        r, length, ids = self.seq_rep[qs], self.seq_len[qs], self.seq_id[qs]
        if len(self._rid_of) < 1 << 20 and length.max() < 1 << 21 and ids.max() < 1 << 22:
            # one int64 key (replica, length, id), unique: a plain argsort, 2-3x lexsort's speed
            return qs[np.argsort((r << 43) | (length << 22) | ids)]
        return qs[np.lexsort((ids, length, r))]

    def _running_order(self) -> np.ndarray:
        """Every running position sorted by (replica, length, id); cached until a change.
        Clones share it: the planner sorts once per snapshot, not once per candidate."""
        if self._run_order is None:
            rep = self.seq_rep[: len(self._seqs)]
            self._run_order = self._sorted_running(np.flatnonzero(rep >= 0))
        return self._run_order

    def _migrate(self, res: MigrationResult, record: bool, orig: np.ndarray) -> None:
        m = len(self._rid_of)
        rep = self.seq_rep
        qs = orig
        if not len(qs):
            return
        reps_sorted = rep[orig]
        bounds = np.arange(m + 1, dtype=np.int64)
        start = np.searchsorted(reps_sorted, bounds[:-1], "left").astype(np.int64)
        end = np.searchsorted(reps_sorted, bounds[:-1], "right").astype(np.int64)
        budget = len(qs)
        out_q = np.empty(budget, np.int64)
        out_src = np.empty(budget, np.int64)
        out_dst = np.empty(budget, np.int64)
        moves = kernels.migrate(
            orig,
            start,
            end,
            self.seq_len,
            self.seq_rep,
            self.seq_id,
            self.active[:m],
            self.n[:m],
            self.tok[:m],
            self.cap[:m],
            self._caps(m),
            self.kind[:m],
            self.A[:m],
            self.B[:m],
            self.C[:m],
            self.D[:m],
            self.T[:m],
            budget,
            out_q,
            out_src,
            out_dst,
        )
        res.migrations += moves
        if moves:
            self._run_order = None
            res.moved_tokens += int(self.seq_len[out_q[:moves]].sum())
        if record and moves:
            ids, rid_of = self.seq_id, self._rid_of
            res.aborted.extend(
                (int(ids[q]), rid_of[s])
                for q, s in zip(out_q[:moves], out_src[:moves], strict=True)
            )
            res.dispatched.extend(
                (int(ids[q]), rid_of[d])
                for q, d in zip(out_q[:moves], out_dst[:moves], strict=True)
            )

    # ---------------------------------------------------------------- copy
    def clone(self) -> Scheduler:
        """An independent copy of the state (payloads shared) for planner simulation."""
        self._flush()
        c = Scheduler.__new__(Scheduler)
        c.role, c.priority_key, c.migration = self.role, self.priority_key, self.migration
        c.affinity_slack = self.affinity_slack
        c.affinity_wait_s, c.clock, c.wait_until = self.affinity_wait_s, self.clock, self.wait_until
        c.replica_limit = self.replica_limit
        c.replicas = dict(self.replicas)
        c._rid_of = list(self._rid_of)
        c._model_of = list(self._model_of)
        for name in self._REPLICA_ARRAYS:
            setattr(c, name, getattr(self, name).copy())
        # Shared until either side submits, finishes or changes lengths (`_own`): the
        # planner's simulations only move sequences between the queue and replicas.
        c.seq_rep = self.seq_rep.copy()
        c.seq_len, c.seq_id, c.seq_pref = self.seq_len, self.seq_id, self.seq_pref
        c.seq_wait = self.seq_wait
        c._seqs, c._q_of, c._q_arr = self._seqs, self._q_of, self._q_arr
        c._shared = True
        c._sharers = weakref.WeakSet()
        self._sharers.add(c)
        c._qpos, c._qkey = self._qpos, self._qkey
        c._pending = []
        c._run_order = self._running_order() if self.migration else None
        c._n_running = self._n_running
        return c

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (used by tests)."""
        nq = len(self._seqs)
        rep = self.seq_rep[:nq]
        for rid, p in self.replicas.items():
            assert self._rid_of[p] == rid and self.active[p]
            on = rep == p
            assert self.n[p] == on.sum(), (rid, self.n[p], on.sum())
            assert self.tok[p] == self.seq_len[:nq][on].sum(), rid
            self_T = self.T[p]
            self._refresh(p)
            assert self.T[p] == self_T, rid
        inactive = [p for p in range(len(self._rid_of)) if not self.active[p]]
        assert not np.isin(rep, inactive).any(), "a sequence sits on an inactive replica"
        assert self._n_running == int((rep >= 0).sum())
        self._flush()
        assert sorted(self._qpos.tolist()) == [int(q) for q in np.flatnonzero(rep == QUEUED)]
        assert (np.diff(self._qkey) >= 0).all()
        assert (self._qkey == self._keys(self._qpos)).all()
        for seq_id, q in self._q_of.items():
            assert self._seqs[q].seq_id == seq_id and self.seq_id[q] == seq_id
            pref = int(self.seq_pref[q])
            # a preference names a replica position that existed (maybe inactive by now)
            assert pref < len(self._rid_of), (seq_id, pref)
            assert pref < 0 or pref == self._seqs[q].affinity, (seq_id, pref)
            # a wait is for a preference only
            assert pref >= 0 or self.seq_wait[q] == -math.inf, (seq_id, self.seq_wait[q])
