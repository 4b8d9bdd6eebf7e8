"""The paper's four model groups are one config each (configs/groups/), read both ways:
as `pivot-hpc run` launches it (validation with its files, the memory plan on 96 GB H20s,
the launch checks, each model directory a tiny stand-in of its architecture) and as `pivot-hpc simulate` costs it (the same models, GPU, tensor
parallelism, recompute and caps, from the same keys). Keys that moved out of `sim:` fail
with one line naming their new key. Also: the trainer's dtype key parses and resolves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pivot_hpc.config import ConfigError
from pivot_hpc.config.loader import MAX_SHOWN_CHARS, load_yaml
from pivot_hpc.job.config import load_config
from pivot_hpc.recipes.tiny_arch_dirs import build_arch_dir
from pivot_hpc.rl.config import TrainerConfig
from pivot_hpc.sim.config import SimConfig, WorkloadConfig

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs" / "groups").glob("group*.yaml"))
# (policy TP, GenRM TP, GPUs, training GPUs, policy, GenRM) per group: paper Table 1, Table 4
TABLE = {
    "group1": (1, 1, 32, 16, "qwen2.5-1.5b", "glm-z1-9b"),
    "group2": (1, 4, 32, 8, "qwen2.5-7b", "qwen3-30b-a3b"),
    "group3": (4, 4, 64, 32, "qwen2.5-32b", "qwen3-30b-a3b"),
    "group4": (8, 8, 128, 64, "qwen2.5-72b", "qwen3.5-122b-a10b"),
}
# each model directory a group names, as a tiny random-init one of its architecture
STAND_IN = {
    "Qwen2.5-1.5B": "qwen2-tied",
    "Qwen2.5-7B": "qwen2",
    "Qwen2.5-32B": "qwen2",
    "Qwen2.5-72B": "qwen2",
    "GLM-Z1-9B": "glm4",
    "Qwen3-30B-A3B": "qwen3-moe",
    "Qwen3.5-122B-A10B": "qwen3.5-moe",
}
# §8.1's 2K / 15K / 20K, read as binary K
CAPS = (2048, 15360, 20480)


def _planted(tmp_path: Path, path: Path) -> list[str]:
    """The config's dataset files and model directories, here (validation wants them to
    exist), named as the config names them (the directory name says the catalog model)."""
    train, val = tmp_path / "dapo-math-17k.parquet", tmp_path / "aime-2024.parquet"
    train.touch()
    val.touch()
    out = [f"rl.data.train={train}", f"rl.data.validation={val}"]
    for key in ("policy", "genrm"):
        d = tmp_path / Path(load_yaml(path)["models"][f"{key}_path"]).name
        build_arch_dir(STAND_IN[d.name], d)  # checked for its roles before a launch
        out.append(f"models.{key}_path={d}")
    return out


def test_one_config_per_group_and_no_second_vocabulary() -> None:
    assert [p.name.split("-")[0] for p in CONFIGS] == sorted(TABLE)
    assert not (ROOT / "configs" / "sim").exists()
    assert not list((ROOT / "configs").rglob("gpu/group*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_live_reading(path: Path, tmp_path: Path) -> None:
    from pivot_hpc.planning import check_memory
    from pivot_hpc.runtime.world import check_before_launch

    cfg = load_config(path, _planted(tmp_path, path))
    policy_tp, genrm_tp, gpus, train, _policy, _genrm = TABLE[path.name.split("-")[0]]
    assert cfg.rollout.tp == policy_tp and cfg.rl.trainer.tp == policy_tp
    assert cfg.reward.tp == genrm_tp
    assert cfg.cluster.total_gpus == gpus and cfg.training.num_gpus == train
    assert cfg.cluster.gpu == "h20"
    assert cfg.engines.rollout.engine == cfg.engines.reward.engine == "sglang"
    assert cfg.rl.trainer.engine == "megatron" and cfg.rl.trainer.dtype == "bf16"
    assert cfg.deployment.mode == "pivot" and cfg.deployment.effective_staleness() == 2
    assert cfg.models.policy_path is not None and cfg.models.policy_path.parent == tmp_path
    assert (
        cfg.rl.data.max_prompt_tokens,
        cfg.rl.max_response_tokens,
        cfg.rl.reward.genrm_max_tokens,
    ) == CAPS
    rollout, reward = cfg.deployment.rollout_gpus, cfg.deployment.reward_gpus
    assert rollout is not None and reward is not None and rollout + reward + train == gpus
    check_memory(cfg)  # fits 96 GB H20s as shipped: the launchers' first check passes
    check_before_launch(cfg)  # ... and nothing the live runtime cannot run


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_plan_json_fits_h20_both_ways(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from pivot_hpc.cli.main import main

    for source in ("live", "sim"):
        assert main(["plan", str(path), "--json", "--source", source]) == 0
        out = json.loads(capsys.readouterr().out)
        assert (out["source"], out["gpu"], out["fits"]) == (source, "h20", True)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_simulator_reading(path: Path) -> None:
    from pivot_hpc.job.sim_settings import sim_settings
    from pivot_hpc.job.simulate import build

    cfg = load_config(path, ["loop.steps=1"], files=False)  # no model or data files here
    policy_tp, _genrm_tp, gpus, _train, policy, genrm = TABLE[path.name.split("-")[0]]
    s = sim_settings(cfg)
    assert s.hardware == cfg.cluster.gpu == "h20"
    assert dict(s.models) == {"rollout": policy, "reward": genrm}
    assert s.training_tp == cfg.rl.trainer.tp == policy_tp
    assert (s.workload.response_cap, s.workload.judgement_cap) == CAPS[1:]
    assert s.terms.activation_recompute and s.terms.recompute_old_logprobs
    assert dict(s.max_running) == {"rollout": 256, "reward": 256}
    coord, cluster, meta = build(cfg)  # the simulated deployment, not run
    assert cluster.inference["rollout"].model is coord.topology.roles["rollout"].model
    assert coord.topology.num_gpus == gpus and meta["gpus"] == gpus
    assert coord.topology.training_tp == policy_tp
    assert meta["hardware"] == "H20"


# (old key, a value, the new key, what it reads as there)
OLD_KEYS = [
    ("sim.hardware", "h100", "cluster.gpu", "h100"),
    ("sim.policy_model", "qwen2.5-7b", "models.policy_catalog", "qwen2.5-7b"),
    ("sim.reward_model", "glm-z1-9b", "models.genrm_catalog", "glm-z1-9b"),
    ("sim.training_tp", 1, "rl.trainer.tp", 1),
    ("sim.recompute_old_logprobs", True, "rl.grpo.recompute_old_logprobs", True),
    ("sim.activation_recompute", True, "rl.trainer.recompute", "full"),
    ("sim.max_running_requests", 7, "engines.reward.max_batch", 7),
    ("sim.workload.response_cap", 50, "rl.max_response_tokens", 50),
    ("sim.workload.judgement_cap", 60, "rl.reward.genrm_max_tokens", 60),
]


def _get(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def test_every_moved_key_is_listed() -> None:
    moved = {f"sim.{k}" for k in SimConfig.MOVED_KEYS} | {
        f"sim.workload.{k}" for k in WorkloadConfig.MOVED_KEYS
    }
    profiles = {"sim.rollout_profile", "sim.reward_profile"}  # (need a file: below)
    assert moved - profiles == {k for k, *_ in OLD_KEYS}


@pytest.mark.parametrize("key,value,new,reads", OLD_KEYS, ids=[k for k, *_ in OLD_KEYS])
def test_an_old_sim_key_is_a_deprecated_alias_of_its_new_key(
    key: str, value, new: str, reads, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # as an override ...
    assert _get(load_config(None, [f"{key}={value}"]), new) == reads
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"'{key}' is deprecated: read as {new.split('.')[0]}" in err[0]
    # ... and in a file, also in a run directory's saved config
    *parents, last = key.split(".")
    text = "".join(f"{'  ' * i}{p}:\n" for i, p in enumerate(parents))
    f = tmp_path / "old.yaml"
    f.write_text(text + f"{'  ' * len(parents)}{last}: {str(value).lower()}\n")
    assert _get(load_config(f), new) == reads
    assert "deprecated" in capsys.readouterr().err


def test_an_old_profile_key_reads_as_the_engine_profile(tmp_path: Path) -> None:
    prof = tmp_path / "p.yaml"
    prof.write_text("throughput: {A: 2.0e-7, B: 8.0e-3, C: 3.0e-4, D: 1.0e-3}\n")
    cfg = load_config(None, [f"sim.rollout_profile={prof}"])
    assert cfg.engines.rollout.throughput_profile == prof


def test_an_old_key_and_its_new_key_that_disagree_is_one_line(tmp_path: Path) -> None:
    f = tmp_path / "both.yaml"
    f.write_text("cluster: {gpu: h20}\nsim: {hardware: h100}\n")
    with pytest.raises(ConfigError) as info:
        load_config(f)
    msg = str(info.value)
    assert "\n" not in msg and "'sim.hardware'" in msg and "'cluster.gpu'" in msg
    assert len(msg) < 2 * MAX_SHOWN_CHARS
    # an override of the new key wins over a file's old one
    g = tmp_path / "old.yaml"
    g.write_text("sim: {hardware: h100}\n")
    assert load_config(g, ["cluster.gpu=h20"]).cluster.gpu == "h20"


def test_trainer_dtype_parses_and_resolves() -> None:
    assert load_config(None, ["rl.trainer.dtype=fp32"]).rl.trainer.dtype == "fp32"
    with pytest.raises(ConfigError, match="rl.trainer.dtype"):
        load_config(None, ["rl.trainer.dtype=fp16"])
    auto = TrainerConfig()
    assert auto.dtype == "auto"
    assert auto.resolved_dtype(cuda=True) == "bf16"
    assert auto.resolved_dtype(cuda=False) == "fp32"
    assert TrainerConfig(dtype="bf16").resolved_dtype(cuda=False) == "bf16"


def test_a_missing_model_directory_is_named(tmp_path: Path) -> None:
    overrides = [*_planted(tmp_path, CONFIGS[0]), f"models.policy_path={tmp_path}"]
    with pytest.raises(ConfigError, match="models.policy_path"):
        load_config(CONFIGS[0], overrides)


def test_a_directory_outside_the_catalog_is_named_for_the_simulator(tmp_path: Path) -> None:
    # live runs need no catalog name; the simulator says which key gives it one
    from pivot_hpc.job.sim_settings import sim_settings

    cfg = load_config(CONFIGS[0], ["models.policy_path=/models/Llama-3-8B"], files=False)
    with pytest.raises(ConfigError, match="models.policy_catalog.*Llama-3-8B"):
        sim_settings(cfg)
    cfg = load_config(
        CONFIGS[0],
        ["models.policy_path=/models/Llama-3-8B", "models.policy_catalog=qwen2.5-1.5b"],
        files=False,
    )
    assert cfg.models.policy_catalog == "qwen2.5-1.5b"
