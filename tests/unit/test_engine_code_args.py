"""Issue 49, finding 10: `engines.<role>.vllm_args` (and `server_args`) keys that make the
engine import or run code are refused at validation, one line naming the key; the keys
refused are listed in docs/guide/security.md (pivot_hpc/config/code_keys.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pivot_hpc.config import ConfigError
from pivot_hpc.config.code_keys import SGLANG_CODE_ARGS, VLLM_CODE_ARGS
from pivot_hpc.job.config import load_config

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")
VALUES = {"trust_remote_code": "true", "enable_custom_logit_processor": "true"}


@pytest.mark.parametrize("key", [*sorted(VLLM_CODE_ARGS), "my_loader_cls", "custom_plugin"])
@pytest.mark.parametrize("role", ["rollout", "reward"])
def test_vllm_args_that_name_code_are_refused(key: str, role: str) -> None:
    value = VALUES.get(key, "somepkg.module.Cls")
    with pytest.raises(ConfigError) as info:
        load_config(
            TINY, [f"engines.{role}.engine=vllm", f"engines.{role}.vllm_args.{key}={value}"]
        )
    msg = str(info.value)
    assert "\n" not in msg and f"'engines.{role}.vllm_args.{key}'" in msg, msg
    assert "may not name code" in msg and "remove the key" in msg, msg


@pytest.mark.parametrize("key", sorted(SGLANG_CODE_ARGS))
def test_sglang_server_args_that_name_code_are_refused(key: str) -> None:
    value = VALUES.get(key, "somepkg.module.fn")
    with pytest.raises(ConfigError, match=f"engines.rollout.server_args.{key}"):
        load_config(TINY, [f"engines.rollout.server_args.{key}={value}"])


def test_other_engine_args_and_code_switched_off_are_accepted() -> None:
    cfg = load_config(
        TINY,
        [
            "engines.rollout.engine=vllm",
            "engines.rollout.vllm_args.enable_prefix_caching=true",
            "engines.rollout.vllm_args.enforce_eager=false",
            "engines.rollout.vllm_args.trust_remote_code=false",
        ],
    )
    assert cfg.engines.rollout.vllm_args["enable_prefix_caching"] is True


@pytest.mark.slow  # a CLI process
def test_through_the_cli_it_is_exit_2_and_one_line() -> None:
    overrides = ["engines.rollout.engine=vllm", "engines.rollout.vllm_args.worker_cls=evil.W"]
    out = subprocess.run(
        [sys.executable, "-P", "-m", "pivot_hpc", "config", "show", TINY, *overrides],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    err = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(err) == 1 and "vllm_args.worker_cls" in err[0], out.stderr


def test_the_refused_keys_are_listed_in_the_security_docs() -> None:
    text = (REPO / "docs" / "guide" / "security.md").read_text()
    missing = [k for k in {**VLLM_CODE_ARGS, **SGLANG_CODE_ARGS} if f"`{k}`" not in text]
    assert not missing, f"docs/guide/security.md does not list {missing}"
