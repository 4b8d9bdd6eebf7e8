"""The simulated workload and engines: preemption when growing sequences fill the KV cache,
the running-request cap, the response/judgement length model, steady-state and bound."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pivot_hpc.coordinator.hooks import Hooks
from pivot_hpc.job import build as builder
from pivot_hpc.job.config import load_config
from pivot_hpc.job.sim_backend import SimBackend
from pivot_hpc.job.simulate import build, simulate
from pivot_hpc.sim.config import Workload
from pivot_hpc.sim.workload import SimWorkload
from pivot_hpc.telemetry.summary import steady_state, step_table, work_conserving_bound
from tests.sim.tokens import run_keeping_tokens

SMALL = [
    "cluster.nodes=1",
    "cluster.gpus_per_node=8",
    "rollout.tp=1",
    "reward.tp=1",
    "training.num_gpus=2",
    "loop.steps=2",
    "loop.batch_prompts=8",
    "loop.samples_per_prompt=4",
    "loop.monitor_interval_s=2.0",
    "planner.interval_s=2.0",
    "models.policy_catalog=qwen2.5-1.5b",
    "models.genrm_catalog=glm-z1-9b",
    "rl.trainer.recompute=full",
    "sim.workload.prompt_len_max=400",
    "sim.workload.response_median=1500",
    "rl.max_response_tokens=3000",
    "sim.workload.judgement_base=200",
    "sim.workload.judgement_per_response_token=0.0",
    "rl.reward.genrm_max_tokens=400",
]


def _profile(tmp_path: Path, kv: int) -> str:
    """A `pivot-hpc profile`-style file: the 1.5B model's costs with a tiny KV cache."""
    p = tmp_path / "small-kv.yaml"
    p.write_text(
        f"throughput: {{A: 1.0e-7, B: 2.0e-3, C: 1.0e-4, D: 1.0e-3}}\nkv_capacity_tokens: {kv}\n",
        encoding="utf-8",
    )
    return str(p)


@pytest.mark.parametrize("mode", ["disaggregated", "pivot"])
def test_kv_preemption_under_growing_sequences_loses_no_tokens(tmp_path: Path, mode: str) -> None:
    profile = f"engines.rollout.throughput_profile={_profile(tmp_path, 6000)}"
    cfg = load_config(None, [*SMALL, f"deployment.mode={mode}", profile])
    coord, cluster, _ = build(cfg)
    assert cluster.inference["rollout"].kv_capacity_tokens == 6000
    finished = run_keeping_tokens(coord)
    assert cluster.preempted > 0, "the workload outgrows a 6000-token cache: it must retract"
    assert len(finished) == 2 * 2 * 8 * 4  # both roles, every sample, exactly once
    assert coord.rl.version == 2 and not coord.samples
    for role in ("rollout", "reward"):
        coord.schedulers[role].check_invariants()


def test_running_request_cap_is_respected() -> None:
    cap = ["engines.rollout.max_batch=3", "engines.reward.max_batch=3"]
    cfg = load_config(None, [*SMALL, "deployment.mode=disaggregated", *cap])
    coord, _cluster, _ = build(cfg)
    seen = []
    orig = coord.dispatch

    def spy(role: str) -> None:
        orig(role)
        for v in coord.schedulers[role].replica_views():
            seen.append(v.n_seq)
            assert v.n_seq <= 3

    coord.dispatch = spy
    coord.run()
    assert max(seen) == 3


