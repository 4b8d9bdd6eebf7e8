"""Experiment trackers: the per-step scalars of a run in TensorBoard, W&B or MLflow."""

from __future__ import annotations

from pivot_hpc.tracking.config import TrackingConfig
from pivot_hpc.tracking.trackers import Trackers, check_available, open_trackers

__all__ = ["Trackers", "TrackingConfig", "check_available", "open_trackers"]
