"""Shift-aware scheduling (paper §6): throughput model, shared queue, Alg. 2–4 migration."""

from __future__ import annotations

from pivot_hpc.scheduler.scheduler import (
    MigrationResult,
    ReplicaView,
    Scheduler,
    SchedulerError,
    SeqLengths,
    SeqState,
)
from pivot_hpc.scheduler.throughput import (
    BusyModel,
    FitReport,
    ReplicaModel,
    ThroughputModel,
    evaluate_fit,
    fit_throughput_model,
)

__all__ = [
    "BusyModel",
    "FitReport",
    "MigrationResult",
    "ReplicaModel",
    "ReplicaView",
    "Scheduler",
    "SchedulerError",
    "SeqLengths",
    "SeqState",
    "ThroughputModel",
    "evaluate_fit",
    "fit_throughput_model",
]
