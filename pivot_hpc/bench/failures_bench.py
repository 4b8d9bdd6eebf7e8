"""`pivot-hpc bench failures --gpus N --steps S --mtbf H --json`: throughput lost to engine
deaths, pivot+ against the static modes (issue 38).

Simulates the paper's group 4 (as `bench sim` does: `configs/groups/group4-…` scaled to N
GPUs, or --config) for S steps in each mode twice: without failures and with every GPU
failing at exponential intervals of mean H simulated hours (`sim.failures`, sim/failures.py).
The deaths of one seed fall at the same times on the same GPUs in every mode; the
coordinator recovers each the same way it does live (a serving replica's sequences move
with their tokens, the replica restarts with `sim.failures.restart_s` more than a shift-up,
or is excluded when it dies again within `deployment.engine_restart_window_s`). pivot+
(elastic training) re-plans around a missing replica; the static modes wait for it.

Only inference engines die unless `--training-deaths` is given (`sim.failures.training`):
then a death on a GPU that training holds restarts the trainer between steps (the next
step waits `restart_s` plus a training shift-up) and stops the job inside a step or within
the restart window of training's last death (the cluster pauses
`sim.failures.job_restart_s`, the step starts over). A run whose step meets a death in
every try (MAX_STALLED_RESTARTS job stops in a row, sim/failures.py) ends early and is
reported `stalled` — at the default stress MTBF every mode does so on group 4, whose step
takes ~700,000 GPU-seconds.

JSON keys (a contract): `runs` → label → {`tokens_per_s` (with failures),
`tokens_per_s_no_failures`, `lost_share` (1 − their ratio), `engine_failures`,
`engine_restarts`, `engines_excluded`, `sequences_recovered`, `tokens_regenerated`,
`deaths_elsewhere` (deaths on GPUs that idled or shifted, and without --training-deaths
on GPUs that trained: not dealt), `training_deaths` (deaths on GPUs training held),
`job_restarts` (of them, the job stops), `stalled` (true: the run ended on JobStalled; its
`tokens_per_s` is then 0), `sim_time_s`, `wall_s`}; and the parameters: `gpus`, `steps`,
`mtbf_gpu_hours`, `restart_s`, `job_restart_s`, `training_deaths_modelled`,
`restart_window_s`, `seed`, `config`. Throughput is rollout + reward tokens of
the trained steps over their span (`simulate`'s `tokens_per_s`); a few steps are noisy, a
loss within a few percent of zero is within it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from pivot_hpc.bench.stats import table

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs/groups/group4-qwen72b-qwen122b.yaml"
# label -> the overrides that make it (pivot+ with elastic training: pivot_hpc's best)
MODES: dict[str, list[str]] = {
    "pivot+": [
        "deployment.mode=pivot",
        "planner.strategy=pivot+",
        "planner.elastic_training=true",
    ],
    "disaggregated": ["deployment.mode=disaggregated"],
    "rr_colocated": ["deployment.mode=rr_colocated"],
    "colocated": ["deployment.mode=colocated"],
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpus", type=int, default=1024, help="cluster size (multiple of 8)")
    p.add_argument("--steps", type=int, default=2, help="RL steps to simulate per run")
    p.add_argument(
        "--mtbf",
        type=float,
        default=10.0,
        help="mean time between failures per GPU, simulated hours (default 10: a stress "
        "setting, thousands of times hardware's rate, so a few steps see enough deaths)",
    )
    p.add_argument(
        "--restart-s", type=float, default=None, help="sim.failures.restart_s (default: config)"
    )
    p.add_argument(
        "--training-deaths",
        action="store_true",
        help="deaths on training's GPUs too (sim.failures.training): a trainer restart "
        "between steps, a job restart inside one; off, only inference engines die (at the "
        "default stress MTBF a large step then meets a death in every try and stalls)",
    )
    p.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES)}")
    p.add_argument("--seed", type=int, default=0, help="workload and failure seed")
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="sim config to scale")
    p.add_argument("--jobs", type=int, default=1, help="simulations run in parallel")
    p.add_argument("overrides", nargs="*", help="dotted config overrides for every run")


def _config(args: argparse.Namespace, label: str, mtbf: float):
    from pivot_hpc.config import validate_tree
    from pivot_hpc.job.config import load_config
    from pivot_hpc.job.simulate import scale_to

    overrides = [
        *MODES[label],
        f"loop.steps={args.steps}",
        f"sim.seed={args.seed}",
        f"sim.failures.mtbf_gpu_hours={mtbf}",
        *([f"sim.failures.restart_s={args.restart_s}"] if args.restart_s is not None else []),
        f"sim.failures.training={str(args.training_deaths).lower()}",
        *args.overrides,
    ]
    cfg = scale_to(load_config(str(args.config), overrides, files=False), args.gpus)
    validate_tree(cfg)
    return cfg


def simulate_failures(cfg) -> dict[str, Any]:
    """Run `cfg` to the end; its throughput and what its engine deaths cost."""
    from pivot_hpc.job import build as builder
    from pivot_hpc.job.sim_backend import SimBackend
    from pivot_hpc.sim.failures import JobStalled

    t0 = time.perf_counter()
    job = builder.build(cfg, SimBackend())
    stalled = False
    with contextlib.redirect_stdout(io.StringIO()):  # a line per death: counted below
        try:
            job.run()
        except JobStalled:  # no step escapes the deaths: the run never ends
            stalled = True
    coord, cluster, stats = job.coordinator, job.cluster, job.coordinator.stats
    span = coord.last_step_end - coord.first_step_start
    return {
        "tokens_per_s": coord.tokens_total / span if span > 0 and not stalled else 0.0,
        "engine_failures": stats.engine_failures,
        "engine_restarts": stats.engine_restarts,
        "engines_excluded": len(stats.excluded),
        "sequences_recovered": stats.sequences_recovered,
        "tokens_regenerated": stats.tokens_regenerated,
        "deaths_elsewhere": cluster.deaths_elsewhere,
        "training_deaths": cluster.training_deaths,
        "job_restarts": cluster.job_restarts,
        "stalled": stalled,
        "sim_time_s": round(cluster.now(), 3),
        "wall_s": round(time.perf_counter() - t0, 3),
    }


def run(args: argparse.Namespace) -> dict:
    labels = [m for m in args.modes.split(",") if m]
    unknown = [m for m in labels if m not in MODES]
    if unknown:
        raise SystemExit(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
    if args.mtbf <= 0:
        raise SystemExit("--mtbf: must be > 0 hours (0 turns failures off)")
    configs = [_config(args, label, m) for label in labels for m in (0.0, args.mtbf)]
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            results = list(pool.map(simulate_failures, configs))
    else:
        results = [simulate_failures(c) for c in configs]
    runs = {}
    for i, label in enumerate(labels):
        off, on = results[2 * i], results[2 * i + 1]
        base = off["tokens_per_s"]
        runs[label] = {
            **on,
            "tokens_per_s_no_failures": base,
            "lost_share": 1.0 - on["tokens_per_s"] / base if base > 0 else 0.0,
            "sim_time_s_no_failures": off["sim_time_s"],
            "wall_s": on["wall_s"] + off["wall_s"],
        }
    cfg = configs[-1]
    out = {
        "gpus": cfg.cluster.total_gpus,
        "steps": args.steps,
        "mtbf_gpu_hours": args.mtbf,
        "restart_s": cfg.sim.failures.restart_s,
        "job_restart_s": cfg.sim.failures.job_restart_s,
        "training_deaths_modelled": cfg.sim.failures.training,
        "restart_window_s": cfg.deployment.engine_restart_window_s,
        "seed": args.seed,
        "config": str(args.config),
        "runs": runs,
    }
    if not args.json:
        print(
            f"{out['gpus']} GPUs, {args.steps} steps, MTBF {args.mtbf:g} GPU-hours, restart "
            f"+{out['restart_s']:g} s"
        )
        rows = [
            [
                "mode",
                "tok/s",
                "no failures",
                "lost",
                "deaths",
                "excluded",
                "regenerated",
                "training deaths",
                "job restarts",
            ]
        ]
        for label, r in runs.items():
            rows.append(
                [
                    label,
                    f"{r['tokens_per_s']:.0f}",
                    f"{r['tokens_per_s_no_failures']:.0f}",
                    f"{100 * r['lost_share']:.1f}%",
                    str(r["engine_failures"]),
                    str(r["engines_excluded"]),
                    str(r["tokens_regenerated"]),
                    str(r["training_deaths"]),
                    str(r["job_restarts"]) + (" (stalled)" if r["stalled"] else ""),
                ]
            )
        print(table(rows))
    return out
