"""Tool-calling rollouts live (issue 37): `pivot-hpc run configs/tiny-tools.yaml` on a real
local MPI world. The warmed-up tiny policy calls the calculator; each call parks its
trajectory and runs in node 0's sandbox service (the coordinator's own), its result comes
back as the next turn's observation, and every trajectory is one sample, trained once
(the coordinator aborts the run on any conservation or staleness violation). The report
counts the calls.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from live import ROOT, report_json, run_command, start_job, wait_for

from pivot_hpc.telemetry import open_run

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs OpenMPI (mpirun)")

CONFIG = "configs/tiny-tools.yaml"


@pytest.mark.timeout(1200)
def test_a_tools_run_trains_on_calls_and_resumes_its_trajectories(tmp_path: Path) -> None:
    """SIGTERM while trajectories wait on tool calls: trajectories in flight — parked on a
    call or between turns — are saved as data; the resumed allocation issues parked calls
    again and trains every sample exactly once. The tool is the stateful calculator
    (`calc_memory`: replayable, not idempotent), so a parked call is replayed with its
    trajectory's earlier calls in the real sandbox instead of its group being resampled.
    In the first allocation every call is held 20 s (a test hook), and the job is stopped
    10 s after its workers are ready: the first turns have called by then (a few seconds),
    and none of those calls has returned. Most trajectories called the tool, every call
    was answered, and the report counts them (one job for all these checks: each tools job
    costs minutes of CI)."""
    from pivot_hpc.checkpoint import store
    from pivot_hpc.runtime.checkpointing import load_rl_state

    base = ["loop.steps=4", "loop.batch_prompts=4", "loop.eval_problems=0"]
    base += ["checkpoint.interval_steps=0", "tools.tools=[calc_memory]"]
    run_dir, log = tmp_path / "run", tmp_path / "first.log"
    proc = start_job(
        run_command(run_dir, *base, config=CONFIG),
        log,
        PIVOT_HPC_DECODE_DELAY_S="0.05",
        PIVOT_HPC_TOOL_DELAY_S="20",
    )
    wait_for(log, "workers ready", proc, timeout=600)
    time.sleep(10)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=300) == 3, log.read_text()[-3000:]
    (ckpt,) = store.complete(run_dir)
    state = load_rl_state(ckpt)
    in_flight = [
        s.payload.traj for b in state["rl"]["batches"].values() for s in b if not s.rolled_out
    ]
    states = {t.state for t in in_flight}
    assert states <= {"gen", "parked"}, states
    assert "parked" in states, states  # held 20 s: those issued wait at the stop
    out = subprocess.run(
        run_command(run_dir, *base, config=CONFIG),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "pivot-hpc: done: 4 steps" in out.stdout
    assert "is sampled again" not in out.stdout  # parked calls replayed, no group resampled
    r = open_run(run_dir)
    trained, calls = r["trained"], r["tool_calls"]
    assert len(np.unique(trained["sample_id"])) == len(trained) == 4 * 16
    # the policy was taught to call: most trajectories do, and their calls were answered
    assert (trained["tool_calls"] > 0).mean() > 0.3
    assert len(calls) >= int(trained["tool_calls"].sum())
    assert {str(s) for s in calls["status"]} <= {"ok", "error"}
    assert (calls["tool_s"] <= calls["wait_s"] + 1e-6).all()
    rollout = r["throughput"][r["throughput"]["role"] == "rollout"]
    assert (rollout["n_parked"] >= 0).all()  # the parked series is written
    summary = report_json(run_dir)
    assert summary["tool_calls"] == len(calls) > 0
    share = (trained["tool_calls"] > 0).mean()
    assert summary["tool_call_trajectory_share"] == pytest.approx(share)
    assert summary["tool_wait_s_mean"] > 0
    print(f"in flight at the stop: {len(in_flight)} trajectories, states {sorted(states)}")
