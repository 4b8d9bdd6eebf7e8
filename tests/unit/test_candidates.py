"""Candidate set construction (Alg. 1): the DP equals brute force on small instances."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivot_hpc.planner.candidates import ShiftPair, build_candidates


def brute_force(pairs: list[ShiftPair], max_up: int) -> dict[int, float]:
    best: dict[int, float] = {}
    for es in itertools.product(*[range(len(p.up) + 1) for p in pairs]):
        k = sum(es)
        if not 1 <= k <= max_up:
            continue
        phi = sum(p.penalty for p, e in zip(pairs, es, strict=True) if e)
        best[k] = min(best.get(k, math.inf), phi)
    return best


pair_lists = st.lists(
    st.tuples(st.integers(1, 4), st.integers(0, 3), st.floats(0, 100, allow_nan=False)),
    min_size=0,
    max_size=6,
)


@settings(max_examples=300, deadline=None)
@given(spec=pair_lists, max_up=st.integers(0, 12))
def test_dp_equals_brute_force(spec, max_up) -> None:
    pairs = []
    for i, (n_up, n_down, phi) in enumerate(spec):
        pairs.append(
            ShiftPair(
                up=[f"u{i}.{j}" for j in range(n_up)],
                down=[f"d{i}.{j}" for j in range(n_down)],
                penalty=phi,
            )
        )
    pairs.sort(key=lambda p: p.penalty)
    cands = build_candidates(pairs, max_up)
    expect = brute_force(pairs, max_up)
    assert [c.k for c in cands] == sorted(expect)
    for c in cands:
        assert c.penalty == pytest.approx(expect[c.k], rel=1e-12, abs=1e-12)
        # The plan is a union of pair prefixes whose penalties add up to its penalty.
        used = []
        for p in pairs:
            taken = [u for u in c.up if u in p.up]
            if taken:
                assert taken == p.up[: len(taken)], "not a prefix of the pair's order"
                assert all(d in c.down for d in p.down)
                used.append(p)
        assert len(c.up) == c.k
        assert c.penalty == pytest.approx(sum(p.penalty for p in used), rel=1e-12, abs=1e-12)


def test_pair_penalty_counts_once_and_later_candidate_wins_ties() -> None:
    a = ShiftPair(up=["a1", "a2"], down=["x"], penalty=0.0)
    b = ShiftPair(up=["b1"], down=["y"], penalty=0.0)
    c = ShiftPair(up=["c1", "c2", "c3", "c4"], down=["z"], penalty=5.0)
    cands = build_candidates([a, b, c], max_up=7)
    by_k = {x.k: x for x in cands}
    assert by_k[2].penalty == 0.0
    # k=1: a1 (from a), or b1 — equal penalty: App. D.2 keeps the later one (b1).
    assert by_k[1].up == ["b1"]
    assert by_k[3].up == ["a1", "a2", "b1"] and by_k[3].penalty == 0.0
    assert by_k[4].penalty == 5.0 and by_k[7].penalty == 5.0
    assert by_k[7].down == ["x", "y", "z"]


def test_max_up_limits_and_bad_penalty() -> None:
    p = ShiftPair(up=["a", "b", "c"], down=[], penalty=1.0)
    assert [c.k for c in build_candidates([p], 2)] == [1, 2]
    assert build_candidates([p], 0) == []
    assert build_candidates([], 5) == []
    with pytest.raises(ValueError, match="penalty"):
        build_candidates([ShiftPair(up=["a"], down=[], penalty=-1.0)], 1)


def test_integer_ids_work() -> None:
    pairs = [ShiftPair(up=[3, 4], down=[9], penalty=1.5), ShiftPair(up=[7], down=[], penalty=2.0)]
    cands = build_candidates(pairs, 3)
    assert [(c.k, c.up, c.down, c.penalty) for c in cands] == [
        (1, [3], [9], 1.5),
        (2, [3, 4], [9], 1.5),
        (3, [3, 4, 7], [9], 3.5),
    ]
