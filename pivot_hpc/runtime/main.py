"""Every rank of the MPI world runs `run_in_world`: layout check, models, GPS, then its part.

world rank 0   coordinator (+ node 0's host): the Coordinator over a LiveCluster
other host     GPS shard (passive: readers pull); runs the coordinator's tool calls in its
               node's sandbox service (runtime/host_tools.py) until the end
workers        serve commands, shift roles, run engines

Any rank that raises brings the whole world down (COMM_WORLD.Abort) with its traceback
printed first — never a hang.

Imports inside functions are deliberate: torch, mpi4py, megatron and transformers load
only after the MPI thread level is set and library noise is routed to the rank's log, and
each rank loads only what its part needs (a host rank never builds an engine).
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

from pivot_hpc.errors import PivotError
from pivot_hpc.job.config import Config
from pivot_hpc.runtime import stop
from pivot_hpc.runtime.library_noise import route_to_log
from pivot_hpc.runtime.world import LayoutError, check_launch, layout


def _state_dict_loader(path: Path):
    """name -> tensor of a saved HF model, memory-mapped tensor by tensor (only host
    ranks call it; models/weights.py)."""
    from pivot_hpc.models.weights import TensorReader

    return TensorReader(path)


def run_in_world(cfg: Config, run_dir: Path) -> int:
    import torch
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    route_to_log(run_dir, comm.Get_rank())
    torch.set_num_threads(1)
    if cfg.checkpoint.on_signal:
        stop.install()
    # Resume: the newest complete checkpoint, checked (files, config) on rank 0 before any
    # rank starts work; a bad one ends every rank with the same clear message.
    resume = problem = None
    if comm.Get_rank() == 0:
        try:
            resume = _find_resume(cfg, run_dir)
        except PivotError as e:
            problem = str(e)
    resume, problem = comm.bcast((resume, problem), root=0)
    if problem is not None:
        if comm.Get_rank() == 0:
            print(f"pivot-hpc: error: {problem}", file=sys.stderr, flush=True)
        return 2
    try:  # what every rank refuses alike (the same config, the places all ranks gathered)
        check_launch(cfg, comm.Get_size())
        lay = layout(comm, cfg)
    except LayoutError as e:
        if comm.Get_rank() == 0:
            print(f"pivot-hpc: error: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        dirs = None
        if lay.is_coordinator:
            from pivot_hpc.recipes.tiny_models import ensure_models

            dirs = ensure_models(cfg.models, progress=True)
        dirs = comm.bcast(dirs, root=0)
        from pivot_hpc.runtime.training_world import rendezvous

        rendezvous(comm, cfg, run_dir)
        from pivot_hpc.gps import GlobalParameterStorage, ModelSpec
        from pivot_hpc.runtime.training_world import run_optimizer_models

        policy = ModelSpec.from_dir(dirs[0], name="policy")
        gps = GlobalParameterStorage(
            comm,
            cfg.gps,
            models={
                "policy": policy,
                "genrm": ModelSpec.from_dir(dirs[1], name="genrm"),
                # elastic training: the optimizer state joining replicas read
                **run_optimizer_models(cfg, policy),
            },
            read_only=["genrm"],
        )
        if resume is None:
            gps.load("policy", _state_dict_loader(Path(dirs[0])), version=0)
        else:  # the checkpoint's policy, at its version
            path, step = resume
            gps.load("policy", _state_dict_loader(Path(path) / "policy"), version=step)
        gps.load("genrm", _state_dict_loader(Path(dirs[1])), version=0)
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        comm.Abort(1)
    try:
        if lay.is_coordinator:
            code = _coordinate(comm, lay, cfg, run_dir, dirs, gps, resume)
        elif lay.is_host:  # its GPS shard is passive; it runs tool calls when enabled
            from pivot_hpc.runtime.host_tools import serve_host

            code = serve_host(comm, cfg)
        else:
            from pivot_hpc.runtime.training_world import TrainingWorld
            from pivot_hpc.runtime.worker import Worker

            world = TrainingWorld.of(cfg, lay.rank_of_gpu)
            worker = Worker(comm, gps, cfg, dirs[0], dirs[1], world)
            worker.yield_to_coordinator()
            worker.prepare()
            code = worker.serve()
    except Exception:
        if lay.is_coordinator:
            print(f"pivot-hpc: run failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            comm.Abort(1)
        from pivot_hpc.runtime.worker import report_error

        report_error(comm)
    gps.close()
    return code


def _find_resume(cfg: Config, run_dir: Path) -> tuple[str, int] | None:
    from pivot_hpc.runtime.resume_check import find_resume

    found = find_resume(run_dir, cfg)  # complete, same config, every record usable
    if found is None:
        return None
    path, manifest = found
    return str(path), int(manifest["step"])


def _coordinate(comm, lay, cfg: Config, run_dir: Path, dirs, gps, resume) -> int:
    from pivot_hpc.job.build import build
    from pivot_hpc.runtime.live_job import LiveBackend, finish

    job = build(cfg, LiveBackend(comm, lay, run_dir, dirs, gps, resume))
    job.run()
    return finish(job, run_dir)
