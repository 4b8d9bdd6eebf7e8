"""Model directories checked for their roles before a launch (models/role_check.py): one
line naming the config key, the directory and the fix, exit 2 from `pivot-hpc`; the
directories every role can use pass."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pivot_hpc.errors import ConfigError
from pivot_hpc.job.config import load_config
from pivot_hpc.models.role_check import check_model_dirs


def _cfg(*overrides: str):
    return load_config("configs/tiny.yaml", list(overrides))


@pytest.mark.parametrize("arch", ["qwen3", "llama3", "glm4", "qwen3-moe", "qwen2-tied"])
def test_every_genrm_architecture_passes_on_hf(arch_dirs, arch):
    check_model_dirs(_cfg(f"models.genrm_path={arch_dirs[arch]}"))


@pytest.mark.parametrize("arch", ["qwen2", "qwen2-tied", "qwen3", "llama3"])
def test_trainable_policies_pass(arch_dirs, arch):
    check_model_dirs(_cfg(f"models.policy_path={arch_dirs[arch]}"))


@pytest.mark.parametrize("arch", ["qwen3.5-moe", "qwen3.5-moe-vl"])
def test_a_hybrid_genrm_runs_on_hf(arch_dirs, arch):
    # Qwen3.5's Gated DeltaNet layers (engines/hf/linear_attention.py), as shipped too
    check_model_dirs(_cfg(f"models.genrm_path={arch_dirs[arch]}"))


def test_a_genrm_the_hf_engine_cannot_run_is_refused(arch_dirs, tmp_path):
    d = _sliding_window_dir(arch_dirs, tmp_path)
    with pytest.raises(ConfigError) as e:
        check_model_dirs(_cfg(f"models.genrm_path={d}"))
    msg = str(e.value)
    assert "models.genrm_path" in msg and str(d) in msg and "\n" not in msg
    assert "engines.reward.engine=hf" in msg and "sliding window" in msg
    assert "set engines.reward.engine to vllm or sglang" in msg


def _sliding_window_dir(arch_dirs, tmp_path) -> Path:
    """A Qwen2 that attends through a 64-token window (shorter than the tiny context)."""
    import json

    d = Path(shutil.copytree(arch_dirs["qwen2"], tmp_path / "windowed"))
    config = json.loads((d / "config.json").read_text())
    config.update(use_sliding_window=True, sliding_window=64, max_window_layers=0)
    (d / "config.json").write_text(json.dumps(config))
    return d


def test_untrainable_policy_is_refused(arch_dirs):
    with pytest.raises(ConfigError) as e:
        check_model_dirs(_cfg(f"models.policy_path={arch_dirs['qwen3-moe']}"))
    msg = str(e.value)
    assert "models.policy_path" in msg and "\n" not in msg
    assert "megatron cannot train Qwen3MoeForCausalLM (model_type 'qwen3_moe'" in msg
    assert "Qwen3 (dense), Llama 3" in msg and "serve this model as models.genrm_path" in msg


def test_tp_that_does_not_cut_the_model_is_refused(tmp_path):
    from pivot_hpc.recipes.tiny_arch_dirs import build_arch_dir

    # 6 heads: tp 4 cuts no whole heads (the tiny job's node has 4 GPUs)
    d = build_arch_dir("glm4", tmp_path / "m", num_attention_heads=6, num_key_value_heads=2)
    with pytest.raises(ConfigError, match=r"reward.tp=4 cannot cut Glm4ForCausalLM: .*tp among"):
        check_model_dirs(
            _cfg(f"models.genrm_path={d}", "reward.tp=4", "engines.reward.engine=sglang")
        )


def test_missing_tokenizer_is_refused(arch_dirs, tmp_path):
    d = Path(shutil.copytree(arch_dirs["qwen3"], tmp_path / "m"))
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (d / f).unlink(missing_ok=True)
    with pytest.raises(ConfigError, match=r"no tokenizer .*copy the model's tokenizer files"):
        check_model_dirs(_cfg(f"models.genrm_path={d}"))


def test_unreadable_dir_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ConfigError, match=r"models.genrm_path.*config.json"):
        check_model_dirs(_cfg(f"models.genrm_path={tmp_path}"))


def test_cli_exits_2_with_one_line(arch_dirs, tmp_path, capsys):
    from pivot_hpc.cli.main import main

    rc = main(
        [
            "run",
            "configs/tiny.yaml",
            "--run-dir",
            str(tmp_path / "run"),
            f"models.genrm_path={_sliding_window_dir(arch_dirs, tmp_path)}",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "sliding window" in err[0], err
