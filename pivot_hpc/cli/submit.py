"""`pivot-hpc submit CONFIG [--nodes N] [--time MIN] [--partition P] [--run-dir DIR] [overrides]`.

Submits the main job to Slurm through submitit (the same run as `sbatch slurm/pivot.sbatch`):
one task per device slot plus one host rank per node, `srun --mpi=pmix`, every task
running `pivot_hpc.runtime.main.run_in_world` in one MPI world. The config is loaded and
validated here, before anything is submitted.

Time limits and preemption (how this fits submitit's own signal handling)
-------------------------------------------------------------------------
submitit's default is to send USR2 (`--signal=USR2@90`) to every task; its handler on task
0 calls the callable's `checkpoint()`, runs `scontrol requeue` and exits at once. That
would stop rank 0 in the middle of MPI work, before our runtime wrote its checkpoint. So:

* The job asks Slurm for `--signal=USR1@<signal-s>` (to every task, not the batch script)
  and `--requeue`. Every rank's runtime handles USR1/SIGTERM itself (`runtime/stop.py`,
  installed by `run_in_world`, replacing submitit's SIGTERM bypass): the coordinator drains,
  writes a complete checkpoint under RUN_DIR/checkpoints, and every rank returns
  EXIT_REQUEUE (3).
* Inside each task, `PivotJob.__call__` replaces submitit's USR2 handler by one that only
  requests the same graceful stop (so `job._interrupt()` and sites that signal USR2 also
  checkpoint first). submitit therefore never calls `checkpoint()` itself; `PivotJob`'s
  `checkpoint()` stays submitit's default (resubmit the same call), which is right because
  all state lives in the run directory.
* When `run_in_world` returns 3, task 0 runs `scontrol requeue $SLURM_JOB_ID` (after the
  checkpoint is complete), and every task raises SystemExit(3). SystemExit is not an
  Exception, so submitit writes no result file: `job.result()` in the driver keeps waiting
  while Slurm shows the job REQUEUED/PENDING/RUNNING, through as many allocations as it
  takes (at most --max-requeues).
* The requeued job runs the same pickled call; `run_in_world` finds the newest complete
  checkpoint in the same run directory and resumes. Only the final allocation returns a
  result (a small summary dict per task).
* Plain `scancel` (SIGTERM to everything, srun included) kills the step at once: to stop
  gracefully use `scancel --signal=USR1 JOBID`.

Without slurmdbd `sacct` fails and submitit cannot see that a job died: use
slurm/local_cluster.sh's sacct stand-in on such clusters.
"""

from __future__ import annotations

import argparse
import copy
import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from submitit.helpers import Checkpointable

from pivot_hpc import interpreter
from pivot_hpc.config import from_dict, to_dict, validate_tree
from pivot_hpc.errors import PivotError, UsageError
from pivot_hpc.job.config import Config, load_config
from pivot_hpc.runtime import run_dir as run_dirs

# Sent by Slurm to every task before the time limit; the runtime's stop signal (stop.py).
STOP_SIGNAL = "USR1"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML run config (validated before submission)")
    p.add_argument(
        "--run-dir",
        default=None,
        help="telemetry, checkpoints and submitit logs (DIR/slurm) go here; every "
        "allocation of the job resumes from it (default runs/<config>-<date-time>)",
    )
    p.add_argument("--nodes", type=int, default=None, help="nodes (sets cluster.nodes)")
    p.add_argument("--time", type=int, default=60, metavar="MIN", help="time limit per allocation")
    p.add_argument("--partition", default=None, help="Slurm partition (default: the cluster's)")
    p.add_argument(
        "--gpus",
        choices=("auto", "yes", "no"),
        default="auto",
        help="request cluster.gpus_per_node GPUs per node: auto = only if the partition has "
        "GPU gres (a CPU cluster refuses GPU requests)",
    )
    p.add_argument("--job-name", default="pivot")
    p.add_argument(
        "--signal-s",
        type=int,
        default=120,
        help="seconds before the time limit at which the run is told to checkpoint",
    )
    p.add_argument("--mpi", default="pmix", help="srun --mpi plugin (OpenMPI: pmix; MPICH: pmi2)")
    p.add_argument("--max-requeues", type=int, default=100, help="give up after this many")
    p.add_argument(
        "--sbatch",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra sbatch option, e.g. --sbatch account=proj --sbatch qos=high (repeatable)",
    )
    p.add_argument(
        "--wait", action="store_true", help="wait for the job to finish; print the result"
    )
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. loop.steps=100")


