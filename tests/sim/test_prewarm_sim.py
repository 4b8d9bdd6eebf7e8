"""pivot+ pre-warms training on a latency-bound workload (planner/prewarm.py): whole
simulated runs, with and without elastic training; the paper's pivot never does."""

from __future__ import annotations

import pytest

from pivot_hpc.job.config import load_config
from pivot_hpc.job.simulate import simulate
from tests.sim.test_sim_workload import SMALL

# Few samples with long-tailed lengths on 8 GPUs: each batch ends in a tail of a few
# judgements while most replicas idle, training's GPUs among them.
TAIL = [
    *SMALL,
    "loop.batch_prompts=4",
    "loop.steps=6",
    "sim.workload.response_sigma=1.2",
    "rl.max_response_tokens=12000",
    "deployment.mode=pivot",
    # H200 costs: under the H20's recalibration (2026-12-03: faster decode attention, a
    # higher training MFU) this small batch no longer has a tail worth pre-warming in;
    # the H200's costs keep the latency-bound tail this test is about
    "cluster.gpu=h200",
]


@pytest.mark.parametrize("elastic", [False, True])
def test_pivot_plus_prewarms_training_in_a_batchs_tail(elastic: bool) -> None:
    runs = {
        strategy: simulate(
            load_config(
                None,
                [*TAIL, f"planner.strategy={strategy}", f"planner.elastic_training={elastic}"],
            ),
            None,
            progress=False,
        )
        for strategy in ("pivot", "pivot+")
    }
    assert runs["pivot"]["training_prewarms"] == 0
    plus = runs["pivot+"]
    assert plus["training_prewarms"] > 0, plus
    # every step trained within the staleness bound (the coordinator checks each sample)
    assert plus["staleness_max"] <= 2 and plus["tokens_per_s"] > 0
