"""Elastic training's data parallelism, live on CPU (tests/mpi/elastic_worker.py): megatron
trainers on gloo whose replicas change between steps, optimizer state through GPS."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("elastic_worker.py")
MPIRUN = shutil.which("mpirun")


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    if MPIRUN is None:
        pytest.fail("mpirun not found: install openmpi-bin libopenmpi-dev (tests/run_all.sh does)")
    out = tmp_path_factory.mktemp("elastic") / "out.json"
    cmd = [MPIRUN, "-n", "3", "--oversubscribe"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    cmd += [sys.executable, str(WORKER), str(out)]
    env = dict(os.environ, OMPI_MCA_osc="^ucx", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"elastic_worker hung for 240 s:\n{(exc.stdout or '')[-3000:]}")
    assert p.returncode == 0 and "ELASTIC-OK" in p.stdout, (p.stdout + p.stderr)[-6000:]
    return json.loads(out.read_text())


def test_optimizer_state_reshards_through_gps_bit_for_bit(measured: dict) -> None:
    # the joiner holds exactly the moments the set published, at the set's step count
    assert measured["reshard_bitwise"] is True
    assert measured["reshard_tensors"] == 2 * 27  # exp_avg and exp_avg_sq of every tensor
    assert measured["reshard_step"] == [1, 1, 1]  # optimizer step, steps, version


def test_replicas_stay_identical_after_a_grown_step(measured: dict) -> None:
    assert measured["replicas_bitwise_rank1"] and measured["replicas_bitwise_rank2"]


def test_grow_and_shrink_match_a_run_at_dp2_throughout(measured: dict) -> None:
    # DP 1 → grow → DP 2 → shrink → DP 1 → grow → DP 2 against DP 2 in every step: only
    # float summation order differs (the size of one DP 1 vs DP 2 step's difference)
    gap = measured["dp1_vs_dp2_step1_gap"]
    assert gap < 1e-4
    assert measured["grown_vs_dp2_after_step2"] <= 4 * gap + 1e-7
    assert measured["grown_vs_dp2_final"] <= 4 * gap + 1e-7
    # what the re-shard prevents: a joiner with fresh optimizer state is far off
    assert measured["fresh_optimizer_vs_dp2_after_step2"] > 100 * gap


def test_explicit_groups_reduce_like_megatron(measured: dict) -> None:
    assert measured["explicit_vs_megatron_bitwise"] is True
