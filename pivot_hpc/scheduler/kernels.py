"""Compiled inner loops of the scheduler (numba): argmax ΔT, Dispatch, Alg. 4 migration.

The planner replays a migration for every candidate plan, so these loops run hundreds of
thousands of times per decision at 1024 GPUs; in plain Python they took ~10 µs per
dispatched sequence, compiled they take well under 1 µs. The arithmetic is written in the
same operation order as `ThroughputModel` so both give bit-identical floats (tests check
the choices against a brute-force argmax over `ThroughputModel.gain`).

Replica arrays are indexed by position p (insertion order, the tie-breaker); a model is
`kind` (0: the throughput model with constants A, B, C, D; 1: busy/idle for `vanilla`).
Sequence arrays are indexed by position q: length, replica (-1 queued, -2 gone), id,
the preferred replica (negative: none; see `prefer`) and until when it may wait for it
(`dispatch_order`).
"""

from __future__ import annotations

import numpy as np
from numba import njit

KIND_MODEL = 0
KIND_BUSY = 1


@njit(cache=True, inline="always")
def latency(A, B, C, D, n, tok):
    c = C * n
    return A * tok + (B if B > c else c) + D


@njit(cache=True, inline="always")
def throughput(kind, A, B, C, D, n, tok):
    if n <= 0:
        return 0.0
    if kind == KIND_BUSY:
        return 1.0
    return n / latency(A, B, C, D, n, tok)


@njit(cache=True, inline="always")
def gain(kind, A, B, C, D, n, tok, length):
    if kind == KIND_BUSY:
        return 1.0 / (n + 1)
    return (n + 1) / latency(A, B, C, D, n + 1, tok + length) - throughput(kind, A, B, C, D, n, tok)


@njit(cache=True, inline="always")
def has_room(p, length, n, tok, cap, nmax):
    """Replica p can take a sequence of `length` tokens: KV room and a running slot."""
    return tok[p] + length <= cap[p] and (nmax[p] <= 0 or n[p] < nmax[p])


@njit(cache=True, inline="always")
def is_candidate(p, cand):
    """p is one of the ascending candidate positions `cand`."""
    i = np.searchsorted(cand, p)
    return i < cand.shape[0] and cand[i] == p


@njit(cache=True)
def best_replica(length, cand, n, tok, cap, nmax, kind, A, B, C, D):
    """argmax ΔT over candidate positions `cand` (ascending) with room (KV tokens within
    `cap`, fewer than `nmax` running when `nmax` > 0); -1 if none."""
    best = -1
    best_gain = 0.0
    for i in range(cand.shape[0]):
        p = cand[i]
        if not has_room(p, length, n, tok, cap, nmax):
            continue
        g = gain(kind[p], A[p], B[p], C[p], D[p], n[p], tok[p], length)
        if best < 0 or g > best_gain:
            best = p
            best_gain = g
    return best


@njit(cache=True)
def prefer(best, pref, slack, length, cand, n, tok, cap, nmax, kind, A, B, C, D):
    """Soft affinity: `pref` instead of the argmax `best` when `pref` is a candidate with
    room and its gain is within `slack` of the best gain (g_pref >= g_best − slack·|g_best|:
    for a positive gain that is (1 − slack)·g_best; the |·| keeps a negative best gain —
    a replica past its throughput peak — from admitting a worse one by more than the
    slack). A trajectory's returning turn reuses the prefix its last replica still caches;
    a `pref` that shifted down is no candidate, so it simply means no preference."""
    if best < 0 or pref < 0 or pref == best or slack <= 0.0:
        return best
    if not is_candidate(pref, cand) or not has_room(pref, length, n, tok, cap, nmax):
        return best
    g_best = gain(kind[best], A[best], B[best], C[best], D[best], n[best], tok[best], length)
    g_pref = gain(kind[pref], A[pref], B[pref], C[pref], D[pref], n[pref], tok[pref], length)
    if g_pref >= g_best - slack * abs(g_best):
        return pref
    return best


