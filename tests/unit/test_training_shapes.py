"""A training rank reads its policy's shape from config.json, never by loading the whole
model (issue 47: a 72B policy in fp32 is ~271 GiB per rank); its weights come from GPS."""

from __future__ import annotations

from pathlib import Path

import pytest

from pivot_hpc.job.config import load_config
from pivot_hpc.models.qwen2 import create_model, model_config_of, model_config_of_dir
from pivot_hpc.runtime.training_seat import TrainingSeat
from pivot_hpc.runtime.training_world import TrainingWorld
from tests.tiny_arch import tiny_arch

TINY = str(Path(__file__).resolve().parents[2] / "configs/tiny.yaml")


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("policy")
    create_model(tiny_arch(), seed=0).save_pretrained(d)
    return d


def test_the_shape_from_config_json_is_the_loaded_models(policy_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(policy_dir)
    assert model_config_of_dir(policy_dir) == model_config_of(loaded) == tiny_arch()


def test_making_a_trainer_loads_no_weights(policy_dir: Path, monkeypatch) -> None:
    def refuse(*_a, **_k):
        raise AssertionError("a training rank loaded the whole policy to read its shape")

    monkeypatch.setattr("pivot_hpc.models.zoo.load_model", refuse)
    monkeypatch.setattr("safetensors.torch.load_file", refuse)
    made = {}
    monkeypatch.setattr(
        "pivot_hpc.engines.factory.make_trainer",
        lambda cfg, model_cfg, **kw: made.setdefault("shape", model_cfg),
    )
    cfg = load_config(TINY)
    seat = TrainingSeat(1, None, cfg, policy_dir, TrainingWorld((1,), (1,), 1), lambda e: None)
    seat._make_trainer()
    assert made["shape"] == model_config_of_dir(policy_dir)
