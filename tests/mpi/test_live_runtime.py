"""The live runtime: `pivot-hpc run` on a real local MPI world (5 ranks: host + 4 workers),
real hf engines, real megatron-core training, real GPS, HDF5 telemetry.

Conservation (every sample rolled out, rewarded and trained exactly once; no sequence
lost or duplicated across aborts and shifts) and the staleness bound are enforced inside
the coordinator, which aborts the run on any violation; these tests check that runs
complete, that the telemetry shows what happened, and that a failing worker brings the
world down quickly with its traceback.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from live import ROOT, run_command

from pivot_hpc.telemetry import open_run

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs OpenMPI (mpirun)")


def run(run_dir: Path, *overrides: str, env: dict | None = None, timeout: int = 420):
    return subprocess.run(
        run_command(run_dir, "loop.steps=3", "loop.batch_prompts=4", *overrides),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


# the RL recipe options, live (tests/unit/test_grpo_math.py shows their effect on a batch)
DAPO = [
    "rl.grpo.dynamic_sampling=true",
    "rl.grpo.mask_truncated=true",
    "rl.reward.overlong_buffer_len=16",
    "rl.grpo.loss_agg_mode=seq-mean-token-mean",
]
MISMATCH = [
    "rl.grpo.recompute_old_logprobs=true",
    "rl.grpo.rollout_is=mask",
    "rl.grpo.loss_agg_mode=seq-mean-token-sum-norm",
]


@pytest.mark.parametrize("mode", ["pivot", "disaggregated", "colocated", "rr_colocated"])
def test_every_mode_completes(tmp_path: Path, mode: str) -> None:
    # disaggregated also trains data-parallel: 2 training ranks (tp 1 × dp 2), and moves
    # sequences onto idle replicas (scheduler.rebalance; conservation is the coordinator's)
    extra = ["training.num_gpus=2", "scheduler.rebalance=true", *MISMATCH]
    extra = extra if mode == "disaggregated" else []
    if mode in ("colocated", "rr_colocated"):  # dynamic sampling sends them back to rollout
        extra = DAPO
    out = run(tmp_path, f"deployment.mode={mode}", *extra)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("step ") >= 3 and "pivot-hpc: done: 3 steps" in out.stdout
    r = open_run(tmp_path)
    steps = r["steps"]
    assert list(steps["step"]) == [0, 1, 2]
    assert (steps["samples"] == 16).all()  # 4 prompts × 4 samples, each trained once
    bound = 0 if mode == "colocated" else 2
    assert steps["staleness_max"].max() <= bound
    assert list(steps["version"]) == [1, 2, 3]
    shifts = r["shifts"]
    assert (shifts["kind"] == "up").any()
    if mode in ("pivot", "colocated"):
        # roles changed at run time: some replica went down and another came up later
        downs = shifts["t"][shifts["kind"] == "down"]
        assert len(downs) and (shifts["t"][shifts["kind"] == "up"] > downs.min()).any()
    if mode == "pivot":
        assert len(r["planner"]) > 0
        assert "τ_shift measured rollout" in out.stdout and "A–D refitted" in out.stdout
        # a GPU changing roles got its shift-up with its shift-down (ShiftExecutor._chainable)
        chained = re.search(r"\((\d+) chained after a shift-down\)", out.stdout)
        assert chained and int(chained.group(1)) > 0, out.stdout[-2000:]
    if mode == "disaggregated":
        assert "|Δlogp|=" in out.stdout and "masked=" in out.stdout
        assert (shifts["gpus"][shifts["role"] == "training"] == 2).all()
        assert (r["allocation"]["training_gpus"][-1:] == 2).all()
    if mode == "colocated":  # like the paper's veRL baseline (and the simulator): every GPU
        assert (shifts["gpus"][shifts["role"] == "training"] == 4).all()
        assert r["allocation"]["training_gpus"].max() == 4


def test_pivot_migrates_sequences_and_keeps_tokens(tmp_path: Path) -> None:
    """Shift-ups during generation migrate running sequences (abort → re-prefill with
    their tokens); the run still trains every sample exactly once."""
    out = run(tmp_path, "deployment.mode=pivot", "loop.batch_prompts=6")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    r = open_run(tmp_path)
    mig = r["migrations"]
    assert len(mig) and mig["sequences"].sum() > 0
    assert (r["steps"]["samples"] == 24).all()


def test_failing_worker_brings_the_world_down(tmp_path: Path) -> None:
    t0 = time.monotonic()
    out = run(tmp_path, env={"PIVOT_HPC_FAULT": "train"}, timeout=300)
    took = time.monotonic() - t0
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert "injected fault on 'train'" in text and "worker rank" in text
    assert took < 240


def test_bad_layout_is_refused_before_work(tmp_path: Path) -> None:
    out = subprocess.run(
        ["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", "3", *run_command(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMPI_MCA_osc": "^ucx"},
    )
    assert out.returncode != 0
    assert "the MPI world has 3 ranks but the config needs 5" in out.stdout + out.stderr
    assert not np.any([p.suffix == ".h5" for p in tmp_path.rglob("*")])


def test_elastic_training_grows_live_and_resumes_at_another_dp(tmp_path: Path) -> None:
    """planner.elastic_training live: extensions join steps (parameters and optimizer state
    from GPS, runtime/training_world.py) and leave again; the run resumes with a training set of
    two (DP 2) from a checkpoint written at DP 1.

    Growth is decided by measured times, so the test pins the inputs that make it
    certain: free shifts (τ_shift = 0 for every role, not refitted from the ~10-40 ms
    measured), so a new slot starts the step at once (its re-shard and its occupants'
    shift down cost nothing). Then the last step, which has no inference left and idle
    occupants (φ = 0), strictly gains from every extra replica (the step-time model's
    per-token slope is > 0). With measured shift times the gain of growing a ~70 ms step
    is within its noise, and CI once saw no growth at all."""
    elastic = [
        "planner.elastic_training=true",
        "planner.shift_time_s.training=0",
        "planner.shift_time_s.rollout=0",
        "planner.shift_time_s.reward=0",
        "planner.refit_shift_time=false",
    ]
    out = run(tmp_path, "loop.steps=4", *elastic)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    r = open_run(tmp_path)
    shifts = r["shifts"]
    ext = np.char.startswith(shifts["replica"].astype(str), "training:")
    assert (ext & (shifts["kind"] == "up")).any(), "no extension joined a step"
    assert r["allocation"]["training_gpus"].max() > 1
    assert (r["steps"]["samples"] == 16).all() and list(r["steps"]["version"]) == [1, 2, 3, 4]
    # the next allocation: a training set of two, extensions beyond it
    out = run(tmp_path, "loop.steps=6", "training.num_gpus=2", *elastic)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "pivot-hpc: done: 6 steps" in out.stdout
    r = open_run(tmp_path)
    assert list(r["steps"]["version"]) == [1, 2, 3, 4, 5, 6]
    assert r["allocation"]["training_gpus"][-1] >= 2
