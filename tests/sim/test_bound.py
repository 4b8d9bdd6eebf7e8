"""The work-conserving bound's rates (job/sim_bound.py): the run's own samples, and never
less time than the simulated engine spends on them."""

from __future__ import annotations

import numpy as np
import pytest

from pivot_hpc.coordinator.rl_state import Sample
from pivot_hpc.job import build as builder
from pivot_hpc.job.config import load_config
from pivot_hpc.job.sim_bound import drawn_lengths, inference_gpu_s, solo_seconds
from pivot_hpc.job.sim_settings import sim_settings
from pivot_hpc.job.simulate import build, simulate
from pivot_hpc.sim.catalog import (
    HARDWARE,
    MODELS,
    InferenceCosts,
    inference_costs,
    with_max_running,
)
from pivot_hpc.sim.cluster import SimCluster
from pivot_hpc.sim.workload import SimPayload, SimWorkload
from pivot_hpc.telemetry.summary import steady_work_share, step_table, work_conserving_bound
from tests.sim.test_sim_workload import SMALL


class _Recorder(SimWorkload):
    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        self.made: list[tuple[int, int, int]] = []

    def make(self, sample_id: int, step: int, prompt_index: int, group: int) -> Sample:
        s = super().make(sample_id, step, prompt_index, group)
        self.made.append((s.prompt_len, s.payload.response_len, s.payload.judgement_len))
        return s


def test_drawn_lengths_are_the_samples_the_run_releases() -> None:
    cfg = load_config(None, [*SMALL, "loop.steps=3", "sim.seed=7"])
    source = _Recorder(sim_settings(cfg).workload, cfg.sim.seed)
    rl = builder.rl_state(cfg, source)
    rl.staleness = cfg.loop.steps  # release every batch without training
    for _ in range(cfg.loop.steps):
        rl.release()
    prompt, response, judgement = drawn_lengths(cfg)
    assert np.array(source.made).T.tolist() == [
        prompt.tolist(),
        response.tolist(),
        judgement.tolist(),
    ]


def _one_replica_seconds(costs: InferenceCosts, lengths: list[tuple[int, int]]) -> float:
    sim = SimCluster(inference={"rollout": costs, "reward": costs}, training=None)
    sim.shift_up("rollout:0", 0)
    (up,) = sim.poll(1e9)
    for i, (prompt, response) in enumerate(lengths):
        payload = SimPayload(response_len=response, judgement_len=1, correct=True, genrm_score=1)
        sim.start("rollout:0", Sample(i, 0, i, 0, prompt_len=prompt, payload=payload), "rollout")
    last, finished = up.t, 0
    while finished < len(lengths):
        for done in sim.poll(1e9):
            finished, last = finished + 1, done.t
    return last - up.t


@pytest.mark.parametrize("n", [1, 8, 64])
def test_the_bound_is_exact_at_the_engines_full_batch_and_below_any_other(n: int) -> None:
    costs = inference_costs(MODELS["qwen2.5-1.5b"], HARDWARE["h20"], 1)
    prompt = np.full(n, 500.0)
    response = np.full(n, 2000.0)
    rows = list(zip(prompt.astype(int).tolist(), response.astype(int).tolist(), strict=True))
    # Capped at n running sequences, n is the engine's largest batch: the bound is what it takes.
    capped = with_max_running(costs, n)
    assert _one_replica_seconds(capped, rows) == pytest.approx(
        inference_gpu_s(capped, 1, prompt, response), rel=1e-6
    )
    # Uncapped, a larger batch would be cheaper per token: the run takes longer than the bound.
    assert _one_replica_seconds(costs, rows) > inference_gpu_s(costs, 1, prompt, response)
    # Mixed lengths decode partly in smaller batches as the short ones finish.
    mixed = np.linspace(100, 4000, n) if n > 1 else response
    rows = list(zip(prompt.astype(int).tolist(), mixed.astype(int).tolist(), strict=True))
    assert _one_replica_seconds(capped, rows) >= inference_gpu_s(capped, 1, prompt, mixed) * (
        1 - 1e-9
    )


@pytest.mark.parametrize("model", ["qwen2.5-1.5b", "glm-z1-9b"])
def test_a_sample_alone_takes_exactly_its_solo_seconds_and_company_slows_it(model: str) -> None:
    costs = inference_costs(MODELS[model], HARDWARE["h20"], 1)
    (alone,) = solo_seconds(costs, np.array([700.0]), np.array([3000.0]))
    assert _one_replica_seconds(costs, [(700, 3000)]) == pytest.approx(alone, rel=1e-6)
    # With company each iteration is longer: the longest sample finishes later.
    assert _one_replica_seconds(costs, [(700, 3000), (700, 1000), (300, 200)]) > alone


def test_the_steady_window_counts_the_work_done_in_it() -> None:
    # Colocated steps do not overlap: the window from the end of step 0 to the end of step
    # N − 2 holds exactly the generation and the training of steps 1 … N − 2, so its work
    # is theirs at the bound's rates.
    cfg = load_config(None, [*SMALL, "deployment.mode=colocated", "loop.steps=4"])
    coord, _, meta = build(cfg)
    coord.run()
    steps = step_table(coord.stats.steps)
    share = steady_work_share(steps, meta["staleness"], meta.get, meta["gpus"])
    inside = steps[(steps["step"] >= 1) & (steps["step"] <= 2)]
    span = float(inside["end"].max() - steps["end"][steps["step"] == 0][0])
    tokens = float(inside["rollout_tokens"].sum() + inside["reward_tokens"].sum())
    gpus = meta["gpus"]
    gpu_s = tokens * gpus / work_conserving_bound(inside, meta.get, gpus)
    assert share == pytest.approx(gpu_s / (gpus * span), rel=1e-6)
    # Pipelined, it needs 2·staleness + 3 steps, and is a share of the GPU time (≤ 1),
    # also when training is the larger part of the work.
    training_bound = ["sim.workload.judgement_base=50", "training.num_gpus=1"]
    for mode in ("disaggregated", "rr_colocated", "pivot"):
        for extra in ([], training_bound):
            over = [*SMALL, f"deployment.mode={mode}", "loop.steps=7", *extra]
            s = simulate(load_config(None, over), None)
            assert 0 < s["steady_work_share"] <= 1, (mode, extra, s)
            assert s["tokens_per_s_steady_made"] == pytest.approx(
                s["steady_work_share"] * s["tokens_per_s_bound"]
            )
    short = simulate(load_config(None, [*SMALL, "deployment.mode=pivot", "loop.steps=6"]), None)
    assert short["steady_work_share"] is None and short["tokens_per_s_steady_made"] is None


def test_the_report_reads_the_same_work_share_from_the_telemetry(tmp_path) -> None:
    from pivot_hpc.telemetry import open_run
    from pivot_hpc.telemetry.summary import format_summary, summarise

    cfg = load_config(None, [*SMALL, "deployment.mode=pivot", "loop.steps=7"])
    s = simulate(cfg, tmp_path)
    report = summarise(open_run(tmp_path))
    assert s["steady_work_share"] is not None
    assert report["steady_work_share"] == pytest.approx(s["steady_work_share"], rel=1e-12)
    assert report["tokens_per_s_steady_made"] == pytest.approx(s["tokens_per_s_steady_made"])
    assert report["tokens_per_s_critical_path"] == s["tokens_per_s_critical_path"]
    assert "of GPU time at the bound's rates" in format_summary(report)
