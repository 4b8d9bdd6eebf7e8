"""The live GPU configs of the paper's four model groups (configs/gpu/) validate, and the
trainer's dtype key parses and resolves per machine."""

from __future__ import annotations

from pathlib import Path

import pytest

from pivot_hpc.config import ConfigError, load_config
from pivot_hpc.rl.config import TrainerConfig

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs" / "gpu").glob("group*.yaml"))
# (policy TP, GenRM TP, GPUs, training GPUs) per group: paper Table 1 and Table 4
TABLE = {
    "group1": (1, 1, 32, 16),
    "group2": (1, 4, 32, 8),
    "group3": (4, 4, 64, 32),
    "group4": (8, 8, 128, 64),
}


def _data_overrides(tmp_path: Path) -> list[str]:
    # the configs name the cluster's dataset files and model directories; validation wants
    # them to exist
    train, val = tmp_path / "dapo-math-17k.parquet", tmp_path / "aime-2024.parquet"
    train.touch()
    val.touch()
    models = []
    for name in ("policy", "genrm"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
        models.append(f"models.{name}_path={tmp_path / name}")
    return [f"rl.data.train={train}", f"rl.data.validation={val}", *models]


def test_one_config_per_group():
    assert [p.name.split("-")[0] for p in CONFIGS] == sorted(TABLE)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_gpu_group_config_validates(path: Path, tmp_path: Path):
    cfg = load_config(path, _data_overrides(tmp_path))
    policy_tp, genrm_tp, gpus, train = TABLE[path.name.split("-")[0]]
    assert cfg.rollout.tp == policy_tp and cfg.rl.trainer.tp == policy_tp
    assert cfg.reward.tp == genrm_tp
    assert cfg.cluster.total_gpus == gpus and cfg.training.num_gpus == train
    assert cfg.engines.rollout.engine == cfg.engines.reward.engine == "sglang"
    assert cfg.rl.trainer.engine == "megatron"
    assert cfg.rl.trainer.dtype == "bf16"
    assert cfg.deployment.mode == "pivot" and cfg.deployment.effective_staleness() == 2
    assert cfg.models.policy_path == tmp_path / "policy"
    assert cfg.rl.max_response_tokens == 15360 and cfg.rl.data.max_prompt_tokens == 2048
    rollout, reward = cfg.deployment.rollout_gpus, cfg.deployment.reward_gpus
    assert rollout is not None and reward is not None and rollout + reward + train == gpus


def test_trainer_dtype_parses_and_resolves():
    assert load_config(None, ["rl.trainer.dtype=fp32"]).rl.trainer.dtype == "fp32"
    with pytest.raises(ConfigError, match="rl.trainer.dtype"):
        load_config(None, ["rl.trainer.dtype=fp16"])
    auto = TrainerConfig()
    assert auto.dtype == "auto"
    assert auto.resolved_dtype(cuda=True) == "bf16"
    assert auto.resolved_dtype(cuda=False) == "fp32"
    assert TrainerConfig(dtype="bf16").resolved_dtype(cuda=False) == "bf16"


def test_a_missing_model_directory_is_named(tmp_path: Path):
    with pytest.raises(ConfigError, match="models.policy_path"):
        load_config(CONFIGS[0], [*_data_overrides(tmp_path), f"models.policy_path={tmp_path}"])
