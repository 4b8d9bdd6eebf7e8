"""Config: YAML + dotted overrides into dataclasses, one validation pass, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from pivot_hpc.config import ConfigError, to_dict
from pivot_hpc.job.config import load_config


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "run.yaml"
    p.write_text(text)
    return p


def test_defaults_load_and_validate() -> None:
    cfg = load_config()
    assert cfg.planner.strategy == "pivot"
    assert cfg.planner.horizon_s == 60.0
    assert to_dict(cfg)["planner"]["horizon_s"] == 60.0


def test_yaml_and_overrides(tmp_path: Path) -> None:
    p = write(
        tmp_path,
        "cluster: {nodes: 2, gpus_per_node: 8}\nreward: {tp: 4}\nplanner: {strategy: rule}\n",
    )
    cfg = load_config(
        p, ["planner.horizon_s=120", "reward.throughput.A=1e-7", "training.num_gpus=4"]
    )
    assert cfg.cluster.total_gpus == 16
    assert cfg.planner.strategy == "rule" and cfg.planner.horizon_s == 120.0
    assert cfg.reward.throughput.A == 1e-7
    assert cfg.training_gpus() == [12, 13, 14, 15]


def test_unknown_key_lists_valid_keys(tmp_path: Path) -> None:
    p = write(tmp_path, "planner: {strategy: pivot, horizon: 5}\n")
    with pytest.raises(ConfigError) as exc:
        load_config(p)
    msg = str(exc.value)
    assert "'planner.horizon'" in msg and "horizon_s" in msg and "strategy" in msg


def test_unknown_override_key_names_level() -> None:
    with pytest.raises(ConfigError, match="unknown key 'planner.horizn'.*horizon_s"):
        load_config(None, ["planner.horizn=3"])
    with pytest.raises(ConfigError, match="dotted.key=value"):
        load_config(None, ["planner.horizon_s"])


def test_wrong_type_and_choice() -> None:
    with pytest.raises(ConfigError, match="'planner.horizon_s': expected a number"):
        load_config(None, ["planner.horizon_s=soon"])
    with pytest.raises(
        ConfigError, match="valid choices: 'pivot', 'pivot\\+', 'static', 'rule', 'vanilla'"
    ):
        load_config(None, ["planner.strategy=magic"])
    with pytest.raises(ConfigError, match="expected an integer"):
        load_config(None, ["cluster.nodes=1.5"])


def test_cross_field_validation() -> None:
    with pytest.raises(ConfigError, match="reward.tp.*divide cluster.gpus_per_node=4"):
        load_config(None, ["reward.tp=3"])
    with pytest.raises(ConfigError, match="training.gpus.*outside the cluster"):
        load_config(None, ["training.gpus=[0, 9]"])
    with pytest.raises(ConfigError, match="distinct"):
        load_config(None, ["training.gpus=[1, 1]"])
    with pytest.raises(ConfigError, match="rule_low_util"):
        load_config(None, ["planner.rule_low_util=0.9"])
    with pytest.raises(ConfigError, match="throughput constants"):
        load_config(None, ["rollout.throughput.C=-1"])


def test_missing_and_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "a: [1, 2\n"))
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(write(tmp_path, "- 1\n- 2\n"))


@pytest.mark.parametrize(
    "override",
    [
        "planner.interval_s=nan",
        "rl.grpo.temperature=nan",
        "rl.grpo.kl_coef=.nan",
        "loop.monitor_interval_s=inf",
        "planner.horizon_s=-inf",
        "sim.workload.response_median=nan",
    ],
)
def test_non_finite_floats_are_refused_by_key(override: str) -> None:
    """NaN compares false, so it would pass every range check: refused where it is read."""
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=f"'{key}'.*not a finite number"):
        load_config(None, [override])


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("rollout.tp=0", "rollout.tp"),
        ("reward.tp=-2", "reward.tp"),
        ("cluster.nodes=0", "cluster.nodes"),
        ("cluster.gpus_per_node=0", "cluster.gpus_per_node"),
    ],
)
def test_zero_sizes_blame_their_own_key(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=f"'{key}'"):
        load_config(None, [override])


@pytest.mark.parametrize(
    ("content", "expect"),
    [
        (b"loop:\n\tsteps: 3\n", "line 2, column 1: .*spaces, not tabs"),
        (b"loop: {steps: 3\n", "line 2, column 1: expected ',' or '}'"),
        (b"\xff\xfeloop: 1\n", "not UTF-8 text .*0xff"),
    ],
)
def test_broken_config_files_are_one_line_naming_file_and_line(
    tmp_path: Path, content: bytes, expect: str
) -> None:
    f = tmp_path / "broken.yaml"
    f.write_bytes(content)
    with pytest.raises(ConfigError, match=expect) as info:
        load_config(str(f), [])
    assert "broken.yaml" in str(info.value) and "\n" not in str(info.value)
    assert "<unicode string>" not in str(info.value)


def test_bad_override_value_is_one_line() -> None:
    with pytest.raises(ConfigError, match=r"'loop.steps=\[1'.*not valid YAML.*column 3") as info:
        load_config(None, ["loop.steps=[1"])
    assert "\n" not in str(info.value)


def test_cluster_timeouts_are_config_keys_with_checkpoint_sized_defaults() -> None:
    """A checkpoint barrier among training ranks (and SGLang's watchdog during a large
    model's start or a paused update) can take minutes: both are keys, not constants."""
    from pivot_hpc.job.config import load_config

    cfg = load_config(None)
    assert cfg.rl.trainer.collective_timeout_s >= 600
    assert cfg.engines.rollout.watchdog_timeout_s >= 600
    with pytest.raises(ConfigError, match="rl.trainer.collective_timeout_s"):
        load_config(None, ["rl.trainer.collective_timeout_s=0"])
