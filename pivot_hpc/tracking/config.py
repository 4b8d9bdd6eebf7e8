"""Tracker settings (the `tracking` section)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pivot_hpc.errors import fail

Backend = Literal["tensorboard", "wandb", "mlflow"]


@dataclass(kw_only=True)
class TrackingConfig:
    """Where the coordinator sends every step's scalars besides the console and HDF5."""

    # "tensorboard": event files in RUN_DIR/tensorboard (default); "wandb": W&B in offline
    # mode under RUN_DIR/wandb (sync later with `wandb sync`); "mlflow": a file store in
    # RUN_DIR/mlruns. W&B and MLflow must be installed (pip install wandb / mlflow).
    backends: list[Backend] = field(default_factory=lambda: ["tensorboard"])
    project: str = "pivot_hpc"  # W&B project / MLflow experiment name
    run_name: str | None = None  # None: the run directory's name

    def validate(self, path: str) -> None:
        if len(set(self.backends)) != len(self.backends):
            fail(f"{path}.backends", self.backends, "each backend at most once")
