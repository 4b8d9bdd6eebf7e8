"""Slurm end to end on a local cluster (conftest.py: two fake nodes on this host).

- slurm/pivot.sbatch runs configs/tiny.yaml to completion; the sacct stand-in answers
  submitit's query; a wrong allocation is refused before anything starts.
- A two-node world: GPS over real Slurm nodes (node-local windows, remote RMA) and a live
  run with cluster.nodes=2 of configs/tiny-tools.yaml, whose tool calls the coordinator
  routes to both nodes' sandbox services (node 1's over MPI to its host rank).
- `pivot-hpc submit` (submitit) runs a short job to completion.
- Checkpoint → requeue → resume on a signal, through pivot.sbatch and through submitit.
  These two depend on the runtime's checkpoint/resume work (runtime/stop.py,
  checkpointing; the "Slurm-native operation" issue) and fail until it is in place.

Jobs run one after another (2 cores); each wait has its own timeout.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pivot_hpc.telemetry import open_run
from tests.slurm.conftest import ROOT, SCRIPT, Slurm

TINY = "configs/tiny.yaml"
TOOLS = "configs/tiny-tools.yaml"
SHORT = ["loop.steps=2", "loop.batch_prompts=4"]
JOB_WAIT_S = 420  # one allocation of a tiny run: ~40-70 s here, more on a busy machine


def steps_of(run_dir: Path) -> list[int]:
    return [int(s) for s in open_run(run_dir)["steps"]["step"]]


def logs(out: Path) -> str:
    err = out.with_suffix(".err")
    tail = err.read_text()[-3000:] if err.exists() else ""
    return f"{out.read_text() if out.exists() else '(no stdout)'}\n--- stderr tail:\n{tail}"


def sbatch_tiny(
    slurm: Slurm, tmp: Path, *args: str, overrides=SHORT, env=None, config: str = TINY
) -> str:
    return slurm.sbatch(
        "--time=10",
        f"--output={tmp}/%j.out",
        f"--error={tmp}/%j.err",
        *args,
        "slurm/pivot.sbatch",
        config,
        str(tmp / "run"),
        *overrides,
        env=env,
    )


@pytest.mark.timeout(900)  # the first test also pays for the cluster start (apt-get)
def test_sbatch_runs_the_tiny_config(slurm_cluster: Slurm, tmp_path: Path) -> None:
    job = sbatch_tiny(slurm_cluster, tmp_path)
    out = tmp_path / f"{job}.out"
    info = slurm_cluster.wait(job, JOB_WAIT_S, out)
    assert info["JobState"] == "COMPLETED", logs(out)
    text = out.read_text()
    assert "SLURM_RESTART_COUNT=0" in text and "srun exited with code 0" in text, text
    assert steps_of(tmp_path / "run") == [0, 1]

    # the sacct stand-in answers submitit's own query, in the format submitit parses
    from submitit.slurm.slurm import SlurmInfoWatcher

    q = ["sacct", "-o", "JobID,State,NodeList", "--parsable2", "-j", job]
    p = subprocess.run(q, env=slurm_cluster.env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    info = SlurmInfoWatcher().read_info(p.stdout)[job]
    assert info["State"] == "COMPLETED" and info["NodeList"] in ("n1", "n2"), p.stdout


@pytest.mark.timeout(600)  # includes the cluster start when run alone
def test_local_cluster_start_is_idempotent(slurm_cluster: Slurm) -> None:
    t0 = time.monotonic()
    env = {**slurm_cluster.env(), "PIVOT_SLURM_DIR": str(slurm_cluster.dir)}
    p = subprocess.run(
        ["bash", str(SCRIPT), "start", "--two-nodes"],
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert p.returncode == 0 and "already running" in p.stdout, p.stdout + p.stderr
    assert time.monotonic() - t0 < 30
    s = subprocess.run(
        ["bash", str(SCRIPT), "status"], env=env, capture_output=True, text=True, timeout=60
    )
    assert s.returncode == 0 and re.search(r"^n1 ", s.stdout, re.M), s.stdout
    assert re.search(r"^n2 ", s.stdout, re.M), s.stdout


@pytest.mark.timeout(600)  # includes the cluster start when run alone
def test_sbatch_refuses_an_allocation_that_does_not_fit_the_config(
    slurm_cluster: Slurm, tmp_path: Path
) -> None:
    job = sbatch_tiny(slurm_cluster, tmp_path, "--ntasks-per-node=3")  # tiny needs 4 + 1
    out = tmp_path / f"{job}.out"
    info = slurm_cluster.wait(job, 90, out)
    assert info["JobState"] == "FAILED", logs(out)
    err = (tmp_path / f"{job}.err").read_text()
    assert "SLURM_NTASKS=3" in err and "--ntasks-per-node=5" in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(600)  # includes the cluster start when run alone
def test_gps_across_two_slurm_nodes(slurm_cluster: Slurm) -> None:
    """Node-local shared windows on n1 and n2, half of every tensor per node (group 2):
    reads and writes cross the Slurm nodes by MPI RMA."""
    env = slurm_cluster.env(
        two_nodes=True, OMPI_MCA_osc="^ucx", MPI4PY_RC_THREAD_LEVEL="serialized"
    )
    cmd = [
        "srun",
        "-N2",
        "--ntasks-per-node=3",
        "--mpi=pmix",
        "--time=5",
        sys.executable,
        "tests/mpi/gps_worker.py",
        "read_matrix",
        "roundtrip",
        "--group",
        "2",
    ]
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"srun -N2 gps_worker hung for 180s:\n{exc.stdout}{exc.stderr}")
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-5000:]
    assert "layout k=2 nodes=2 via rma" in p.stdout, out[-5000:]
    assert "GPS-OK read_matrix" in p.stdout and "GPS-OK roundtrip" in p.stdout


@pytest.mark.timeout(1800)  # includes building the tools models when nothing cached them
def test_two_node_live_run(slurm_cluster: Slurm, tmp_path: Path) -> None:
    """cluster.nodes=2: 2 × (2 device slots + 1 host rank), one MPI world over n1 and n2,
    running configs/tiny-tools.yaml: the policy calls the calculator, and the coordinator
    sends each call to the node with the fewest calls outstanding — node 0's sandbox
    service in-process, node 1's through its host rank over MPI (runtime/live_cluster.py).
    Telemetry names the node that answered each call: both did, every call was answered
    by the calculator itself (no service unavailable, crashed or timed out), and every
    sample was trained once."""
    from pivot_hpc.job.config import load_config
    from pivot_hpc.recipes.tiny_models import ensure_models

    # The job finds the tools policy and GenRM in the cache this process uses (sbatch
    # passes HOME and PIVOT_HPC_CACHE on): tests/engines and tests/mpi have built them in a
    # full run; alone, build them here rather than in the job (minutes each on 2 cores).
    ensure_models(load_config(ROOT / TOOLS).models, progress=False)
    job = sbatch_tiny(
        slurm_cluster,
        tmp_path,
        "--nodes=2",
        "--ntasks-per-node=3",
        config=TOOLS,
        overrides=[*SHORT, "loop.eval_problems=0", "cluster.nodes=2", "cluster.gpus_per_node=2"],
        env=slurm_cluster.env(two_nodes=True),
    )
    out = tmp_path / f"{job}.out"
    info = slurm_cluster.wait(job, JOB_WAIT_S, out)
    assert info["JobState"] == "COMPLETED", logs(out)
    assert "on n[1-2] (6 tasks)" in out.read_text()
    r = open_run(tmp_path / "run")
    assert [int(s) for s in r["steps"]["step"]] == [0, 1]
    assert r.config["cluster"]["nodes"] == 2 and r.config["tools"]["enabled"]
    trained, calls = r["trained"], r["tool_calls"]
    ids = sorted(int(i) for i in trained["sample_id"])
    assert ids == list(range(2 * 4 * 4)), ids  # 2 steps × 4 prompts × 4 samples, each once
    # Every call a trained trajectory made was answered; the rest belong to trajectories
    # of the batch after the last step, in flight when the run ended.
    assert len(calls) >= int(trained["tool_calls"].sum()) > 0, logs(out)
    nodes = [int(n) for n in calls["node"]]
    statuses = [str(s) for s in calls["status"]]
    seen = f"nodes {nodes}, statuses {statuses}\n{logs(out)}"
    assert set(nodes) == {0, 1}, seen
    # "error" is the calculator refusing an expression the sampled policy wrote badly: its
    # sandbox ran it and answered. Anything else would be the service or the route failing.
    assert set(statuses) <= {"ok", "error"}, seen
    assert statuses.count("ok") >= 0.8 * len(statuses), seen
    for node in (0, 1):
        mine = [s for n, s in zip(nodes, statuses, strict=True) if n == node]
        assert "ok" in mine, seen
    assert (calls["tool_s"] <= calls["wait_s"] + 1e-6).all()


@pytest.mark.timeout(900)
def test_trainer_children_across_two_nodes_are_replaced_after_a_death(
    slurm_cluster: Slurm, tmp_path: Path
) -> None:
    """rl.trainer.process=child with one training GPU on each node (training.gpus=[1,3]:
    world ranks 2 and 5 of 2 × (host rank + 2 device slots)): the children meet over a
    TCP store on the first training rank's host. The test hook SIGKILLs rank 5's child
    after step 0; both nodes' children are replaced in a new world (a new port) before
    step 1, and every sample is trained once."""
    job = sbatch_tiny(
        slurm_cluster,
        tmp_path,
        "--nodes=2",
        "--ntasks-per-node=3",
        overrides=[
            "loop.steps=3",
            "loop.batch_prompts=4",
            "loop.eval_problems=0",
            "cluster.nodes=2",
            "cluster.gpus_per_node=2",
            "training.gpus=[1,3]",
            "rl.trainer.process=child",
        ],
        # runtime/worker.py TEST_KILL_TRAINER_ENV (importing it would initialise MPI here)
        env=slurm_cluster.env(two_nodes=True, PIVOT_HPC_TEST_KILL_TRAINER_AFTER_STEP="0@5"),
    )
    out = tmp_path / f"{job}.out"
    info = slurm_cluster.wait(job, JOB_WAIT_S, out)
    assert info["JobState"] == "COMPLETED", logs(out)
    text = out.read_text()
    assert "on n[1-2] (6 tasks)" in text, logs(out)
    assert "training engine of rank 5" in text and "killed by signal 9" in text, logs(out)
    r = open_run(tmp_path / "run")
    assert [int(s) for s in r["steps"]["step"]] == [0, 1, 2]
    assert [int(v) for v in r["steps"]["version"]] == [1, 2, 3]
    ids = sorted(int(i) for i in r["trained"]["sample_id"])
    assert ids == list(range(3 * 4 * 4)), ids  # 3 steps × 4 prompts × 4 samples, each once
    assert [str(a) for a in r["failures"]["action"]] == ["restart"], logs(out)


@pytest.mark.timeout(600)
def test_submit_through_submitit(slurm_cluster: Slurm, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "pivot_hpc",
        "submit",
        TINY,
        "--run-dir",
        str(run_dir),
        "--time",
        "10",
        "--wait",
        *SHORT,
    ]
    try:
        p = subprocess.run(
            cmd,
            cwd=ROOT,
            env=slurm_cluster.env(),
            capture_output=True,
            text=True,
            timeout=JOB_WAIT_S,
        )
    except subprocess.TimeoutExpired as exc:
        subprocess.run(["scancel", "--name=pivot"], env=slurm_cluster.env(), timeout=30)
        pytest.fail(f"pivot-hpc submit --wait hung for {JOB_WAIT_S}s:\n{exc.stdout}{exc.stderr}")
    assert p.returncode == 0, p.stdout + p.stderr
    m = re.search(r"submitted job (\d+)", p.stdout)
    assert m and f"job {m.group(1)} done" in p.stdout and "'restarts': 0" in p.stdout, p.stdout
    assert (
        f"{run_dir}/telemetry" in p.stdout and f"{run_dir}/slurm/{m.group(1)}_0_log.out" in p.stdout
    )
    assert steps_of(run_dir) == [0, 1]
    script = (run_dir / "slurm" / f"{m.group(1)}_submission.sh").read_text()
    for line in ("--signal=USR1@120", "--requeue", "--ntasks-per-node=5", "--mpi=pmix"):
        assert line in script, script
    assert "gpus" not in script  # no GPU gres on this cluster: none requested


# ---------------------------------------------------------------------------------------
# Signal → checkpoint → requeue → resume. These depend on the runtime's checkpoint and
# resume (pivot_hpc/runtime/stop.py: exit code 3 after a checkpoint on SIGUSR1/SIGTERM;
# resume from RUN_DIR/checkpoints) and fail until that work is in place.
# colocated mode runs the steps one after another (~1 s each on a quiet machine), so a
# signal sent when step 1 is logged lands before the run is over.
# ---------------------------------------------------------------------------------------
REQUEUE_RUN = ["loop.steps=4", "loop.batch_prompts=4", "deployment.mode=colocated"]


@pytest.mark.timeout(720)
def test_sbatch_signal_checkpoints_requeues_and_resumes(
    slurm_cluster: Slurm, tmp_path: Path
) -> None:
    job = sbatch_tiny(slurm_cluster, tmp_path, overrides=REQUEUE_RUN)
    out = tmp_path / f"{job}.out"
    slurm_cluster.wait_for(
        "'step 1/4' in the log", lambda: "step 1/4" in _read(out), JOB_WAIT_S, job
    )
    subprocess.run(
        ["scancel", "--signal=USR1", "--batch", job],
        env=slurm_cluster.env(),
        check=True,
        timeout=30,
    )
    info = slurm_cluster.wait(job, 2 * JOB_WAIT_S, out)
    text = logs(out)
    assert info["JobState"] == "COMPLETED", text
    assert "srun exited with code 0 (SLURM_RESTART_COUNT=0)" not in text, (
        "the run finished before the signal arrived (timing); nothing was requeued\n" + text
    )
    assert "srun exited with code 3 (SLURM_RESTART_COUNT=0)" in text, text
    assert "SLURM_RESTART_COUNT=1" in text and info.get("Restarts") == "1", text
    assert "srun exited with code 0 (SLURM_RESTART_COUNT=1)" in text, text
    r = open_run(tmp_path / "run")
    assert [int(s) for s in r["steps"]["step"]] == [0, 1, 2, 3]  # same final step count
    assert len(r.files) == 2  # one telemetry file per allocation
    assert_each_sample_trained_once(r)


@pytest.mark.timeout(720)
def test_submit_signal_checkpoints_requeues_and_resumes(
    slurm_cluster: Slurm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(a) USR1 → our checkpoint → requeue, (b) the requeued job resumes from the run dir,
    (c) job.results() does not return after the first allocation."""
    from pivot_hpc.cli.submit import submit
    from pivot_hpc.job.config import load_config

    for k, v in slurm_cluster.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(ROOT)
    run_dir = tmp_path / "run"
    job = submit(load_config(TINY, REQUEUE_RUN), run_dir, time_min=15)
    out = run_dir / "slurm" / f"{job.job_id}_0_log.out"
    slurm_cluster.wait_for(
        "'step 1/4' in the log", lambda: "step 1/4" in _read(out), JOB_WAIT_S, job.job_id
    )
    subprocess.run(["scancel", "--signal=USR1", job.job_id], check=True, timeout=30)
    slurm_cluster.wait_for(
        "requeue",
        lambda: slurm_cluster.show(job.job_id).get("Restarts") == "1",
        JOB_WAIT_S,
        job.job_id,
    )
    assert not job.done(force_check=True), "job.results() would return after allocation 1"
    info = slurm_cluster.wait(job.job_id, 2 * JOB_WAIT_S, out)
    assert info["JobState"] == "COMPLETED", _read(out)[-4000:]
    result = job.results()[0]
    assert result["restarts"] == 1 and result["steps"] == 4, result
    text = _read(out)
    assert "SLURM_RESTART_COUNT=1" in text and "requeueing job" in text, text
    r = open_run(run_dir)
    assert [int(s) for s in r["steps"]["step"]] == [0, 1, 2, 3]
    assert len(r.files) == 2
    assert_each_sample_trained_once(r)


def assert_each_sample_trained_once(r) -> None:
    """4 steps × 4 prompts × 4 samples across both allocations: none missing or repeated."""
    ids = [int(i) for i in r["trained"]["sample_id"]]
    assert sorted(ids) == list(range(64)), ids


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
