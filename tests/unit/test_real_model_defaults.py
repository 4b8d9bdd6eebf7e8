"""The schema's defaults are the tiny job's: a config that names a model directory of its
own sets the lengths and KV sizes a real run needs, or is refused in one line naming the
key (issue 46: a real model's responses were cut at 64 tokens without a word)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pivot_hpc.config import ConfigError
from pivot_hpc.job.config import TINY_DEFAULTS, load_config

REPO = Path(__file__).resolve().parents[2]
REAL = [
    "rl.max_response_tokens=8192",
    "rl.reward.genrm_max_tokens=4096",
    "rollout.kv_capacity_tokens=400000",
    "reward.kv_capacity_tokens=400000",
]


@pytest.mark.parametrize("missing", sorted(TINY_DEFAULTS))
@pytest.mark.parametrize("model", ["policy_path", "genrm_path"])
def test_a_real_model_without_its_lengths_is_one_line(missing: str, model: str) -> None:
    given = [o for o in REAL if not o.startswith(missing + "=")]
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"models.{model}=/models/mine", *given], files=False)
    msg = str(err.value)
    assert "\n" not in msg and missing in msg and f"models.{model}" in msg, msg


def test_with_them_set_it_loads_and_the_tiny_job_needs_none() -> None:
    cfg = load_config(None, ["models.policy_path=/models/mine", *REAL], files=False)
    assert cfg.rl.max_response_tokens == 8192
    assert load_config(None).rl.max_response_tokens == 64  # the embedded default
    tiny = str(REPO / "configs/tiny.yaml")
    assert load_config(tiny, ["models.policy_path=/models/mine"], files=False)
