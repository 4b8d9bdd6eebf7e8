"""`pivot-hpc bench migration --gpus N`: time of shift-time sequence migration (Table 3).

On realistic N-GPU snapshots, each trial copies a role's scheduler and times one shift of
4 GPUs' worth of replicas (one 4-GPU reward replica, or four 1-GPU rollout replicas):
shift down (Alg. 3: abort all, re-dispatch) and shift up (Alg. 4: dispatch the queue,
migrate while the aggregate throughput improves), with the abort / dispatch / migrate
breakdown. Copying the state is not timed.
"""

from __future__ import annotations

import argparse
import time

from pivot_hpc.bench.stats import percentiles_ms, table
from pivot_hpc.bench.workload import realistic_snapshot
from pivot_hpc.planner.snapshot import replica_id


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpus", type=int, default=128, help="cluster size (multiple of 8)")
    p.add_argument("--snapshots", type=int, default=5, help="distinct snapshots (seeds)")
    p.add_argument("--repeat", type=int, default=3, help="trials per snapshot, role and kind")
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> dict:
    times: dict[str, list[float]] = {"down": [], "up": []}
    parts: dict[str, list[float]] = {"abort": [], "dispatch": [], "migrate": []}
    moved = []
    sequences = 0
    for s in range(args.snapshots):
        snap = realistic_snapshot(args.gpus, seed=args.seed + s)
        for role in ("rollout", "reward"):
            sched = snap.schedulers[role]
            spec = snap.topology.roles[role]
            sequences = max(sequences, sched.n_seq)
            per = max(1, 4 // spec.tp)
            busiest = sorted(sched.replicas, key=lambda r: -sched.replica(r).n_seq)[:per]
            idle = [
                replica_id(role, sl)
                for sl in sorted(spec.slots)
                if replica_id(role, sl) not in sched.replicas
            ][:per]
            for rep in range(args.repeat + 1):
                for kind in ("down", "up"):
                    c = sched.clone()
                    t0 = time.perf_counter()
                    if kind == "down":
                        res = c.shift_down(busiest)
                    else:
                        res = c.shift_up([(r, spec.kv_capacity, spec.model) for r in idle])
                    dt = time.perf_counter() - t0
                    if rep == 0:
                        continue  # warm-up: compile, caches
                    times[kind].append(dt)
                    parts["abort"].append(res.abort_s)
                    parts["dispatch"].append(res.dispatch_s)
                    parts["migrate"].append(res.migrate_s)
                    moved.append(len(res.dispatched))
    all_times = times["down"] + times["up"]
    out = {
        "gpus": args.gpus,
        **percentiles_ms(all_times),
        "sequences": sequences,
        "shift_down": percentiles_ms(times["down"]),
        "shift_up": percentiles_ms(times["up"]),
        "abort": percentiles_ms(parts["abort"]),
        "dispatch": percentiles_ms(parts["dispatch"]),
        "migrate": percentiles_ms(parts["migrate"]),
        "sequences_moved_max": max(moved),
        "migrations": len(all_times),
    }
    if not args.json:
        print(
            f"migration on {args.gpus} GPUs: {len(all_times)} shifts, ≤{sequences} sequences "
            f"per role, ≤{max(moved)} moved per shift"
        )
        rows = [["part", "median ms", "p90 ms"]]
        for name in ("shift_down", "shift_up", "abort", "dispatch", "migrate"):
            rows.append([name, f"{out[name]['median_ms']:.3f}", f"{out[name]['p90_ms']:.3f}"])
        rows.append(["per shift", f"{out['median_ms']:.3f}", f"{out['p90_ms']:.3f}"])
        print(table(rows))
    return out
