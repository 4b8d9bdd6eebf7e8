"""The trackers behind `tracking.backends`: one `log(step, scalars)` for all of them.

Scalars are named "section/name" (e.g. `train/loss`, `throughput/rollout_tokens_per_s`,
`eval/accuracy`); the step is the RL step (policy version). Nothing here reaches the
network: W&B runs offline, MLflow writes a file store, TensorBoard writes event files.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pivot_hpc.errors import PivotError
from pivot_hpc.tracking.config import TrackingConfig

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


class TrackingError(PivotError):
    """A tracker that was asked for cannot be used."""


def check_available(cfg: TrackingConfig) -> None:
    """One clear line, before anything starts, for a backend whose package is missing."""
    for backend in cfg.backends:
        module = PACKAGES[backend]
        if importlib.util.find_spec(module) is None:
            raise TrackingError(
                f"tracking.backends includes {backend!r} but the {module} package is not "
                f"installed: pip install {module}, or remove it from tracking.backends"
            )


class _TensorBoard:
    def __init__(self, run_dir: Path, cfg: TrackingConfig, config: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, run_dir: Path, cfg: TrackingConfig, config: Mapping[str, Any]) -> None:
        import os

        os.environ.setdefault("WANDB_SILENT", "true")  # its sync hints go to its own logs
        import wandb

        self.run = wandb.init(
            project=cfg.project,
            name=cfg.run_name or run_dir.name,
            dir=str(run_dir),
            mode="offline",
            config=dict(config),
            resume="allow",
            id=f"pivot-{run_dir.resolve().name}",
        )

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log(dict(scalars), step=step)

    def close(self) -> None:
        self.run.finish()


class _MLflow:
    def __init__(self, run_dir: Path, cfg: TrackingConfig, config: Mapping[str, Any]) -> None:
        import os

        # MLflow 3 keeps its file store only on request; a file store needs no server and
        # no database, which is what a batch job on a cluster file system wants
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        import mlflow

        mlflow.set_tracking_uri((run_dir / "mlruns").resolve().as_uri())
        mlflow.set_experiment(cfg.project)
        self.mlflow = mlflow
        mlflow.start_run(run_name=cfg.run_name or run_dir.name)

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self.mlflow.log_metrics({k.replace("/", "."): v for k, v in scalars.items()}, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


BACKENDS = {"tensorboard": _TensorBoard, "wandb": _WandB, "mlflow": _MLflow}


class Trackers:
    """Every configured tracker; non-finite values are left out (they break some UIs)."""

    def __init__(self, trackers: list[Any]) -> None:
        self.trackers = trackers

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        clean = {k: float(v) for k, v in scalars.items() if math.isfinite(float(v))}
        if clean:
            for t in self.trackers:
                t.log(step, clean)

    def close(self) -> None:
        for t in self.trackers:
            t.close()


def open_trackers(
    cfg: TrackingConfig, run_dir: Path, config: Mapping[str, Any] | None = None
) -> Trackers:
    check_available(cfg)
    return Trackers([BACKENDS[b](run_dir, cfg, config or {}) for b in cfg.backends])