class PivotJob(Checkpointable):
    """What every task of the job runs: join the MPI world, train, requeue on a stop.

    Checkpointable marks the job as resumable; the default `checkpoint()` (resubmit the
    same call) is right because the state lives in `run_dir`. See the module docstring
    for how signals and requeueing work.
    """

    def __init__(self, cfg: Config, run_dir: str, max_requeues: int = 100) -> None:
        # The validated config as plain data, rebuilt in every allocation: a pickled
        # dataclass instance would break if pivot_hpc changes between requeues.
        self.config = to_dict(cfg)
        self.run_dir = run_dir
        self.max_requeues = max_requeues

    def make_config(self) -> Config:
        cfg = from_dict(Config, copy.deepcopy(self.config))
        validate_tree(cfg)
        return cfg

    def __call__(self) -> dict[str, Any]:
        from submitit import JobEnvironment

        from pivot_hpc.runtime import stop
        from pivot_hpc.runtime.main import run_in_world

        rank = int(os.environ.get("SLURM_PROCID", "0"))
        restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
        job_id = os.environ.get("SLURM_JOB_ID", "?")
        # submitit's preemption signal → our graceful stop (not its immediate requeue+exit)
        signal.signal(JobEnvironment._usr_sig(), _request_stop)
        run_dir = Path(self.run_dir)
        if rank == 0:
            print(
                f"pivot-hpc submit: job {job_id}, SLURM_RESTART_COUNT={restarts}, "
                f"run dir {run_dir}",
                flush=True,
            )
        cfg = self.make_config()
        run_dirs.prepare(run_dir, cfg.checkpoint.private_run_dir)
        from pivot_hpc import compile_caches
        from pivot_hpc.runtime.host_tools import start_before_mpi

        compile_caches.install(cfg.models.cache_dir)  # private, before torch compiles

        start_before_mpi(cfg)  # tools: the node's sandbox service, before MPI initialises
        code = run_in_world(cfg, run_dir)
        if code == 0:
            return {
                "run_dir": str(run_dir),
                "steps": cfg.loop.steps,
                "restarts": restarts,
                "rank": rank,
            }
        if code == stop.EXIT_REQUEUE:
            if rank == 0:
                self._requeue(job_id, restarts, run_dir)
            # Not an Exception: submitit writes no result, the driver waits for the next run.
            raise SystemExit(code)
        raise RuntimeError(
            f"pivot-hpc run in {run_dir} ended with exit code {code} on rank {rank} "
            f"(job {job_id}); see the task logs in {run_dir / 'slurm'}"
        )

    def _requeue(self, job_id: str, restarts: int, run_dir: Path) -> None:
        if restarts >= self.max_requeues:
            raise RuntimeError(
                f"job {job_id} checkpointed but is not requeued: SLURM_RESTART_COUNT="
                f"{restarts} reached --max-requeues={self.max_requeues}; submit again with "
                f"--run-dir {run_dir} to continue"
            )
        print(f"pivot-hpc submit: checkpoint written; requeueing job {job_id}", flush=True)
        p = subprocess.run(
            ["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60
        )
        if p.returncode != 0:
            raise RuntimeError(
                f"'scontrol requeue {job_id}' failed ({p.stderr.strip()}): the job needs "
                f"--requeue and JobRequeue=1; submit again with --run-dir {run_dir} to resume"
            )


def _request_stop(signum: int, _frame: object) -> None:
    from pivot_hpc.runtime import stop

    stop.request(signal.Signals(signum).name)


def partition_has_gpus(partition: str | None) -> bool:
    """Whether any node of the partition (default: all) advertises GPU gres."""
    cmd = ["sinfo", "-h", "-o", "%G"] + (["-p", partition] if partition else [])
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "gpu" in out


def submit(
    cfg: Config,
    run_dir: Path,
    *,
    time_min: int = 60,
    partition: str | None = None,
    gpus: bool = False,
    job_name: str = "pivot",
    signal_s: int = 120,
    mpi: str = "pmix",
    max_requeues: int = 100,
    sbatch: dict[str, str] | None = None,
):
    """Submit `cfg` as one Slurm job; returns the submitit Job (tasks: one per rank)."""
    import submitit

    if time_min < 1:
        raise UsageError(f"--time={time_min}: the time limit must be at least 1 minute")
    if not 0 < signal_s < time_min * 60:
        raise UsageError(
            f"--signal-s={signal_s} must lie between 0 and the time limit ({time_min * 60} s): "
            "the run is told to checkpoint that long before the limit"
        )
    if shutil.which("sbatch") is None or shutil.which("srun") is None:
        raise PivotError(
            "sbatch/srun not found: pivot-hpc submit needs a Slurm cluster "
            "(bash slurm/local_cluster.sh start brings up a local one)"
        )
    run_dir = run_dir.absolute()
    params: dict[str, Any] = {
        "job_name": job_name,
        "nodes": cfg.cluster.nodes,
        "ntasks_per_node": cfg.cluster.ranks_per_node,  # GPUs + 1 host rank per node
        "time": time_min,
        "signal_delay_s": signal_s,
        # node-major ranks (runtime/world.py checks), no core binding (pivot.sbatch says why)
        "srun_args": [f"--mpi={mpi}", "--distribution=block", "--cpu-bind=none"],
        "setup": [
            'echo "pivot-hpc submit: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, '
            'SLURM_RESTART_COUNT=${SLURM_RESTART_COUNT:-0}"',
            # CPU allocations: what `pivot-hpc run` sets for its own mpirun (docs/platform.md);
            # serialized: OpenMPI's osc/pt2pt (windows across nodes without RDMA) refuses
            # MPI_THREAD_MULTIPLE, and pivot_hpc calls MPI from one thread per rank
            'if [ -z "${SLURM_GPUS_ON_NODE:-}${SLURM_JOB_GPUS:-}${CUDA_VISIBLE_DEVICES:-}" ]; '
            'then export OMPI_MCA_osc="${OMPI_MCA_osc:-^ucx}" UCX_MODULES="${UCX_MODULES:-^ib}" '
            'MPI4PY_RC_THREAD_LEVEL="${MPI4PY_RC_THREAD_LEVEL:-serialized}"; fi',
            'export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONUNBUFFERED=1',
            *_safe_path_exports(),
        ],
        # USR1 to every task (not USR2 to submitit's handler); requeueable by us
        "additional_parameters": {
            "signal": f"{STOP_SIGNAL}@{signal_s}",
            "requeue": True,
            **(sbatch or {}),
        },
    }
    if partition:
        params["partition"] = partition
    if gpus:
        params["gpus_per_node"] = cfg.cluster.gpus_per_node

    # private, and refused if someone else could write there, before submitit writes the
    # job pickle that every allocation unpickles
    umask = os.umask(0o077)
    os.umask(umask)
    try:
        run_dirs.prepare(run_dir, cfg.checkpoint.private_run_dir)
        # -P: submitit's runner, on every task, imports no module from the directory the
        # job was submitted from (interpreter.py)
        python = shlex.join(interpreter.python())
        executor = submitit.SlurmExecutor(folder=run_dir / "slurm", python=python)
        executor.update_parameters(**params)
        return executor.submit(PivotJob(cfg, str(run_dir), max_requeues))
    finally:
        os.umask(umask)  # a library call leaves its caller's umask as it was


def _safe_path_exports() -> list[str]:
    """The batch script's lines that give every task what interpreter.environ() gives a
    local world: PYTHONSAFEPATH, and pivot_hpc's directory where only the cwd held it."""
    env = interpreter.environ()
    changed = [k for k in ("PYTHONSAFEPATH", "PYTHONPATH") if env.get(k) != os.environ.get(k)]
    return [f"export {k}={shlex.quote(env[k])}" for k in changed]


def _parse_sbatch(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--sbatch {item!r}: expected KEY=VALUE, e.g. --sbatch account=proj")
        out[key.strip().lstrip("-").replace("-", "_")] = value
    return out


def run(args: argparse.Namespace) -> int:
    overrides = list(args.overrides or [])
    if args.nodes is not None:
        if args.nodes < 1:
            raise UsageError(f"--nodes={args.nodes}: need at least 1 node")
        overrides.append(f"cluster.nodes={args.nodes}")
    cfg = load_config(args.config, overrides)  # validated before anything is submitted
    from pivot_hpc.runtime.world import check_before_launch

    check_before_launch(cfg)
    if args.run_dir is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        args.run_dir = f"runs/{Path(args.config).stem}-{stamp}"
    run_dir = Path(args.run_dir).absolute()
    if args.gpus == "auto":
        gpus = partition_has_gpus(args.partition)
    else:
        gpus = args.gpus == "yes"
    job = submit(
        cfg,
        run_dir,
        time_min=args.time,
        partition=args.partition,
        gpus=gpus,
        job_name=args.job_name,
        signal_s=args.signal_s,
        mpi=args.mpi,
        max_requeues=args.max_requeues,
        sbatch=_parse_sbatch(args.sbatch),
    )
    folder = run_dir / "slurm"
    tasks = cfg.cluster.ranks_per_node
    print(
        f"pivot-hpc: submitted job {job.job_id}: {cfg.cluster.nodes} node(s) x {tasks} tasks"
        f"{f' + {cfg.cluster.gpus_per_node} GPUs/node' if gpus else ' (no GPUs requested)'}, "
        f"{args.time} min per allocation, checkpoint + requeue {args.signal_s} s before the limit",
        flush=True,
    )
    print(f"  logs:        {folder}/{job.job_id}_0_log.out (rank 0; _<rank>_log.out/.err)")
    print(f"  telemetry:   {run_dir}/telemetry (pivot-hpc report {run_dir})")
    print(f"  checkpoints: {run_dir}/checkpoints")
    print(f"  stop early:  scancel --signal={STOP_SIGNAL} {job.job_id}  (checkpoints, requeues)")
    if not args.wait:
        return 0
    try:
        result = job.results()[0]
    except Exception as exc:  # submitit's UncompletedJobError/FailedJobError: print, exit 1
        print(f"pivot-hpc: job {job.job_id} failed: {exc}", flush=True)
        return 1
    print(f"pivot-hpc: job {job.job_id} done: {result}", flush=True)
    return 0
