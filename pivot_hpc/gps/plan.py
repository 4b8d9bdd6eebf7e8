"""Read/Write communication plans (App. B.2) and their cache.

Read(M, G, P): demands are (atomic slice, receiving rank); candidates are the holder nodes
of the slice's member block (one per replication group); senders are nodes. Write is the
mirror: demands are (atomic slice, holder node) for *every* holder (all replicas, or the
owning group member of each group), candidates are the ranks of G whose shard contains the
slice (DP replicas, KV-replicated TP ranks, both ends of a tied embedding); senders are
ranks. Demands are walked tensor by tensor (interleaving receivers, so no receiver grabs
the fast links first) and assigned greedily (greedy.py).

Every rank computes the same plan from the same inputs, so no plan is ever sent: a Read
needs no message at all before its transfers. Plans depend only on (op, M, G, P) once the
layout and link model are fixed, and are cached on that key.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from pivot_hpc.gps.catalog import NUMPY_DTYPE, GPSError, ModelSpec, Parallelism
from pivot_hpc.gps.greedy import assign
from pivot_hpc.gps.layout import ALIGN, HostLayout
from pivot_hpc.gps.links import LinkModel
from pivot_hpc.gps.slices import Pieces, refine


@dataclass
class Shards:
    """The tensors one rank of G holds, their shard shapes and offsets in one arena."""

    tensors: np.ndarray  # catalog indices
    names: list[str]
    shapes: list[tuple[int, ...]]
    dtypes: list[type]
    offsets: np.ndarray  # byte offset of each shard in the rank's arena (64-B aligned)
    nbytes: np.ndarray
    arena_bytes: int
    pos: dict[int, int] = field(default_factory=dict)  # catalog index -> position


@dataclass
class Boxes:
    """Target boxes of one rank's shards: the catalog index of each, its (r0, r1, c0, c1)
    and its byte offset inside its tensor's shard (non-zero for a fused tensor's later
    parts)."""

    tensor: np.ndarray
    boxes: np.ndarray
    base: np.ndarray

    def refine(self, cols_bytes: np.ndarray, itemsize: np.ndarray, bounds: np.ndarray) -> Pieces:
        t = self.tensor
        return refine(t, cols_bytes[t], itemsize[t], bounds[t], self.boxes, self.base)


@dataclass
class Plan:
    """One cached Read or Write: per-rank shards and the point-to-point ops of each actor.

    Actor = receiver (Read) or sender (Write), as an index into `ranks`. Ops of actor i are
    rows actor_ptr[i]:actor_ptr[i+1] of the op_* arrays; `op_node` is the host node on the
    other end, `op_host_off` the offset inside its member block, `op_shard_off` the offset
    inside the rank's shard of tensor `op_tensor`.
    """

    kind: Literal["read", "write"]
    model: str
    ranks: tuple[int, ...]
    par: Parallelism
    shards: list[Shards]
    actor_ptr: np.ndarray
    op_tensor: np.ndarray
    op_member: np.ndarray
    op_node: np.ndarray
    op_host_off: np.ndarray
    op_nrows: np.ndarray
    op_row_bytes: np.ndarray
    op_stride: np.ndarray
    op_shard_off: np.ndarray
    sender_bytes: np.ndarray  # bytes assigned per sender (node for Read, G index for Write)
    sender_busy_s: np.ndarray  # estimated busy seconds per sender
    demands: int
    planning_s: float
    cache: dict = field(default_factory=dict)  # per-(actor, slot) batches, built on first use

    def ops(self, i: int) -> slice:
        return slice(int(self.actor_ptr[i]), int(self.actor_ptr[i + 1]))

    @property
    def nbytes(self) -> int:
        return int((self.op_nrows * self.op_row_bytes).sum())


def check_request(model: str, spec: ModelSpec, ranks, par: Parallelism, world_size: int):
    """Validate (M, G, P) before anything moves; returns G as a tuple of ints."""
    if not isinstance(par, Parallelism):
        raise GPSError(f"parallelism {par!r}: pass a pivot_hpc.gps.Parallelism(tp, pp, dp)")
    spec.check(par)  # the model/parallelism mismatch is the more useful message
    g = tuple(int(r) for r in ranks)
    bad = [r for r in g if not 0 <= r < world_size]
    if bad:
        raise GPSError(
            f"ranks {bad} of G are not in the world (size {world_size}, valid 0..{world_size - 1})"
        )
    if len(set(g)) != len(g):
        raise GPSError(f"G = {list(g)} lists a rank twice; each rank holds one shard")
    if len(g) != par.size:
        raise GPSError(
            f"G has {len(g)} ranks but {par} needs tp*pp*dp = {par.size}; "
            "pass exactly that many ranks"
        )
    return g


def _shards(spec: ModelSpec, par: Parallelism, pp: int, tp: int) -> tuple[Shards, Boxes]:
    idx = spec.stage_tensors(par.pp, pp)
    ts = [spec.tensors[i] for i in idx]
    box_tensor, boxes, base, nbytes = [], [], [], []
    for i, t in zip(idx, ts, strict=True):
        at = 0  # a fused tensor's shard is its boxes back to back
        for r0, r1, c0, c1 in spec.shard_boxes(t, par.tp, tp):
            box_tensor.append(i)
            boxes.append((r0, r1, c0, c1))
            base.append(at)
            at += (r1 - r0) * (c1 - c0) * t.itemsize
        nbytes.append(at)
    nb = np.array(nbytes, dtype=np.int64)
    aligned = -(-nb // ALIGN) * ALIGN
    offsets = np.concatenate([[0], np.cumsum(aligned)[:-1]]).astype(np.int64)
    sh = Shards(
        tensors=np.array(idx, dtype=np.int64),
        names=[t.name for t in ts],
        shapes=[spec.shard_shape(t, par.tp, tp) for t in ts],
        dtypes=[NUMPY_DTYPE[t.dtype] for t in ts],
        offsets=offsets,
        nbytes=nb,
        arena_bytes=int(aligned.sum()),
        pos={t: p for p, t in enumerate(idx)},
    )
    bx = Boxes(
        np.array(box_tensor, dtype=np.int64),
        np.array(boxes, dtype=np.int64).reshape(-1, 4),
        np.array(base, dtype=np.int64),
    )
    return sh, bx


def _tensor_arrays(spec: ModelSpec):
    cols_bytes = np.array([t.cols * t.itemsize for t in spec.tensors], dtype=np.int64)
    itemsize = np.array([t.itemsize for t in spec.tensors], dtype=np.int64)
    return cols_bytes, itemsize


def build_read_plan(
    model: str,
    spec: ModelSpec,
    layout: HostLayout,
    node_of: np.ndarray,
    ranks: tuple[int, ...],
    par: Parallelism,
    links: LinkModel,
) -> Plan:
    t0 = time.perf_counter()
    bounds = layout.bounds[model]
    cols_bytes, itemsize = _tensor_arrays(spec)
    combo: dict[tuple[int, int], tuple[Shards, Pieces]] = {}
    shards, parts, recv = [], [], []
    for i in range(len(ranks)):
        _, pp, tp = par.coords(i)
        if (pp, tp) not in combo:
            sh, boxes = _shards(spec, par, pp, tp)
            combo[pp, tp] = sh, boxes.refine(cols_bytes, itemsize, bounds)
        sh, pieces = combo[pp, tp]
        shards.append(sh)
        parts.append(pieces)
        recv.append(np.full(len(pieces), i, dtype=np.int64))
    dem = Pieces.concat(parts)
    recv_i = np.concatenate(recv)
    order = np.argsort(dem.tensor, kind="stable")  # tensor-major walk, receivers interleaved
    dem, recv_i = dem.take(order), recv_i[order]
    # candidates of member m: its holder nodes, one per replication group
    k, groups = layout.k, layout.num_groups
    cand = np.array([layout.holders(m) for m in range(k)], dtype=np.int64).reshape(-1)
    ptr = np.arange(k + 1, dtype=np.int64) * groups
    nbytes = dem.nbytes
    dst_node = node_of[np.asarray(ranks, dtype=np.int64)[recv_i]]
    choice, acc = assign(
        nbytes,
        dst_node,
        recv_i,
        dem.member,
        ptr,
        cand,
        cand,
        links.bandwidth,
        links.overhead,
        layout.num_nodes,
        len(ranks),
        read=True,
        model=links.cost_model,
    )
    return _finish("read", model, ranks, par, shards, dem, recv_i, choice, nbytes, acc, layout, t0)


def build_write_plan(
    model: str,
    spec: ModelSpec,
    layout: HostLayout,
    node_of: np.ndarray,
    ranks: tuple[int, ...],
    par: Parallelism,
    links: LinkModel,
) -> Plan:
    t0 = time.perf_counter()
    bounds = layout.bounds[model]
    cols_bytes, itemsize = _tensor_arrays(spec)
    shards = []
    cache: dict[tuple[int, int], Shards] = {}
    for i in range(len(ranks)):
        _, pp, tp = par.coords(i)
        if (pp, tp) not in cache:
            cache[pp, tp] = _shards(spec, par, pp, tp)[0]
        shards.append(cache[pp, tp])
    # one target box per distinct shard content (and place in the shard: a fused
    # tensor's part sits after the earlier parts); its owners are the candidate senders
    box_tensor, boxes, base, cand, ptr = [], [], [], [], [0]
    for ti, t in enumerate(spec.tensors):
        owners: dict[tuple[tuple[int, int, int, int], int], list[int]] = {}
        for s in spec.stages_of(t, par.pp):
            for r in range(par.tp):
                at = 0
                for box in spec.shard_boxes(t, par.tp, r):
                    who = owners.setdefault((box, at), [])
                    who.extend(par.index(d, s, r) for d in range(par.dp))
                    at += (box[1] - box[0]) * (box[3] - box[2]) * t.itemsize
        for (box, at), who in owners.items():
            box_tensor.append(ti)
            boxes.append(box)
            base.append(at)
            cand.extend(sorted(who))
            ptr.append(len(cand))
    bt = np.array(box_tensor, dtype=np.int64)
    pieces = Boxes(bt, np.array(boxes, dtype=np.int64), np.array(base, dtype=np.int64)).refine(
        cols_bytes, itemsize, bounds
    )
    # every piece goes to every holder of its member block
    holders = np.array([layout.holders(m) for m in range(layout.k)], dtype=np.int64)
    reps = layout.num_groups
    dem = pieces.take(np.repeat(np.arange(len(pieces)), reps))
    dst_node = holders[dem.member, np.tile(np.arange(reps), len(pieces))]
    cand_a = np.array(cand, dtype=np.int64)
    cand_node = node_of[np.asarray(ranks, dtype=np.int64)[cand_a]]
    nbytes = dem.nbytes
    choice, acc = assign(
        nbytes,
        dst_node,
        np.zeros(len(nbytes), dtype=np.int64),
        dem.box,
        np.array(ptr, dtype=np.int64),
        cand_a,
        cand_node,
        links.bandwidth,
        links.overhead,
        len(ranks),
        len(ranks),
        read=False,
        model=links.cost_model,
    )
    # ops belong to the chosen sender; the host node is the demand's destination
    return _finish(
        "write", model, ranks, par, shards, dem, choice, dst_node, nbytes, acc, layout, t0
    )


def _finish(kind, model, ranks, par, shards, dem, actor, node, nbytes, acc, layout, t0) -> Plan:
    senders = node if kind == "read" else actor
    nsend = layout.num_nodes if kind == "read" else len(ranks)
    sender_bytes = np.bincount(senders, weights=nbytes, minlength=nsend).astype(np.int64)
    order = np.argsort(actor, kind="stable")
    actor = actor[order]
    ptr = np.searchsorted(actor, np.arange(len(ranks) + 1)).astype(np.int64)
    d = dem.take(order)
    return Plan(
        kind=kind,
        model=model,
        ranks=tuple(ranks),
        par=par,
        shards=shards,
        actor_ptr=ptr,
        op_tensor=d.tensor,
        op_member=d.member,
        op_node=node[order],
        op_host_off=d.host_off,
        op_nrows=d.nrows,
        op_row_bytes=d.row_bytes,
        op_stride=d.stride,
        op_shard_off=d.shard_off,
        sender_bytes=sender_bytes,
        sender_busy_s=acc,
        demands=len(nbytes),
        planning_s=time.perf_counter() - t0,
    )


class PlanCache:
    """Plans memoised by (op, model, G, P); hits/misses are counted for tests and benches."""

    def __init__(self) -> None:
        self._plans: dict[tuple, Plan] = {}
        self.hits = 0
        self.misses = 0

    def get(self, key: tuple, build) -> Plan:
        plan = self._plans.get(key)
        if plan is not None:
            self.hits += 1
            return plan
        self.misses += 1
        plan = self._plans[key] = build()
        return plan

    def clear(self) -> None:
        self._plans.clear()
