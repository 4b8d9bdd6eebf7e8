"""The replica throughput model of paper §6.1 / App. A, and its least-squares fit.

A decode step of a continuously-batched replica takes
    L = A·N_tok + max(B, C·N_seq) + D
(attention reads the KV cache: A per token; the FFN is memory-bound (B, streaming the
weights) or compute-bound (C per sequence); D is fixed overhead). Each step yields one
token per running sequence, so T = N_seq / L tokens per second.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np


class ReplicaModel(Protocol):
    """What the scheduler needs from a throughput model.

    The compiled scheduler loops evaluate the same formulas from `kernel_params()`.
    """

    max_running: int  # running-sequence cap of a replica (0: none)

    def throughput(self, n_seq: int, n_tok: int) -> float: ...

    def gain(self, n_seq: int, n_tok: int, seq_len: int) -> float: ...

    def kernel_params(self) -> tuple[int, float, float, float, float]: ...


@dataclass(frozen=True, slots=True)
class ThroughputModel:
    """T = N_seq / (A·N_tok + max(B, C·N_seq) + D); constants in seconds.

    `max_running` > 0 caps the sequences a replica runs at once (an engine's
    max-running-requests): dispatch treats a full replica like one without KV room.
    """

    A: float
    B: float
    C: float
    D: float
    max_running: int = 0

    def __post_init__(self) -> None:
        for name in ("A", "B", "C", "D"):
            v = getattr(self, name)
            if not math.isfinite(v) or v < 0:
                raise ValueError(f"ThroughputModel.{name} = {v!r}: must be finite and >= 0")
        if self.B + self.D <= 0:
            raise ValueError(
                f"ThroughputModel: B + D = {self.B + self.D!r} must be > 0 (a step takes time)"
            )

    def latency(self, n_seq: int, n_tok: int) -> float:
        """Seconds per decode step with `n_seq` running sequences holding `n_tok` tokens."""
        c = self.C * n_seq
        return self.A * n_tok + (self.B if self.B > c else c) + self.D

    def throughput(self, n_seq: int, n_tok: int) -> float:
        """Generated tokens per second (0 for an empty replica)."""
        if n_seq <= 0:
            return 0.0
        return n_seq / self.latency(n_seq, n_tok)

    def gain(self, n_seq: int, n_tok: int, seq_len: int) -> float:
        """ΔT of adding one sequence of `seq_len` tokens (paper §6.1)."""
        return (n_seq + 1) / self.latency(n_seq + 1, n_tok + seq_len) - self.throughput(
            n_seq, n_tok
        )

    def as_dict(self) -> dict[str, float]:
        return {"A": self.A, "B": self.B, "C": self.C, "D": self.D}

    def kernel_params(self) -> tuple[int, float, float, float, float]:
        """(kind, A, B, C, D) for the compiled scheduler loops."""
        return (0, self.A, self.B, self.C, self.D)


@dataclass(frozen=True, slots=True)
class BusyModel:
    """The `vanilla` ablation (paper §8.4): a replica's throughput is 1 if busy, else 0.

    With no throughput model there is no meaningful ΔT; dispatch falls back to the
    least-loaded replica (gain 1/(N_seq+1)), which is independent of the sequence length.
    """

    max_running: int = 0

    def throughput(self, n_seq: int, n_tok: int) -> float:
        return 1.0 if n_seq > 0 else 0.0

    def gain(self, n_seq: int, n_tok: int, seq_len: int) -> float:
        return 1.0 / (n_seq + 1)

    def kernel_params(self) -> tuple[int, float, float, float, float]:
        return (1, 0.0, 0.0, 0.0, 0.0)


@dataclass(frozen=True, slots=True)
class FitReport:
    model: ThroughputModel
    r2: float
    rmse_s: float
    median_rel_error: float
    samples: int

    def summary(self) -> str:
        m = self.model
        return (
            f"A={m.A:.4g} B={m.B:.4g} C={m.C:.4g} D={m.D:.4g}  "
            f"R²={self.r2:.4f}  RMSE={self.rmse_s * 1e3:.3f} ms  "
            f"median rel. error={self.median_rel_error * 100:.2f}%  ({self.samples} samples)"
        )


def _nonneg_lstsq(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0 (drop a negative column and refit)."""
    active = list(range(X.shape[1]))
    coef = np.zeros(X.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(X[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            return coef
        active.pop(int(np.argmin(sol)))
    return coef


def fit_throughput_model(
    step_latency_s: np.ndarray | list[float],
    n_seq: np.ndarray | list[int],
    n_tok: np.ndarray | list[int],
) -> FitReport:
    """Fit A, B, C, D to profiled decode steps (latency, N_seq, N_tok).

    max(B, C·n) is continuous with a breakpoint b = B/C, so L = A·tok + C·max(b, n) + D is
    linear in (A, C, D) for a fixed b. We scan b over the observed N_seq values (plus
    "no memory-bound floor"), solve a non-negative least-squares problem for each, and keep
    the best. B = C·b. If the data show no compute-bound regime, C = 0 and B absorbs the
    floor (D = 0: B and D are not separately identifiable then).
    """
    y = np.asarray(step_latency_s, dtype=float)
    n = np.asarray(n_seq, dtype=float)
    tok = np.asarray(n_tok, dtype=float)
    if not (len(y) == len(n) == len(tok)):
        raise ValueError("fit_throughput_model: latency, n_seq and n_tok must have equal length")
    if len(y) < 4:
        raise ValueError(f"fit_throughput_model: need at least 4 samples, got {len(y)}")
    if (y <= 0).any() or (n < 1).any() or (tok < 0).any():
        raise ValueError("fit_throughput_model: need latency > 0, n_seq >= 1, n_tok >= 0")

    best: tuple[float, ThroughputModel] | None = None
    for b in np.unique(np.concatenate([[0.0], n])):
        X = np.column_stack([tok, np.maximum(b, n), np.ones_like(y)])
        A, C, D = _nonneg_lstsq(X, y)
        if b >= n.max():  # flat: C·b and D are one intercept
            A, K = _nonneg_lstsq(np.column_stack([tok, np.ones_like(y)]), y)
            model = ThroughputModel(A=float(A), B=float(max(K, 1e-12)), C=0.0, D=0.0)
        else:
            B, D = float(C * b), float(max(D, 0.0))
            if B + D <= 0:  # (b = 0 and no intercept: a step still takes time)
                D = 1e-12
            model = ThroughputModel(A=float(A), B=B, C=float(C), D=D)
        pred = np.array([model.latency(int(a), int(t)) for a, t in zip(n, tok, strict=True)])
        sse = float(((pred - y) ** 2).sum())
        if best is None or sse < best[0]:
            best = (sse, model)
    assert best is not None
    return evaluate_fit(best[1], y, n, tok)


def evaluate_fit(
    model: ThroughputModel,
    step_latency_s: np.ndarray | list[float],
    n_seq: np.ndarray | list[int],
    n_tok: np.ndarray | list[int],
) -> FitReport:
    """Fit quality of `model` on (possibly held-out) samples."""
    y = np.asarray(step_latency_s, dtype=float)
    pred = np.array(
        [model.latency(int(a), int(t)) for a, t in zip(n_seq, n_tok, strict=True)], dtype=float
    )
    resid = pred - y
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float((resid**2).sum()) / ss_tot if ss_tot > 0 else 1.0
    return FitReport(
        model=model,
        r2=r2,
        rmse_s=float(np.sqrt((resid**2).mean())),
        median_rel_error=float(np.median(np.abs(resid) / y)),
        samples=len(y),
    )
