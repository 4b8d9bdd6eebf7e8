"""The profile's prefill cost: the fit, the YAML key `prefill_s_per_token` (absent in older
profiles: not measured) and the live costs the planner gets from it."""

from __future__ import annotations

import pytest
import yaml

from pivot_hpc.config.loader import ConfigError
from pivot_hpc.engines.profile import (
    PrefillSample,
    Sample,
    apply_profiles,
    fit_prefill,
    fit_samples,
    load_profile,
    write_profile,
)
from pivot_hpc.job.build import configured_costs, configured_topology
from pivot_hpc.job.config import load_config

OLD_PROFILE = {  # what `pivot-hpc profile` wrote before it measured prefill
    "engine": "hf",
    "model": "random",
    "role": "reward",
    "throughput": {"A": 2e-8, "B": 3e-3, "C": 1e-4, "D": 5e-4},
    "fit": {"r2": 0.99},
    "samples": [],
}


def test_fit_prefill_recovers_slope_and_intercept_exactly():
    s, c = 2.5e-6, 4e-4
    pts = [PrefillSample(s * b * n + c, b, n) for b in (1, 4, 8) for n in (16, 64, 256)]
    fit = fit_prefill(pts)
    assert fit.s_per_token == pytest.approx(s, rel=1e-9)
    assert fit.intercept_s == pytest.approx(c, rel=1e-9)
    assert fit.r2 == pytest.approx(1.0) and fit.samples == 9


def test_fit_prefill_goes_through_the_origin_rather_than_a_negative_intercept():
    s = 1e-6
    pts = [PrefillSample(s * n - 1e-4 * (n > 100), 1, n) for n in (32, 64, 128, 512)]
    fit = fit_prefill(pts)
    assert fit.intercept_s == 0.0 and fit.s_per_token > 0
    exact = fit_prefill([PrefillSample(s * n, 2, n) for n in (10, 20)])
    assert exact.s_per_token == pytest.approx(s / 2) and exact.intercept_s == pytest.approx(0)


def _samples() -> list[Sample]:
    return [
        Sample(2e-8 * t + max(3e-3, 1e-4 * b) + 5e-4, b, t, (i % 4) == 3)
        for i, (b, t) in enumerate((b, b * c) for b in (1, 8, 32, 64) for c in (16, 128, 384))
    ]


def test_profile_yaml_carries_prefill_and_loads_it(tmp_path):
    pre = [PrefillSample(3e-6 * b * n + 1e-4, b, n) for b in (1, 4) for n in (16, 128)]
    path = write_profile(
        tmp_path / "p.yaml", fit_samples(_samples(), pre), engine="hf", model="m", role="reward"
    )
    doc = yaml.safe_load(path.read_text())
    assert {"engine", "model", "role", "throughput", "fit", "samples"} <= doc.keys()
    assert set(doc["throughput"]) == {"A", "B", "C", "D"}  # the old contract, unchanged
    assert doc["prefill_s_per_token"] == pytest.approx(3e-6)
    assert doc["prefill_fit"]["intercept_s"] == pytest.approx(1e-4)
    assert len(doc["prefill_samples"]) == 4
    assert load_profile(path).prefill_s_per_token == pytest.approx(3e-6)
    # without prefill samples: no key (not measured)
    bare = write_profile(
        tmp_path / "q.yaml", fit_samples(_samples()), engine="hf", model="m", role="reward"
    )
    assert "prefill_s_per_token" not in yaml.safe_load(bare.read_text())
    assert load_profile(bare).prefill_s_per_token is None


def test_an_old_profile_without_prefill_loads_as_not_measured(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(OLD_PROFILE))
    tc = load_profile(path)
    assert (tc.A, tc.B, tc.C, tc.D) == (2e-8, 3e-3, 1e-4, 5e-4)
    assert tc.prefill_s_per_token is None
    cfg = apply_profiles(load_config(None, [f"engines.reward.throughput_profile={path}"]))
    assert configured_costs(cfg).prefill_s_per_token is None  # as before: free to plan


@pytest.mark.parametrize("bad", [-1.0, "x", True, float("inf")])
def test_a_bad_prefill_value_is_refused(tmp_path, bad):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({**OLD_PROFILE, "prefill_s_per_token": bad}))
    with pytest.raises((ConfigError, ValueError)):
        load_profile(path)


def test_configured_costs_take_prefill_from_the_loaded_profile(tmp_path):
    path = tmp_path / "genrm.yaml"
    path.write_text(yaml.safe_dump({**OLD_PROFILE, "prefill_s_per_token": 4e-6}))
    cfg = apply_profiles(load_config(None, [f"engines.reward.throughput_profile={path}"]))
    costs = configured_costs(cfg)
    assert costs.prefill_s_per_token == {"reward": 4e-6}  # rollout: not measured
    topo = configured_topology(cfg)
    assert topo.roles["reward"].prefill_s_per_token == 4e-6
    assert topo.roles["rollout"].prefill_s_per_token == 0.0
    # the config key too (a profile's value can be copied into it)
    cfg = load_config(None, ["rollout.throughput.prefill_s_per_token=1e-6"])
    assert configured_costs(cfg).prefill_s_per_token == {"rollout": 1e-6}
