"""Every rank of the MPI world runs `run_in_world`: layout check, models, GPS, then its part.

world rank 0   coordinator (+ node 0's host): the Coordinator over a LiveCluster
other host     GPS shard only (passive: readers pull); waits for the end
workers        serve commands, shift roles, run engines

Any rank that raises brings the whole world down (COMM_WORLD.Abort) with its traceback
printed first — never a hang.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import traceback
from pathlib import Path

from pivot_hpc.config import Config, to_dict


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _state_dict_loader(path: Path):
    """name -> tensor of a saved HF model (read once, only on host ranks that ask)."""
    cache: dict = {}

    def get(name: str):
        if not cache:
            from safetensors.torch import load_file

            for f in sorted(path.glob("*.safetensors")):
                cache.update(load_file(str(f)))
        return cache[name]

    return get


def run_in_world(cfg: Config, run_dir: Path) -> int:
    import torch
    from mpi4py import MPI

    from pivot_hpc.runtime.world import check_launch, layout

    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    try:
        check_launch(cfg, comm.Get_size())
        lay = layout(comm, cfg)
        dirs = None
        if lay.is_coordinator:
            from pivot_hpc.models.zoo import ensure_models

            dirs = ensure_models(cfg.models, progress=True)
        dirs = comm.bcast(dirs, root=0)
        os.environ["MASTER_PORT"] = str(comm.bcast(_free_port() if lay.rank == 0 else None))
        from pivot_hpc.gps import GlobalParameterStorage, ModelSpec

        gps = GlobalParameterStorage(
            comm,
            cfg.gps,
            models={
                "policy": ModelSpec.from_hf_config(dirs[0], name="policy"),
                "genrm": ModelSpec.from_hf_config(dirs[1], name="genrm"),
            },
            read_only=["genrm"],
        )
        gps.load("policy", _state_dict_loader(Path(dirs[0])), version=0)
        gps.load("genrm", _state_dict_loader(Path(dirs[1])), version=0)
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        comm.Abort(1)
    try:
        if lay.is_coordinator:
            code = _coordinate(comm, lay, cfg, run_dir, dirs)
        elif lay.is_host:
            _wait_for_stop(comm)
            code = 0
        else:
            from pivot_hpc.planner import Topology

            training = [lay.rank_of_gpu(g) for g in Topology.from_config(cfg).training_gpus]
            from pivot_hpc.runtime.worker import Worker

            worker = Worker(comm, gps, cfg, dirs[0], dirs[1], training)
            worker.prepare()
            worker.serve()
            code = 0
    except Exception:
        if lay.is_coordinator:
            print(f"pivot-hpc: run failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            comm.Abort(1)
        from pivot_hpc.runtime.worker import report_error

        report_error(comm)
    gps.close()
    return code


def use_profiles(cfg: Config, dirs) -> None:
    """Throughput constants for the schedulers: the engine/model profile if one exists
    (`pivot-hpc profile` writes it), else a brief profile now, cached for the next run."""
    from pivot_hpc.engines.profile import apply_profiles, fit_samples, sweep, write_profile
    from pivot_hpc.models.config import cache_root
    from pivot_hpc.models.zoo import load_model

    for role, path_dir, name in (("rollout", dirs[0], "policy"), ("reward", dirs[1], "genrm")):
        ec = getattr(cfg.engines, role)
        if ec.throughput_profile is not None:
            continue
        path = cache_root(cfg.models.cache_dir) / "profiles" / f"hf-{Path(path_dir).name}.yaml"
        if not path.is_file():
            t0 = time.monotonic()
            model, _ = load_model(path_dir)
            result = fit_samples(sweep(model, [1, 4, 16], [16, 64], steps=3))
            write_profile(path, result, engine="hf", model=name, role=role)
            print(
                f"pivot-hpc: profiled hf/{name} in {time.monotonic() - t0:.1f}s: "
                f"{result.fit.summary()}",
                flush=True,
            )
        ec.throughput_profile = path
    apply_profiles(cfg)


def _wait_for_stop(comm) -> None:
    from pivot_hpc.runtime.protocol import CMD

    while not comm.Iprobe(source=0, tag=CMD):
        time.sleep(0.05)
    comm.recv(source=0, tag=CMD)


def _coordinate(comm, lay, cfg: Config, run_dir: Path, dirs) -> int:
    from pivot_hpc.coordinator.coordinator import Coordinator
    from pivot_hpc.coordinator.modes import make_mode
    from pivot_hpc.coordinator.rl_state import RLState
    from pivot_hpc.data.arithmetic import problems
    from pivot_hpc.models.tokenizer import load_tokenizer
    from pivot_hpc.planner import Topology
    from pivot_hpc.runtime.live_cluster import LiveCluster
    from pivot_hpc.runtime.live_samples import LiveSamples
    from pivot_hpc.telemetry import TelemetryWriter

    use_profiles(cfg, dirs)
    topology = Topology.from_config(cfg, vanilla=cfg.planner.strategy == "vanilla")
    tok = load_tokenizer(dirs[0])
    data = cfg.rl.data
    if data.train == "synthetic":
        pool = problems(4096, seed=data.synthetic_seed, max_digits=cfg.models.max_digits)
    else:
        from pivot_hpc.data.loaders import load_problems

        pool, report = load_problems(data.train)
        print(f"pivot-hpc: {report}", flush=True)
    samples = LiveSamples(pool, tok, cfg.rl, seed=data.synthetic_seed)
    cluster = LiveCluster(comm, lay, topology, samples)
    mode = make_mode(cfg, list(topology.training_gpus))
    rl = RLState(
        steps=cfg.loop.steps,
        batch_prompts=cfg.loop.batch_prompts,
        samples_per_prompt=cfg.loop.samples_per_prompt,
        staleness=cfg.deployment.effective_staleness(),
        source=samples,
    )
    meta = {
        "mode": cfg.deployment.mode,
        "strategy": cfg.planner.strategy if cfg.deployment.mode == "pivot" else "",
        "gpus": cfg.cluster.total_gpus,
        "simulated": False,
        "horizon_s": cfg.planner.horizon_s,
        "config": to_dict(cfg),
    }
    writer = TelemetryWriter(run_dir, meta=meta)
    coord = Coordinator(
        cluster=cluster,
        topology=topology,
        rl=rl,
        mode=mode,
        capacity={r: getattr(cfg, r).kv_capacity_tokens for r in ("rollout", "reward")},
        rewarder=samples.reward,
        telemetry=writer,
        tick_s=cfg.loop.monitor_interval_s,
        priority=cfg.scheduler.priority,
        migration=cfg.scheduler.migration and cfg.planner.strategy != "vanilla",
    )
    started = time.monotonic()

    def log_step(step: int, m: dict) -> None:
        a = coord.allocation()
        ro, rm = coord.schedulers["rollout"], coord.schedulers["reward"]
        span = max(m["t"] - m["start"], 1e-9)
        print(
            f"step {step + 1}/{cfg.loop.steps}  t={m['t']:.1f}s  "
            f"rollout {m['rollout_tokens'] / span:.0f} tok/s "
            f"reward {m['reward_tokens'] / span:.0f} tok/s  "
            f"alloc RO={a['rollout']} RM={a['reward']} TR={a['training']}  "
            f"reward={m['reward']:.3f} loss={m.get('loss', float('nan')):.4f}  "
            f"shifts={coord.stats.shifts_up} queued={ro.n_queued}+{rm.n_queued}",
            flush=True,
        )

    coord.on_step = log_step
    try:
        coord.run()
    finally:
        writer.close()
    cluster.stop()
    wall = time.monotonic() - started
    r = coord.stats.rewards
    print(
        f"pivot-hpc: done: {cfg.loop.steps} steps in {wall:.1f}s, "
        f"{coord.tokens_total / max(coord.last_step_end - coord.first_step_start, 1e-9):.0f} "
        f"tokens/s (rollout+reward), {coord.stats.shifts_up} shift-ups, reward "
        f"{r[0]:.3f} → {r[-1]:.3f}; GenRM unparsable {samples.genrm_stats.unparsable}/"
        f"{samples.genrm_stats.judged}; telemetry in {writer.path}",
        flush=True,
    )
    return 0
