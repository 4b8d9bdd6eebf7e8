"""`pivot-hpc simulate CONFIG --mode MODE --out DIR`: a deployment on a simulated cluster.

The production coordinator, schedulers and planner drive a discrete-event cluster whose
replicas follow the throughput model and whose shift and training times come from
hardware and model sizes (pivot_hpc/sim/catalog.py). Writes the same HDF5 telemetry as a
live run; `pivot-hpc report DIR` and the analysis/ scripts read it.
"""

from __future__ import annotations

import argparse
import json

from pivot_hpc.config import validate_tree
from pivot_hpc.job.config import load_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "config", help="YAML run config (e.g. configs/groups/group2-qwen7b-qwen30b.yaml)"
    )
    p.add_argument(
        "--mode",
        choices=["colocated", "disaggregated", "rr_colocated", "pivot"],
        help="deployment (default: the config's deployment.mode)",
    )
    p.add_argument(
        "--strategy",
        choices=["pivot", "pivot+", "static", "rule", "vanilla"],
        help="planner strategy in pivot mode (default: the config's)",
    )
    p.add_argument("--gpus", type=int, help="scale the cluster, allocations and batch to N GPUs")
    p.add_argument("--steps", type=int, help="RL steps to simulate")
    p.add_argument("--seed", type=int, help="workload seed")
    p.add_argument("--out", required=True, help="run directory for telemetry")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. planner.horizon_s=120")


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def run(args: argparse.Namespace) -> int:
    from pivot_hpc.job.simulate import scale_to, simulate

    overrides = list(args.overrides)
    if args.mode:
        overrides.append(f"deployment.mode={args.mode}")
    if args.strategy:
        overrides.append(f"planner.strategy={args.strategy}")
    if args.steps is not None:
        overrides.append(f"loop.steps={args.steps}")
    if args.seed is not None:
        overrides.append(f"sim.seed={args.seed}")
    cfg = load_config(args.config, overrides, files=False)  # no weights or data read
    if args.gpus is not None:
        cfg = scale_to(cfg, args.gpus)
        validate_tree(cfg)
    summary = simulate(cfg, args.out, progress=not args.no_progress and not args.json)
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    else:
        print(
            f"{summary['mode']}{'/' + summary['strategy'] if summary['strategy'] else ''} on "
            f"{summary['gpus']} GPUs: {summary['steps']} steps in {summary['sim_time_s']:.0f} "
            f"simulated s, {summary['tokens_per_s']:.0f} tokens/s end to end, "
            f"{_num(summary['tokens_per_s_steady'])} steady "
            f"({_num(summary['tokens_per_s_steady_made'])} of work while the pipeline runs "
            "full), "
            f"{_num(summary['tokens_per_s_bound'])} work-conserving bound, "
            f"{_num(summary['tokens_per_s_critical_path'])} critical-path bound, "
            f"{summary['shifts']} shifts "
            f"({summary['wall_s']:.1f} s wall); telemetry in {args.out}/telemetry/"
        )
    return 0
