"""`pivot-hpc run CONFIG [--run-dir DIR] [overrides]`: the main job.

Under Slurm or mpirun it joins the MPI world. Started alone on a workstation it launches
the local world itself (the installed `mpirun`, one rank per device slot plus one host
rank per node) and streams the one-line-per-step log.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from pivot_hpc.config import load_config
from pivot_hpc.errors import PivotError, UsageError

# Environment that makes OpenMPI + UCX/NIXL behave on CPU machines (PLATFORM.md).
MPI_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_osc": "^ucx",  # UCX one-sided reads at ~1 GB/s here; use OpenMPI's own
    "UCX_MODULES": "^ib",  # NIXL's bundled libnl vs Debian's libibverbs segfault at exit
    "OMP_NUM_THREADS": "1",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML run config (configs/tiny.yaml is the CPU default)")
    p.add_argument("--run-dir", default="runs/latest", help="telemetry and checkpoints go here")
    p.add_argument("--in-world", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. loop.steps=4")


def in_mpi_world() -> bool:
    return any(k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"))


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)  # validated before any MPI work
    run_dir = Path(args.run_dir)
    for parent in (run_dir, *run_dir.parents):
        if parent.exists() and not parent.is_dir():
            raise UsageError(
                f"--run-dir {run_dir}: {parent} is a file, not a directory; choose another path"
            )
    if args.in_world or in_mpi_world():
        if cfg.checkpoint.on_signal:  # as early as possible: a signal during start-up
            from pivot_hpc.runtime import stop  # still checkpoints (once the world is up)

            stop.install()
        if cfg.cluster.nodes > 1:
            # pivot_hpc calls MPI from one thread per rank; across nodes without RDMA,
            # OpenMPI 4's fallback one-sided component refuses MPI_THREAD_MULTIPLE windows
            os.environ.setdefault("MPI4PY_RC_THREAD_LEVEL", "serialized")
        from pivot_hpc.runtime.main import run_in_world

        run_dir.mkdir(parents=True, exist_ok=True)
        return run_in_world(cfg, run_dir)
    # A checkpoint to resume must be usable (complete, same config) before any rank starts.
    from pivot_hpc.checkpoint import store
    from pivot_hpc.config import to_dict

    found = store.find_resume(run_dir, to_dict(cfg), allowed=cfg.checkpoint.resume)
    if found is not None:
        print(
            f"pivot-hpc: {run_dir} has checkpoint {found[0].name} (step "
            f"{found[1]['step']}): resuming",
            flush=True,
        )
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise PivotError("mpirun not found: install OpenMPI (apt-get install openmpi-bin)")
    n = cfg.cluster.nodes * (cfg.cluster.gpus_per_node + 1)
    cmd = [
        mpirun,
        "-n",
        str(n),
        "--oversubscribe",
        "--bind-to",
        "none",
        sys.executable,
        "-m",
        "pivot_hpc",
        "run",
        args.config,
        "--run-dir",
        str(run_dir),
        "--in-world",
        *args.overrides,
    ]
    if cfg.cluster.nodes > 1:
        cmd[1:1] = ["--map-by", f"ppr:{cfg.cluster.gpus_per_node + 1}:node"]
    env = {**os.environ, **MPI_ENV}
    print(f"pivot-hpc: launching {n} ranks: {' '.join(cmd[:3])} …", flush=True)
    proc = subprocess.Popen(cmd, env=env)
    # mpirun forwards SIGUSR1 to every rank; SIGTERM it would turn into a kill, so a TERM
    # sent to this launcher is passed on as USR1: every rank then sees a graceful stop.
    from pivot_hpc.runtime.stop import EXIT_REQUEUE, SIGNALS

    def forward(signum, _frame) -> None:
        proc.send_signal(signal.SIGUSR1)

    for sig in SIGNALS:
        signal.signal(sig, forward)
    code = proc.wait()
    if code == EXIT_REQUEUE:
        print("pivot-hpc: checkpointed and stopped; resume with the same command", flush=True)
    return code
