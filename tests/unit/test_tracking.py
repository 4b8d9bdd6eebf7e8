"""Experiment trackers: TensorBoard event files a reader can load back; a tracker that is
asked for but not installed is one clear line before anything starts."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from pivot_hpc.cli.main import main
from pivot_hpc.tracking import TrackingConfig, open_trackers
from pivot_hpc.tracking.trackers import TrackingError, check_available

TINY = str(Path(__file__).parents[2] / "configs" / "tiny.yaml")


def test_tensorboard_event_files_hold_every_step(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trackers = open_trackers(TrackingConfig(), tmp_path, {"loop": {"steps": 2}})
    trackers.log(1, {"train/loss": 0.5, "reward/mean": 0.25, "train/kl": float("nan")})
    trackers.log(2, {"train/loss": 0.25, "reward/mean": 0.5})
    trackers.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"train/loss", "reward/mean"}  # NaN left out
    loss = acc.Scalars("train/loss")
    assert [(e.step, e.value) for e in loss] == [(1, 0.5), (2, 0.25)]


@pytest.mark.parametrize("backend", ["wandb", "mlflow"])
def test_a_missing_tracker_package_is_one_line_before_launch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], backend: str
) -> None:
    if importlib.util.find_spec(backend) is not None:
        check_available(TrackingConfig(backends=[backend]))  # installed: nothing to refuse
        return
    with pytest.raises(TrackingError, match=f"pip install {backend}"):
        check_available(TrackingConfig(backends=[backend]))
    code = main(["run", TINY, "--run-dir", str(tmp_path / "r"), f"tracking.backends=[{backend}]"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "tracking.backends" in err
    assert not (tmp_path / "r").exists()


def test_tracking_keys_are_validated() -> None:
    from pivot_hpc.config import ConfigError
    from pivot_hpc.job.config import load_config

    with pytest.raises(ConfigError, match="tracking.backends"):
        load_config(TINY, ["tracking.backends=[neptune]"])
    with pytest.raises(ConfigError, match="at most once"):
        load_config(TINY, ["tracking.backends=[tensorboard,tensorboard]"])


@pytest.mark.slow  # imports wandb and mlflow (3-4 s)
def test_wandb_offline_and_mlflow_file_store(tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    cfg = TrackingConfig(backends=["wandb", "mlflow"], project="p")
    trackers = open_trackers(cfg, tmp_path, {"loop": {"steps": 2}})
    trackers.log(1, {"train/loss": 0.5})
    trackers.log(2, {"train/loss": 0.25})
    trackers.close()
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))  # for `wandb sync`
    (metric,) = (tmp_path / "mlruns").glob("*/*/metrics/train.loss")
    rows = [line.split() for line in metric.read_text().splitlines()]
    assert [(float(v), int(step)) for _t, v, step in rows] == [(0.5, 1), (0.25, 2)]
