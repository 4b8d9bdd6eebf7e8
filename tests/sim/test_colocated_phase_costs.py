"""Colocated (veRL-style, paper §8.1 and App. E) pays for every phase change: at each stage
boundary every replica of the outgoing role shifts down and every replica of the incoming
role shifts up (a GPS read of the whole model per replica, queued on its node's host
link), and training reloads its parameters and optimizer state and offloads the optimizer
again. The investigation of colocated beating PivotRL in groups 3-4 after the second
calibration (docs/results/2026-12-03-sim-calibration.md) rests on these being charged;
this pins them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pivot_hpc.job import build as builder
from pivot_hpc.job.sim_backend import SimBackend
from pivot_hpc.telemetry import open_run
from tests.sim.test_simulator import tiny


def test_colocated_charges_every_role_shift_at_every_stage_boundary(tmp_path: Path) -> None:
    cfg = tiny("colocated")
    backend = SimBackend(out=tmp_path)
    job = builder.build(cfg, backend)
    job.run()
    run = open_run(tmp_path)
    shifts, steps = run["shifts"], run["steps"]
    n_gpus = cfg.cluster.total_gpus
    replicas = {r: n_gpus // getattr(cfg, r).tp for r in ("rollout", "reward")}
    ups = shifts[shifts["kind"] == "up"]
    downs = shifts[shifts["kind"] == "down"]
    n_steps = len(steps)
    # every step: every GPU rolls out, then judges, then trains (whole cluster each time)
    for role in ("rollout", "reward"):
        assert (ups["role"] == role).sum() == replicas[role] * n_steps
        assert (downs["role"] == role).sum() == replicas[role] * n_steps
    assert (ups["role"] == "training").sum() == n_steps
    assert (downs["role"] == "training").sum() == n_steps - 1  # the last step keeps it
    # each inference shift-up reads the whole model from GPS at least at the node rate
    # (more when it queues behind another read on its node) plus the engine start
    for role, costs in backend.inference.items():
        mine = ups[ups["role"] == role]
        alone = costs.shift_up_s
        assert (mine["read_s"] >= alone["read_s"] - 1e-9).all()
        assert np.allclose(mine["reload_s"], alone["reload_s"])
        per_node = cfg.cluster.gpus_per_node // costs.tp
        if per_node > 1:  # replicas sharing a node wait for its host link
            assert mine["read_s"].max() == pytest.approx(alone["read_s"] * per_node, rel=1e-6)
    # training: parameters and optimizer state in, the optimizer state out again
    t = backend.training
    tr_up = ups[ups["role"] == "training"]
    tr_down = downs[downs["role"] == "training"]
    assert np.allclose(tr_up["read_s"], t.shift_up_s["read_s"])
    assert np.allclose(tr_up["reload_s"], t.shift_up_s["reload_s"])
    assert np.allclose(tr_down["offload_s"], t.shift_down_s["offload_s"])
    # and the cluster spends that time in transition, not in a role
    alloc = run["allocation"]
    assert alloc["transition_gpus"].max() == n_gpus
