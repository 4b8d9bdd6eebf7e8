"""Checkpoints on a real local MPI world: a stop signal checkpoints (with the partial
sequences' tokens) and exits 3; the same command resumes and trains every sample exactly
once; `kill -9` of the whole job at random moments never leaves a torn checkpoint.

`PIVOT_HPC_DECODE_DELAY_S` (a test knob of the worker) slows decoding so that sequences
are still being generated when the test signals or kills the job.
"""

from __future__ import annotations

import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import listeners
import numpy as np
import pytest
from live import ROOT, run_command, start_job, wait_for

from pivot_hpc.checkpoint import store
from pivot_hpc.runtime.checkpointing import load_rl_state
from pivot_hpc.telemetry import open_run

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs OpenMPI (mpirun)")

BASE = ["loop.steps=4", "loop.batch_prompts=4", "checkpoint.interval_steps=0"]


def run(run_dir: Path, *overrides: str, timeout: int = 420) -> subprocess.CompletedProcess:
    return subprocess.run(
        run_command(run_dir, *overrides), cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def start(run_dir: Path, log: Path, *overrides: str, delay_s: float) -> subprocess.Popen:
    return start_job(run_command(run_dir, *overrides), log, PIVOT_HPC_DECODE_DELAY_S=str(delay_s))


def kill_session(proc: subprocess.Popen) -> None:
    """kill -9 every process of the job's session. Repeated until none is left: a rank
    that mpirun was forking at the moment of the first kill appears only after it."""
    end = time.monotonic() + 30
    while True:
        subprocess.run(["pkill", "-KILL", "-s", str(proc.pid)], check=False)
        if proc.poll() is None:
            proc.wait(timeout=30)
        ps = subprocess.run(["ps", "-o", "stat=", "-s", str(proc.pid)], capture_output=True)
        alive = [st for st in ps.stdout.decode().split() if not st.startswith("Z")]
        if not alive:
            return
        assert time.monotonic() < end, "job processes survived kill -9"
        time.sleep(0.2)


def trained_samples(run_dir: Path) -> np.ndarray:
    return open_run(run_dir)["trained"]


@pytest.mark.timeout(900)
def test_signal_checkpoints_partial_work_and_resume_trains_each_sample_once(
    tmp_path: Path,
) -> None:
    reference = tmp_path / "uninterrupted"
    out = run(reference, *BASE)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]

    run_dir, log = tmp_path / "signalled", tmp_path / "first.log"
    proc = start(run_dir, log, *BASE, delay_s=0.1)
    wait_for(log, "step 1/4", proc, timeout=300)
    # nothing of the running job can be reached from another host
    sockets = listeners.of_session(proc.pid)
    exposed = [s for s in sockets if not (s.loopback or s.private_netns)]
    assert not exposed, f"listening beyond loopback: {exposed}\n{log.read_text()[-2000:]}"
    # the step lines of the first batches can come all at once, the moment the next batch
    # starts: give it a second of (slowed) decoding so the stop has partial work to keep
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)  # scancel, preemption (SIGUSR1: tests/slurm)
    assert proc.wait(timeout=300) == 3, log.read_text()[-3000:]
    text = log.read_text()
    assert "stopped by SIGTERM" in text and "resume with the same command" in text
    assert "aborted" not in text and "non-zero" not in text  # a clean stop looks clean
    assert "UserWarning" not in text  # library noise is in logs/rank-*.log
    assert any("Apex" in p.read_text() for p in (run_dir / "logs").glob("rank-*.log"))

    (ckpt,) = store.complete(run_dir)
    manifest = store.verify(ckpt)
    assert manifest["reason"] == "SIGTERM" and 1 <= manifest["step"] < 4
    # weights, RL state and telemetry are the owner's only (checkpoint.private_run_dir)
    for path in [run_dir, *run_dir.rglob("*")]:
        mode = path.stat().st_mode & 0o777
        assert mode & 0o077 == 0, f"{path} has mode {mode:o}"
    state = load_rl_state(ckpt)
    # the batches released beyond the checkpoint's step are kept, generated work included
    assert state["rl"]["released"] > manifest["step"]
    assert manifest["generated_tokens_kept"] > 0
    partial = state["partials"]
    for (role, _sid), res in partial.items():
        assert role in ("rollout", "reward") and res.finish_reason == "abort"
        assert len(res.token_ids) == len(res.logprobs) > 0

    out = run(run_dir, *BASE)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert f"resuming from {ckpt}" in out.stdout and "pivot-hpc: done: 4 steps" in out.stdout

    r = open_run(run_dir)
    assert len(r.files) == 2 and r.file_meta[1]["resumed_from"] == ckpt.name
    trace = subprocess.run(
        [sys.executable, "-m", "pivot_hpc", "trace", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )  # the live telemetry of both allocations as one Perfetto trace
    assert trace.returncode == 0 and (run_dir / "trace.json").is_file(), trace.stderr
    assert any((run_dir / "tensorboard").iterdir())  # the default tracker
    assert list(r["steps"]["step"]) == [0, 1, 2, 3]
    got, want = r["trained"], trained_samples(reference)
    assert len(np.unique(got["sample_id"])) == len(got) == 4 * 16  # each once, none missing
    key = ("step", "prompt_index", "group")
    assert sorted(map(tuple, got[list(key)].tolist())) == sorted(
        map(tuple, want[list(key)].tolist())
    )  # the same data, batches and steps as the uninterrupted run with the same seed
    # saved partial rollouts finished from their saved tokens in the second allocation
    by_id = {int(s["sample_id"]): s for s in got}
    for (role, sid), res in partial.items():
        if role == "rollout":
            assert by_id[sid]["response_tokens"] >= len(res.token_ids)
    assert (r["steps"]["staleness_max"] <= 2).all()


@pytest.mark.timeout(1200)
def test_kill_9_at_random_moments_always_resumes_from_a_complete_checkpoint(
    tmp_path: Path,
) -> None:
    # 60 steps: far more than 4 allocations cut short get through, so every kill lands
    # mid-run (two in start-up, two while it works); the last allocation then finishes 2
    # steps past the newest checkpoint (loop.steps may change on resume)
    overrides = ["loop.steps=60", "loop.batch_prompts=2", "checkpoint.interval_steps=1"]
    run_dir = tmp_path / "run"
    rng = random.Random(7)
    seen_steps = []
    for kill in range(4):
        log = tmp_path / f"alloc-{kill}.log"
        proc = start(run_dir, log, *overrides, delay_s=0.05)
        if kill % 2 == 0:  # somewhere in start-up: models, GPS, workers, restore
            time.sleep(rng.uniform(1.0, 10.0))
        else:  # while it works: rollout, reward, training, checkpoint writing
            wait_for(log, "pivot-hpc: checkpoint", proc, timeout=300)
            time.sleep(rng.uniform(0.0, 1.5))
        assert proc.poll() is None, f"exited {proc.returncode}:\n{log.read_text()[-3000:]}"
        kill_session(proc)
        for ckpt in store.complete(run_dir):  # every complete checkpoint is whole
            store.verify(ckpt)
        newest = store.newest(run_dir)
        seen_steps.append(store.verify(newest)["step"] if newest else 0)
        if (run_dir / "telemetry").is_dir() and any((run_dir / "telemetry").iterdir()):
            open_run(run_dir)  # every file written before a kill still opens
    assert seen_steps == sorted(seen_steps)  # progress is never lost to a later kill
    steps = seen_steps[-1] + 2
    out = run(run_dir, *overrides, f"loop.steps={steps}")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert f"pivot-hpc: done: {steps} steps" in out.stdout
    r = open_run(run_dir)
    last = {}  # step -> its rows of the last allocation that trained it
    for step in range(steps):
        rows = r["trained"][r["trained"]["step"] == step]
        assert len(rows) % 8 == 0 and len(rows) >= 8  # 2 prompts × 4 samples, maybe redone
        last[step] = rows[-8:]
    ids = np.concatenate([last[s]["sample_id"] for s in range(steps)])
    assert len(np.unique(ids)) == len(ids) == steps * 8
    assert not any(p.name.startswith(".") for p in store.checkpoints_dir(run_dir).iterdir())


@pytest.mark.timeout(900)
def test_a_signal_to_every_process_of_the_job_spares_engine_children(tmp_path: Path) -> None:
    """Slurm signals every process of a step, engine processes included: with the engines
    in child processes of their ranks, a USR1 to the whole session checkpoints and exits 3
    (no engine died of it), and the same command resumes and finishes."""
    children = ("engines.rollout.process=child", "engines.reward.process=child")
    run_dir, log = tmp_path / "run", tmp_path / "first.log"
    proc = start(run_dir, log, *BASE, *children, delay_s=0.1)
    wait_for(log, "step 1/4", proc, timeout=300)
    engines = subprocess.run(
        ["pgrep", "-s", str(proc.pid), "-f", "pivot_hpc.engines.process.serve"],
        capture_output=True,
        text=True,
    ).stdout.split()
    assert len(engines) >= 2, log.read_text()[-2000:]  # every worker of a role has one
    time.sleep(1.0)
    subprocess.run(["pkill", "-USR1", "-s", str(proc.pid)], check=False)
    assert proc.wait(timeout=300) == 3, log.read_text()[-3000:]
    text = log.read_text()
    assert "stopped by SIGUSR1" in text and "engine process" not in text, text[-3000:]
    (ckpt,) = store.complete(run_dir)
    assert store.verify(ckpt)["reason"] == "SIGUSR1"
    out = run(run_dir, *BASE, *children)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert f"resuming from {ckpt}" in out.stdout and "pivot-hpc: done: 4 steps" in out.stdout
    leftover = subprocess.run(
        ["pgrep", "-f", "pivot_hpc.engines.process.serve"], capture_output=True
    )
    assert not set(leftover.stdout.decode().split()) & set(engines)  # none outlived its rank