def test_judgement_length_grows_with_the_response_and_responses_grow_by_step() -> None:
    cfg = Workload(
        response_median=1000,
        response_sigma=0.8,
        response_cap=15000,
        response_growth_per_step=0.05,
        judgement_base=500,
        judgement_per_response_token=1.0,
        judgement_sigma=0.3,
        judgement_cap=20000,
    )
    w = SimWorkload(cfg, seed=0)
    early = [w.make(i, 0, i // 8, i % 8).payload for i in range(4000)]
    late = [w.make(i, 20, i // 8, i % 8).payload for i in range(4000, 8000)]
    r = np.array([p.response_len for p in early])
    j = np.array([p.judgement_len for p in early])
    assert np.corrcoef(np.log(r), np.log(j))[0, 1] > 0.5
    assert np.median(r) == pytest.approx(1000, rel=0.1)
    assert np.median([p.response_len for p in late]) == pytest.approx(2000, rel=0.1)
    short, long_ = j[r < 500], j[r > 3000]
    assert np.median(long_) > 3 * np.median(short)


def test_steady_state_window_on_a_hand_built_trace() -> None:
    # staleness 2: steps 0-2 fill the pipeline; the window is end(step 2) -> end(step 4)
    rows = [
        (0, 0.0, 100.0, 1000, 500, 900),
        (1, 0.0, 150.0, 1000, 500, 900),
        (2, 10.0, 200.0, 1000, 500, 900),
        (4, 60.0, 300.0, 3000, 1000, 900),  # logged out of order
        (3, 50.0, 260.0, 2000, 1000, 900),
    ]
    steps = step_table(rows)
    # rows without made tokens: the tokens of the steps that ended inside the window. At
    # staleness 0 it runs from the end of step 0 to the end of step 3 (5 - 0 - 2): step 4
    # is the drain; at staleness 2 five steps never run the pipeline full (7 needed)
    assert steady_state(steps, 0) == pytest.approx((1500 + 1500 + 3000) / (260 - 100))
    assert steady_state(steps, 2) is None
    attrs = {
        "bound_rollout_per_gpu": 100.0,
        "bound_reward_per_gpu": 50.0,
        "bound_train_gpu_s_per_token": 0.01,
    }
    ro, rm, tr = 8000, 3500, 4500
    gpu_s = ro / 100 + rm / 50 + tr * 0.01
    assert work_conserving_bound(steps, attrs.get, 4) == pytest.approx((ro + rm) / (gpu_s / 4))
    assert work_conserving_bound(steps, {}.get, 4) is None


def test_simulate_reports_steady_and_bound_for_every_mode() -> None:
    for mode in ("colocated", "disaggregated", "rr_colocated", "pivot"):
        s = simulate(load_config(None, [*SMALL, f"deployment.mode={mode}", "loop.steps=4"]), None)
        bound = s["tokens_per_s_bound"]
        assert s["tokens_per_s"] > 0 and bound and s["tokens_per_s"] <= bound, (mode, s)
        made = s["tokens_per_s_steady_made"]
        assert made is None or 0 <= made <= bound, (mode, s)
        assert s["tokens_per_s_steady"] is not None or mode != "colocated"
        # the steady rate counts only work made inside its window (issue 39)
        assert s["tokens_per_s_steady"] is None or s["tokens_per_s_steady"] <= bound, (mode, s)
        assert s["tokens_per_s"] <= s["tokens_per_s_critical_path"], (mode, s)


def test_no_mode_passes_the_critical_path_where_it_binds() -> None:
    # Few long samples on many GPUs: the work would take a fraction of the time each
    # step's longest sample needs alone, so the critical path is the lower bound, and
    # every mode stays below it.
    latency_bound = [
        *SMALL,
        "loop.batch_prompts=2",
        "loop.steps=6",
        "sim.workload.response_sigma=1.2",
        "rl.max_response_tokens=12000",
    ]
    for mode in ("colocated", "disaggregated", "rr_colocated", "pivot"):
        s = simulate(load_config(None, [*latency_bound, f"deployment.mode={mode}"]), None)
        assert s["tokens_per_s_critical_path"] < s["tokens_per_s_bound"], (mode, s)
        assert 0 < s["tokens_per_s"] <= s["tokens_per_s_critical_path"], (mode, s)


GROUP4 = Path(__file__).resolve().parents[2] / "configs/groups/group4-qwen72b-qwen122b.yaml"


@pytest.mark.slow  # a scale test (13 s on 2 cores)
def test_4096_gpus_start_shift_and_stop_in_a_few_simulated_seconds() -> None:
    """Group 4 scaled to 4096 GPUs: the whole brain runs at that scale (the full timing is
    `pivot-hpc bench sim --gpus 4096 --steps 2`)."""
    from pivot_hpc.job.simulate import scale_to

    cfg = load_config(str(GROUP4), ["deployment.mode=pivot", "loop.steps=2"], files=False)
    cfg = scale_to(cfg, 4096)

    class StopAt30s(Hooks):
        def before_run(self, coord):
            self.cluster = coord.cluster

        def stop_requested(self):
            return self.cluster.now() > 30.0

    job = builder.build(cfg, SimBackend(hooks=StopAt30s()))
    coord, cluster = job.coordinator, job.cluster
    job.run()
    assert coord.stopped and cluster.now() > 30.0
    assert coord.topology.num_gpus == 4096
    a = coord.allocation()  # every GPU serves or shifts between inference roles (§8.3)
    assert a["rollout"] + a["reward"] + a["transition"] == 4096 and a["rollout"] > 0
    assert coord.schedulers["rollout"].n_running > 0
    coord.schedulers["rollout"].check_invariants()


@pytest.mark.slow
def test_bench_sim_json_keys() -> None:
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "pivot_hpc", "bench", "sim", *"--gpus 64 --steps 1 --json".split()],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    r = json.loads(out.stdout)
    assert {"gpus", "steps", "wall_s", "events"} <= set(r)
    assert r["gpus"] == 64 and r["steps"] == 1 and r["events"] > 0


def test_a_model_outside_the_catalog_runs_from_its_profile(tmp_path: Path) -> None:
    prof = tmp_path / "my-model.yaml"
    prof.write_text(
        "throughput: {A: 2.0e-7, B: 8.0e-3, C: 3.0e-4, D: 1.0e-3}\n"
        "kv_capacity_tokens: 500000\n"
        "model: {params: 8.0e9, layers: 32, hidden: 4096, heads: 32, kv_heads: 8, head_dim: 128}\n",
        encoding="utf-8",
    )
    extra = [
        "models.policy_catalog=my-8b",
        f"engines.rollout.throughput_profile={prof}",
        "deployment.mode=pivot",
    ]
    s = simulate(load_config(None, [*SMALL, *extra]), None)
    assert s["steps"] == 2 and s["tokens"] > 0
    _coord, cluster, _ = build(load_config(None, [*SMALL, *extra]))
    assert cluster.inference["rollout"].model.A == 2.0e-7
    assert cluster.inference["rollout"].kv_capacity_tokens == 500000
    assert cluster.inference["rollout"].sources["A"] == f"profile: {prof}"


def test_a_model_outside_the_catalog_without_profile_is_one_clear_error(tmp_path: Path) -> None:
    from pivot_hpc.config.loader import ConfigError
    from pivot_hpc.sim.catalog import CatalogError

    # (the simulator's reading of the config says so, before anything runs; the live
    # runtime reads the model directory instead)
    with pytest.raises(ConfigError, match="models.policy_catalog.*pivot-hpc profile"):
        build(load_config(None, [*SMALL, "models.policy_catalog=my-8b"]))
    prof = tmp_path / "p.yaml"
    prof.write_text("throughput: {A: 2.0e-7, B: 8.0e-3, C: 3.0e-4, D: 1.0e-3}\n")
    with pytest.raises(CatalogError, match="needs a `model:` section"):
        extra = ["models.policy_catalog=my-8b", f"engines.rollout.throughput_profile={prof}"]
        build(load_config(None, [*SMALL, *extra]))


def _catalog_1p5b():
    from pivot_hpc.sim.catalog import HARDWARE, MODELS, inference_costs

    return inference_costs(MODELS["qwen2.5-1.5b"], HARDWARE["h20"], 1)


THROUGHPUT = "throughput: {A: 1.0e-7, B: 2.0e-3, C: 1.0e-4, D: 1.0e-3}\n"


@pytest.mark.parametrize(("text", "value"), [("3.0e-6", 3.0e-6), ("1e-6", 1.0e-6), ("0", 0.0)])
def test_from_profile_uses_the_profiles_measured_prefill(
    tmp_path: Path, text: str, value: float
) -> None:
    from pivot_hpc.sim.catalog import from_profile

    prof = tmp_path / "p.yaml"  # (a bare 1e-6 is a string to YAML 1.1: read as a number)
    prof.write_text(THROUGHPUT + f"prefill_s_per_token: {text}\n", encoding="utf-8")
    catalog = _catalog_1p5b()
    assert catalog.prefill_s_per_token > 0
    costs = from_profile(catalog, prof)
    assert costs.prefill_s_per_token == value  # one engine's slope, as measured: not rescaled
    assert costs.sources["prefill_s_per_token"] == f"profile: {prof}"
    assert costs.sources["A"] == f"profile: {prof}"


@pytest.mark.parametrize("line", ["", "prefill_s_per_token: null\n", "prefill_s_per_token:\n"])
def test_from_profile_without_a_prefill_keeps_the_catalogs(tmp_path: Path, line: str) -> None:
    from pivot_hpc.sim.catalog import from_profile

    prof = tmp_path / "old.yaml"  # a profile from before the prefill measurement
    prof.write_text(THROUGHPUT + line, encoding="utf-8")
    catalog = _catalog_1p5b()
    costs = from_profile(catalog, prof)
    assert costs.prefill_s_per_token == catalog.prefill_s_per_token
    assert "profile" not in costs.sources.get("prefill_s_per_token", "")
    assert costs.sources["A"] == f"profile: {prof}"


@pytest.mark.parametrize("text", ["-3.0e-6", ".nan", ".inf", "1e999", "true", "fast", "[1]"])
def test_from_profile_refuses_a_bad_prefill_in_one_line(tmp_path: Path, text: str) -> None:
    from pivot_hpc.sim.catalog import CatalogError, from_profile

    prof = tmp_path / "bad.yaml"
    prof.write_text(THROUGHPUT + f"prefill_s_per_token: {text}\n", encoding="utf-8")
    with pytest.raises(CatalogError) as info:
        from_profile(_catalog_1p5b(), prof)
    msg = str(info.value)
    assert "\n" not in msg
    assert str(prof) in msg and "prefill_s_per_token" in msg and "finite number >= 0" in msg


def test_a_profiles_prefill_reaches_the_simulated_engine(tmp_path: Path) -> None:
    prof = tmp_path / "p.yaml"
    prof.write_text(THROUGHPUT + "prefill_s_per_token: 4.0e-6\n", encoding="utf-8")
    cfg = load_config(None, [*SMALL, f"engines.rollout.throughput_profile={prof}"])
    _coord, cluster, _ = build(cfg)
    assert cluster.inference["rollout"].prefill_s_per_token == 4.0e-6
    assert cluster.inference["rollout"].sources["prefill_s_per_token"] == f"profile: {prof}"
    assert "profile" not in cluster.inference["reward"].sources.get("prefill_s_per_token", "")


def test_a_training_step_longer_than_the_stall_limit_is_not_a_stall() -> None:
    import dataclasses

    coord, cluster, _ = build(load_config(None, [*SMALL, "deployment.mode=disaggregated"]))
    cluster.training = dataclasses.replace(cluster.training, publish_s=2 * coord.stall_s)
    coord.run()  # each step trains for two hours of simulated time
    assert coord.rl.version == 2 and cluster.now() > 4 * coord.stall_s
