"""Candidate set construction: the dynamic program of paper §7.2, Alg. 1, App. D.

Each shift pair offers an ordered list of shift-up replicas and a common shift-down set
whose penalty φ is paid once if any prefix of the list is taken. For every shift-up
count k the DP keeps the combination of pair prefixes with the smallest total penalty.
Ties keep the later candidate in the traversal order (j ascending, then e ascending), as
App. D.2 specifies.

Implementation: the j-loop of Alg. 1 is vectorised (one numpy pass per (pair, e)), and
plans are recovered by back-pointers instead of copying plan lists at every transition,
so the cost is O(Σ r_i) array passes of length K+1.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


class PairLike(Protocol):
    up: Sequence[Hashable]
    down: Sequence[Hashable]
    penalty: float


@dataclass(frozen=True)
class ShiftPair:
    """Ordered shift-up replicas, their common shift-down set, and its penalty φ."""

    up: list[Hashable]
    down: list[Hashable]
    penalty: float


@dataclass(frozen=True)
class Candidate:
    """One shift plan: shift up `k` replicas (`up`), shift down `down`, at `penalty`."""

    k: int
    up: list[Hashable]
    down: list[Hashable]
    penalty: float
    prefixes: tuple[tuple[int, int], ...] = field(default=(), compare=False)  # (pair, e)


def build_candidates(pairs: Sequence[PairLike], max_up: int) -> list[Candidate]:
    """Alg. 1: one minimum-penalty candidate per reachable shift-up count k in 1..max_up.

    `pairs` must already be sorted by penalty (ascending), as the planner does.
    """
    total = sum(len(p.up) for p in pairs)
    K = min(int(max_up), total)
    if K < 1:
        return []
    for i, p in enumerate(pairs):
        if not np.isfinite(p.penalty) or p.penalty < 0:
            raise ValueError(f"shift pair {i}: penalty {p.penalty!r} must be finite and >= 0")
    D = np.full(K + 1, np.inf)
    D[0] = 0.0
    choices: list[np.ndarray] = []
    for p in pairs:
        r = min(len(p.up), K)
        new_D = D.copy()
        choice = np.zeros(K + 1, dtype=np.int32)
        phi = float(p.penalty)
        # Descending e: for one target j+e, the transition with the larger j (smaller e)
        # comes later in Alg. 1's traversal and must win ties, so it is applied last.
        for e in range(r, 0, -1):
            cand = D[: K + 1 - e] + phi
            tgt = new_D[e:]
            mask = cand <= tgt
            mask &= np.isfinite(cand)
            tgt[mask] = cand[mask]
            choice[e:][mask] = e
        D = new_D
        choices.append(choice)

    out: list[Candidate] = []
    for k in range(1, K + 1):
        if not np.isfinite(D[k]):
            continue
        taken: list[tuple[int, int]] = []
        j = k
        for i in range(len(pairs) - 1, -1, -1):
            e = int(choices[i][j])
            if e:
                taken.append((i, e))
                j -= e
        assert j == 0, "DP back-pointers are inconsistent"
        taken.reverse()
        up: list[Hashable] = []
        down: list[Hashable] = []
        for i, e in taken:
            up.extend(pairs[i].up[:e])
            down.extend(pairs[i].down)
        out.append(Candidate(k=k, up=up, down=down, penalty=float(D[k]), prefixes=tuple(taken)))
    return out
