"""`pivot-hpc run CONFIG [--run-dir DIR] [overrides]`: the main job.

Under Slurm or mpirun it joins the MPI world. Started alone on a workstation it launches
the local world itself (the installed `mpirun`, one rank per device slot plus one host
rank per node) and streams the one-line-per-step log.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from pivot_hpc.job.config import load_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML run config (configs/tiny.yaml is the CPU default)")
    p.add_argument("--run-dir", default="runs/latest", help="telemetry and checkpoints go here")
    p.add_argument("--in-world", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. loop.steps=4")


def in_mpi_world() -> bool:
    return any(k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"))


def run(args: argparse.Namespace) -> int:
    # mpirun gives each rank's stdout a pseudo-terminal: numba's coloured errors (colorama)
    # would then write a stray reset code (ESC[0m) as the log's last line; before numba loads
    os.environ.setdefault("NUMBA_DISABLE_ERROR_MESSAGE_HIGHLIGHTING", "1")
    cfg = load_config(args.config, args.overrides)  # validated before any MPI work
    from pivot_hpc.progress import interval_s

    interval_s()  # PIVOT_HPC_PROGRESS_S, refused here rather than after the queue wait
    run_dir = Path(args.run_dir)
    from pivot_hpc.runtime import run_dir as run_dirs

    run_dirs.check(run_dir)
    # whoever owns the run directory decides what a resume reads: refused before anything
    # in it is opened or announced (a missing one is made, private, further down)
    run_dirs.check_owned(run_dir)
    if args.in_world or in_mpi_world():
        # each worker sees its own GPU only; CUDA reads this once, so before anything
        # (torch, mpi4py's CUDA-aware paths) can initialise it
        from pivot_hpc.runtime.devices import bind_worker_gpu

        bind_worker_gpu(cfg.cluster.ranks_per_node, cfg.cluster.gpus_per_node)
        if cfg.checkpoint.on_signal:  # as early as possible: a signal during start-up
            from pivot_hpc.runtime import stop  # still checkpoints (once the world is up)

            stop.install()
        if cfg.cluster.nodes > 1:
            # pivot_hpc calls MPI from one thread per rank; across nodes without RDMA,
            # OpenMPI 4's fallback one-sided component refuses MPI_THREAD_MULTIPLE windows
            os.environ.setdefault("MPI4PY_RC_THREAD_LEVEL", "serialized")
        # tools: the node's sandbox service, started before MPI initialises (no rank
        # forks after MPI_Init); nothing when tools are disabled (runtime/host_tools.py)
        from pivot_hpc import compile_caches
        from pivot_hpc.runtime.host_tools import start_before_mpi

        compile_caches.install(cfg.models.cache_dir)  # private, before torch compiles
        start_before_mpi(cfg)
        from pivot_hpc.cli.local_world import report_status
        from pivot_hpc.runtime.main import run_in_world

        run_dirs.prepare(run_dir, cfg.checkpoint.private_run_dir)
        return report_status(run_in_world(cfg, run_dir))
    # What the world would refuse, refused here in one line before anything starts.
    from pivot_hpc.cli.local_world import check_world_fits
    from pivot_hpc.runtime.world import check_before_launch

    check_world_fits(cfg)  # before anything is read or written: mpirun -n follows it
    check_before_launch(cfg)
    from pivot_hpc.data.loaders import Columns, usable_problems

    data = cfg.rl.data
    for key in ("train", "validation"):
        path = getattr(data, key)
        if path not in (None, "synthetic"):
            usable_problems(path, f"rl.data.{key}", Columns(data.prompt_key, data.answer_key))
    # The caches every rank loads from, someone else's refused here in one line.
    from pivot_hpc import compile_caches
    from pivot_hpc.models import cache_trust

    cache_trust.check(cfg.models)
    compile_caches.resolved(cache_dir=cfg.models.cache_dir)
    # A checkpoint to resume must be usable (complete, same config, every record within
    # its models) before any rank starts.
    from pivot_hpc.runtime.resume_check import find_resume

    found = find_resume(run_dir, cfg)
    if found is not None:
        print(
            f"pivot-hpc: {run_dir} has checkpoint {found[0].name} (step "
            f"{found[1]['step']}): resuming",
            flush=True,
        )
    from pivot_hpc import interpreter
    from pivot_hpc.cli.local_world import launch

    run_dirs.prepare(run_dir, cfg.checkpoint.private_run_dir)

    # -P: no rank imports a module planted in the working directory (interpreter.py)
    world_argv = interpreter.python("-m", "pivot_hpc", "run", args.config, "--run-dir")
    return launch(cfg, [*world_argv, str(run_dir), "--in-world", *args.overrides], run_dir)
