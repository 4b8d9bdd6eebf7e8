"""`pivot-hpc bench planner --gpus N`: wall time of a full planner decision (Table 2).

Builds realistic mid-step snapshots of an N-GPU cluster (pivot_hpc.bench.workload; one
per seed, so the decisions vary), runs the five-step planner on each `--repeat` times
after one warm-up (compilation of the scheduler loops is excluded), and reports the
median and p90 per decision and of each step.
"""

from __future__ import annotations

import argparse
import time

from pivot_hpc.bench.stats import percentiles_ms, table
from pivot_hpc.bench.workload import realistic_snapshot
from pivot_hpc.planner import make_strategy
from pivot_hpc.planner.config import PlannerConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpus", type=int, default=128, help="cluster size (multiple of 8)")
    p.add_argument("--snapshots", type=int, default=5, help="distinct snapshots (seeds)")
    p.add_argument("--repeat", type=int, default=5, help="decisions timed per snapshot")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--strategy", default="pivot", choices=["pivot", "pivot+", "vanilla", "static", "rule"]
    )


def run(args: argparse.Namespace) -> dict:
    strategy = make_strategy(PlannerConfig(strategy=args.strategy))
    total, pre, cons, sim = [], [], [], []
    candidates, shifted = [], 0
    sequences = 0
    for s in range(args.snapshots):
        snap = realistic_snapshot(args.gpus, seed=args.seed + s)
        sequences = max(sequences, sum(snap.n_seq(r) for r in ("rollout", "reward")))
        strategy.plan(snap)  # warm-up (JIT compile on first use, caches)
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            plan = strategy.plan(snap)
            total.append(time.perf_counter() - t0)
            pre.append(plan.timings.preprocess_s)
            cons.append(plan.timings.construct_s)
            sim.append(plan.timings.simulate_s)
        candidates.append(len(plan.candidates))
        shifted += not plan.is_noop
    out = {
        "gpus": args.gpus,
        **percentiles_ms(total),
        "preprocess": percentiles_ms(pre),
        "construct": percentiles_ms(cons),
        "simulate": percentiles_ms(sim),
        "decisions": len(total),
        "candidates_simulated_max": max(candidates),
        "snapshots_that_shift": shifted,
        "sequences_max": sequences,
        "strategy": args.strategy,
    }
    if not args.json:
        rows = [["step", "median ms", "p90 ms"]]
        for name in ("preprocess", "construct", "simulate"):
            rows.append([name, f"{out[name]['median_ms']:.2f}", f"{out[name]['p90_ms']:.2f}"])
        rows.append(["total", f"{out['median_ms']:.2f}", f"{out['p90_ms']:.2f}"])
        print(
            f"planner ({args.strategy}) on {args.gpus} GPUs, {len(total)} decisions, "
            f"≤{sequences} sequences, ≤{max(candidates)} candidates simulated"
        )
        print(table(rows))
    return out
