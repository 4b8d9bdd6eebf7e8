"""`pivot-hpc bench sim --gpus N --steps S`: wall time of a simulation at scale.

Simulates the paper's group 4 (Qwen2.5-72B + Qwen3.5-122B-A10B, `configs/groups/group4-…`)
scaled to N GPUs (allocations and batch proportional, `pivot-hpc simulate --gpus`) in
pivot mode for S steps, without telemetry, on one core, and reports the wall time and the
number of cluster events the coordinator handled. The scheduler's compiled loops are
compiled once before the clock starts.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from pivot_hpc.bench.stats import table

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs/groups/group4-qwen72b-qwen122b.yaml"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpus", type=int, default=1024, help="cluster size (multiple of 8)")
    p.add_argument("--steps", type=int, default=2, help="RL steps to simulate")
    p.add_argument(
        "--mode", default="pivot", choices=["colocated", "disaggregated", "rr_colocated", "pivot"]
    )
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="sim config to scale")


def run(args: argparse.Namespace) -> dict:
    from pivot_hpc.config import validate_tree
    from pivot_hpc.job.config import load_config
    from pivot_hpc.job.simulate import scale_to, simulate

    warm = load_config(
        str(args.config), [f"deployment.mode={args.mode}", "loop.steps=1"], files=False
    )
    simulate(scale_to(warm, 64), None, progress=False)  # compile the scheduler loops
    cfg = load_config(
        str(args.config), [f"deployment.mode={args.mode}", f"loop.steps={args.steps}"], files=False
    )
    cfg = scale_to(cfg, args.gpus)
    validate_tree(cfg)
    t0 = time.perf_counter()
    summary = simulate(cfg, None, progress=False)
    wall = time.perf_counter() - t0
    out = {
        "gpus": args.gpus,
        "steps": args.steps,
        "mode": args.mode,
        "wall_s": wall,
        "events": summary["events"],
        "plans": summary["plans"],
        "sim_time_s": summary["sim_time_s"],
        "tokens_per_s": summary["tokens_per_s"],
        "events_per_wall_s": summary["events"] / wall if wall > 0 else 0.0,
    }
    if not args.json:
        rows = [["gpus", "steps", "wall s", "events", "plans", "simulated s"]]
        rows.append(
            [
                str(args.gpus),
                str(args.steps),
                f"{wall:.1f}",
                str(out["events"]),
                str(out["plans"]),
                f"{out['sim_time_s']:.0f}",
            ]
        )
        print(table(rows))
    return out
