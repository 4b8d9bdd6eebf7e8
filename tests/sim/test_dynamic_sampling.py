"""DAPO dynamic sampling in every mode: uninformative groups leave the batch, fresh prompts
take their place, every step still trains a full batch exactly once within the staleness
bound, and a checkpoint keeps the over-sampled groups in flight."""

from __future__ import annotations

from collections import defaultdict

import pytest

from pivot_hpc.checkpoint import codec
from pivot_hpc.coordinator.hooks import Hooks
from pivot_hpc.coordinator.rl_state import Sample
from pivot_hpc.job import build as builder
from pivot_hpc.job.sim_backend import SimBackend
from pivot_hpc.job.simulate import build
from pivot_hpc.runtime.checkpoint_records import allow_payload
from pivot_hpc.sim.workload import SimPayload
from tests.sim.test_simulator import MODES, tiny
from tests.sim.trained import run_collecting

DS = ["rl.grpo.dynamic_sampling=true"]
codec.register(Sample, SimPayload)
allow_payload(SimPayload)  # this module checkpoints simulated samples


def groups_of(batch):
    out = defaultdict(list)
    for s in batch:
        out[s.prompt_index].append(s.reward)
    return out


@pytest.mark.parametrize(("mode", "strategy"), MODES[:4])
def test_only_informative_groups_are_trained_and_nothing_is_lost(mode: str, strategy: str) -> None:
    coord, _cluster, _ = build(tiny(mode, f"planner.strategy={strategy}", *DS))
    seen_ids: set[int] = set()
    trained = run_collecting(coord)
    rl = coord.rl
    assert rl.version == 3 and len(trained) == 3
    assert sum(rl.filtered.values()) > 0  # the synthetic workload has all-equal groups
    for batch in trained:
        assert len(batch) == 12 * 4  # a full batch every step
        for rewards in groups_of(batch).values():
            assert len(rewards) == 4 and max(rewards) > min(rewards)  # informative only
        ids = {s.sample_id for s in batch}
        assert not ids & seen_ids  # each sample trained once
        seen_ids |= ids
    # every sample made was trained or filtered out; none in flight or queued
    filtered_samples = 4 * sum(rl.filtered.values())
    assert rl.next_sample_id == len(seen_ids) + filtered_samples
    assert not rl.batches and not coord.samples
    for role in ("rollout", "reward"):
        assert coord.schedulers[role].n_seq == 0
    assert max(coord.stats.staleness) <= (0 if mode == "colocated" else 2)


def test_the_replacement_limit_trains_with_what_it_has() -> None:
    cfg = tiny("disaggregated", *DS, "rl.grpo.dynamic_sampling_max_batches=1")
    cfg.sim.workload.accuracy_start = cfg.sim.workload.accuracy_end = 0.0  # no signal at all
    cfg.rl.reward.genrm_weight = 0.0
    coord, _cluster, _ = build(cfg)
    coord.rewarder = lambda s, result: (0.0, 0.0)
    coord.run()
    assert coord.rl.version == 3
    assert coord.rl.filtered == {0: 12, 1: 12, 2: 12}  # 1 batch of replacements per step


def test_a_checkpoint_keeps_the_oversampled_groups_in_flight() -> None:
    saved = {}

    class SaveAfterFirstStep(Hooks):
        def on_step(self, coord, step, m):
            if step == 0:
                # through the checkpoint codec, as a live checkpoint stores it
                saved.update(codec.loads(codec.dumps(coord.rl.state()), "rl_state.json"))

    job = builder.build(tiny("pivot", *DS, "loop.steps=2"), SimBackend(hooks=SaveAfterFirstStep()))
    job.run()
    state = saved
    assert state["resampled"] and sum(state["filtered"].values()) >= 1
    in_flight = [s for b in state["batches"].values() for s in b]
    assert all(s.step >= 1 for s in in_flight)  # batch 1 and on, replacements included
    coord2, _c, _ = build(tiny("pivot", *DS, "loop.steps=2"))
    coord2.rl.restore(state)
    assert coord2.rl.filtered == state["filtered"]
