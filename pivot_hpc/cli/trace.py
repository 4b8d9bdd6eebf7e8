"""`pivot-hpc trace RUN_DIR [--out trace.json]`: the run's telemetry as a Perfetto trace.

One track per GPU with the role it holds and its shift phases, the RL steps, planner
decisions that shifted, migrations, and per-role throughput counters
(`pivot_hpc/telemetry/trace.py`). Open the file at https://ui.perfetto.dev (offline: the
Perfetto UI can be served locally) or chrome://tracing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pivot_hpc.errors import UsageError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a run directory (RUN_DIR/telemetry/alloc-NNN.h5)")
    p.add_argument("--out", default=None, help="trace file (default RUN_DIR/trace.json)")


def run(args: argparse.Namespace) -> int:
    from pivot_hpc.config import Config, from_dict, validate_tree
    from pivot_hpc.config.loader import ConfigError
    from pivot_hpc.coordinator.build import configured_topology
    from pivot_hpc.planner.snapshot import TRAINING
    from pivot_hpc.telemetry import open_run
    from pivot_hpc.telemetry.trace import build

    run_dir = Path(args.run_dir)
    r = open_run(run_dir)
    try:
        cfg = from_dict(Config, r.config)
        validate_tree(cfg)
    except ConfigError as exc:
        raise UsageError(f"{run_dir}: the telemetry's saved config does not load ({exc})") from None
    topo = configured_topology(cfg)
    n = cfg.cluster.total_gpus

    def gpus_of(rid: str, count: int) -> tuple[int, ...]:
        if rid == TRAINING and count != len(topo.training_gpus):
            return tuple(range(n - count, n))  # runs from before colocated trained on all
        return topo.gpus_of(rid)

    trace = build(r, gpus_of, n, cfg.cluster.gpus_per_node)
    out = Path(args.out) if args.out else run_dir / "trace.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(trace))
    kinds: dict[str, int] = {}
    for ev in trace["traceEvents"]:
        kinds[ev.get("cat", "meta")] = kinds.get(ev.get("cat", "meta"), 0) + 1
    shown = ", ".join(f"{v} {k}" for k, v in sorted(kinds.items()) if k != "meta")
    print(f"pivot-hpc: wrote {out} ({shown}); open it at https://ui.perfetto.dev")
    return 0
