"""Throughput model of §6.1 / App. A and its least-squares fit."""

from __future__ import annotations

import numpy as np
import pytest

from pivot_hpc.scheduler import ThroughputModel, evaluate_fit, fit_throughput_model


def test_formula_and_gain() -> None:
    m = ThroughputModel(A=1e-6, B=4e-3, C=1e-4, D=1e-3)
    assert m.throughput(0, 0) == 0.0
    # memory-bound: C·n < B
    assert m.latency(10, 1000) == pytest.approx(1e-3 + 4e-3 + 1e-3)
    # compute-bound: C·n > B
    assert m.latency(100, 0) == pytest.approx(1e-2 + 1e-3)
    assert m.throughput(10, 1000) == pytest.approx(10 / 6e-3)
    g = m.gain(10, 1000, 500)
    assert g == pytest.approx(11 / (1e-6 * 1500 + 4e-3 + 1e-3) - 10 / 6e-3)
    # ΔT never increases with the sequence length.
    assert m.gain(3, 100, 10) >= m.gain(3, 100, 1000) >= m.gain(3, 100, 100000)


def test_rejects_bad_constants() -> None:
    with pytest.raises(ValueError, match="A"):
        ThroughputModel(A=-1, B=1, C=0, D=0)
    with pytest.raises(ValueError, match="B \\+ D"):
        ThroughputModel(A=1, B=0, C=1, D=0)


def test_fit_recovers_constants_and_reports_quality() -> None:
    true = ThroughputModel(A=2e-7, B=6e-3, C=1.5e-4, D=8e-4)
    rng = np.random.default_rng(0)
    n = rng.integers(1, 128, 400)
    tok = n * rng.integers(50, 2000, 400)
    lat = np.array([true.latency(int(a), int(b)) for a, b in zip(n, tok, strict=True)])
    noisy = lat * rng.normal(1.0, 0.01, lat.shape)
    rep = fit_throughput_model(noisy[:300], n[:300], tok[:300])
    assert rep.r2 > 0.99
    assert rep.model.A == pytest.approx(true.A, rel=0.05)
    assert rep.model.C == pytest.approx(true.C, rel=0.05)
    assert rep.model.B + rep.model.D == pytest.approx(true.B + true.D, rel=0.05)
    held = evaluate_fit(rep.model, noisy[300:], n[300:], tok[300:])
    assert held.median_rel_error < 0.02
    assert "R²" in rep.summary()


def test_fit_memory_bound_only() -> None:
    n = np.arange(1, 20)
    tok = n * 100
    lat = 5e-3 + 1e-7 * tok
    rep = fit_throughput_model(lat, n, tok)
    assert rep.r2 > 0.999
    assert rep.model.latency(5, 500) == pytest.approx(5e-3 + 5e-5, rel=1e-3)


def test_fit_bad_input() -> None:
    with pytest.raises(ValueError, match="at least 4"):
        fit_throughput_model([1.0], [1], [1])
    with pytest.raises(ValueError, match="equal length"):
        fit_throughput_model([1.0] * 5, [1] * 4, [1] * 5)


def test_fit_of_latency_proportional_to_batch_does_not_fail() -> None:
    """Steps whose latency is C·N_seq exactly (no floor, no intercept): the b = 0 candidate
    has B = D = 0, which is not a model; a live run once died on it mid-way."""
    n = np.array([1, 2, 3, 4, 6, 8], dtype=float)
    report = fit_throughput_model(1e-3 * n, n, np.zeros_like(n))
    m = report.model
    assert m.B + m.D > 0 and m.latency(4, 0) == pytest.approx(4e-3, rel=1e-6)