@njit(cache=True)
def dispatch_order(
    order,
    seq_len,
    seq_rep,
    seq_pref,
    seq_wait,
    slack,
    now,
    cand,
    n,
    tok,
    cap,
    nmax,
    kind,
    A,
    B,
    C,
    D,
    T,
):
    """Dispatch queued sequences `order` (priority order) until one fits nowhere: each to
    the argmax-ΔT replica, or to its preferred one (`seq_pref`) within `slack` (`prefer`;
    slack 0: the argmax alone, as before).

    Bounded wait (slack > 0): a sequence whose preferred replica is a candidate without
    room for it, while `now` < its `seq_wait` deadline, is skipped — it stays queued for
    its replica and the sequences behind it are dispatched past it. One that fits nowhere
    at all still stops the loop (strict priority, as without the wait).

    Returns (entries of `order` examined: all, or up to the one that fits nowhere; how
    many were placed; how many were skipped to wait; the earliest deadline among those,
    inf if none). `seq_rep` tells where each placed one went; without skips the placed
    ones are the first entries of `order`.
    """
    placed = 0
    waiting = 0
    wake = np.inf
    stop = order.shape[0]
    for i in range(order.shape[0]):
        q = order[i]
        length = seq_len[q]
        p = best_replica(length, cand, n, tok, cap, nmax, kind, A, B, C, D)
        if p < 0:
            stop = i
            break
        pref = seq_pref[q]
        if slack > 0.0 and pref >= 0 and pref != p:
            if (
                now < seq_wait[q]
                and is_candidate(pref, cand)
                and not has_room(pref, length, n, tok, cap, nmax)
            ):
                waiting += 1
                if seq_wait[q] < wake:
                    wake = seq_wait[q]
                continue
            p = prefer(p, pref, slack, length, cand, n, tok, cap, nmax, kind, A, B, C, D)
        seq_rep[q] = p
        n[p] += 1
        tok[p] += length
        T[p] = throughput(kind[p], A[p], B[p], C[p], D[p], n[p], tok[p])
        placed += 1
    return stop, placed, waiting, wake


@njit(cache=True)
def _shortest(p, orig, ptr, end, in_head, node_q, node_next, seq_len, seq_rep, seq_id):
    """Shortest sequence on replica p: its sorted original list, then its arrivals."""
    best = -1
    i = ptr[p]
    while i < end[p] and seq_rep[orig[i]] != p:
        i += 1
    ptr[p] = i
    if i < end[p]:
        best = orig[i]
    node = in_head[p]
    while node >= 0:
        q = node_q[node]
        if seq_rep[q] == p and (
            best < 0
            or seq_len[q] < seq_len[best]
            or (seq_len[q] == seq_len[best] and seq_id[q] < seq_id[best])
        ):
            best = q
        node = node_next[node]
    return best


@njit(cache=True)
def migrate(
    orig,
    start,
    end,
    seq_len,
    seq_rep,
    seq_id,
    active,
    n,
    tok,
    cap,
    nmax,
    kind,
    A,
    B,
    C,
    D,
    T,
    budget,
    out_q,
    out_src,
    out_dst,
):
    """Alg. 4 lines 6–18. `orig[start[p]:end[p]]` lists replica p's sequences by (length, id).

    Repeatedly takes the max-throughput replica (ties: lowest position), aborts its
    shortest sequence and re-dispatches it to the max-ΔT replica; a move that does not
    raise the aggregate throughput is undone and ends the loop. Returns the move count.
    """
    nrep = n.shape[0]
    cand = np.flatnonzero(active)
    ptr = start.copy()
    in_head = np.full(nrep, -1, np.int64)
    node_q = np.empty(budget + 1, np.int64)
    node_next = np.empty(budget + 1, np.int64)
    moves = 0
    while moves < budget:
        src = -1
        for i in range(cand.shape[0]):
            p = cand[i]
            if n[p] > 0 and (src < 0 or T[p] > T[src]):
                src = p
        if src < 0:
            break
        q = _shortest(src, orig, ptr, end, in_head, node_q, node_next, seq_len, seq_rep, seq_id)
        if q < 0:
            break
        length = seq_len[q]
        t_src = T[src]
        n[src] -= 1
        tok[src] -= length
        T[src] = throughput(kind[src], A[src], B[src], C[src], D[src], n[src], tok[src])
        dst = best_replica(length, cand, n, tok, cap, nmax, kind, A, B, C, D)
        if dst < 0 or dst == src:
            n[src] += 1
            tok[src] += length
            T[src] = t_src
            break
        t_dst = T[dst]
        n[dst] += 1
        tok[dst] += length
        T[dst] = throughput(kind[dst], A[dst], B[dst], C[dst], D[dst], n[dst], tok[dst])
        delta = (T[src] - t_src) + (T[dst] - t_dst)
        scale = abs(t_src) + abs(t_dst)
        if not delta > 1e-12 * (scale if scale > 1.0 else 1.0):
            n[dst] -= 1
            tok[dst] -= length
            T[dst] = t_dst
            n[src] += 1
            tok[src] += length
            T[src] = t_src
            break
        seq_rep[q] = dst
        node_q[moves] = q
        node_next[moves] = in_head[dst]
        in_head[dst] = moves
        out_q[moves] = q
        out_src[moves] = src
        out_dst[moves] = dst
        moves += 1
    return moves


@njit(cache=True)
def refresh_all(cand, n, tok, kind, A, B, C, D, T):
    """Recompute the throughput of replicas `cand` (after bulk length updates)."""
    for i in range(cand.shape[0]):
        p = cand[i]
        T[p] = throughput(kind[p], A[p], B[p], C[p], D[p], n[p], tok[p])
