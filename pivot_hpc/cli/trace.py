"""`pivot-hpc trace RUN_DIR [--out trace.json]`: the run's telemetry as a Perfetto trace.

One track per GPU with the role it holds and its shift phases, the RL steps, planner
decisions that shifted, migrations, and per-role throughput counters; with tool calls, a
slice per call over its trajectory's parked wait and a counter of parked trajectories
(`pivot_hpc/telemetry/trace.py`). Open the file at https://ui.perfetto.dev (offline: the
Perfetto UI can be served locally) or chrome://tracing.
"""

from __future__ import annotations

import argparse
import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pivot_hpc.errors import UsageError

if TYPE_CHECKING:
    from pivot_hpc.job.config import Config
    from pivot_hpc.telemetry import Run

# The trace has a track per GPU; a saved config is the run directory's (maybe someone
# else's) text, and one claiming 10^7 GPUs per node would build tens of millions of
# tracks. Far above any cluster pivot_hpc runs on.
MAX_TRACE_GPUS = 65_536


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a run directory (RUN_DIR/telemetry/alloc-NNN.h5)")
    p.add_argument("--out", default=None, help="trace file (default RUN_DIR/trace.json)")


def run(args: argparse.Namespace) -> int:
    from pivot_hpc.safe_files import open_for_write
    from pivot_hpc.telemetry import open_run
    from pivot_hpc.telemetry.trace import MAX_TOOL_LANES, build

    run_dir = Path(args.run_dir)
    r = open_run(run_dir)
    cfg = _saved_config(run_dir, r)
    n = cfg.cluster.total_gpus
    trace = build(r, _gpu_map(run_dir, cfg), n, cfg.cluster.gpus_per_node)
    out = Path(args.out) if args.out else run_dir / "trace.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    # Never through a link planted at the path (the run directory may be someone else's);
    # inside the run directory the trace is private like the rest of it, a file the user
    # names with --out gets the umask's mode as usual.
    with open_for_write(out, "w", private=args.out is None) as fh:
        fh.write(json.dumps(trace))
    kinds: dict[str, int] = {}
    for ev in trace["traceEvents"]:
        kinds[ev.get("cat", "meta")] = kinds.get(ev.get("cat", "meta"), 0) + 1
    shown = ", ".join(f"{v} {k}" for k, v in sorted(kinds.items()) if k != "meta")
    not_drawn = trace["otherData"].get("tool_calls_not_drawn", 0)
    if not_drawn:
        shown += f"; {not_drawn} tool calls not drawn: all {MAX_TOOL_LANES} lanes busy, or no time"
    print(f"pivot-hpc: wrote {out} ({shown}); open it at https://ui.perfetto.dev")
    return 0


def _saved_config(run_dir: Path, r: Run) -> Config:
    """The run's config from its telemetry, refused in one line if it does not load or
    names more GPUs than a trace can show (checked before anything is sized by it)."""
    from pivot_hpc.config import from_dict, validate_tree
    from pivot_hpc.config.loader import ConfigError, migrate_moved
    from pivot_hpc.job.config import Config
    from pivot_hpc.telemetry.errors import printable

    try:
        saved = copy.deepcopy(r.config)
        migrate_moved(saved, Config)  # a run from before keys moved (issue 34)
        cfg = from_dict(Config, saved)
        # (from_dict has checked both are integers)
        if cfg.cluster.nodes * cfg.cluster.gpus_per_node > MAX_TRACE_GPUS:
            raise ConfigError(
                f"cluster.nodes × cluster.gpus_per_node is more than the {MAX_TRACE_GPUS} "
                "GPUs a trace shows"
            )
        validate_tree(cfg)
    except ConfigError as exc:
        why = printable(f"{run_dir}: the telemetry's saved config does not load ({exc})")
        raise UsageError(why) from None
    return cfg


def _gpu_map(run_dir: Path, cfg: Config) -> Callable[[str, int], tuple[int, ...]]:
    """gpus_of(replica, gpus) for telemetry/trace.build, from the saved config's topology;
    a shift row naming no replica of it is refused in one line."""
    from pivot_hpc.job.build import configured_topology
    from pivot_hpc.planner.snapshot import TRAINING, SnapshotError
    from pivot_hpc.telemetry import TelemetryError

    topo = configured_topology(cfg)
    n = cfg.cluster.total_gpus

    def refuse(rid: str, why: Any) -> TelemetryError:
        return TelemetryError(f"{run_dir}: a shift row of replica {rid!r}: {why}")

    def gpus_of(rid: str, count: int) -> tuple[int, ...]:
        if rid == TRAINING and count != len(topo.training_gpus):
            if not 0 <= count <= n:
                raise refuse(rid, f"moves {count} GPUs, the run has {n}")
            return tuple(range(n - count, n))  # runs from before colocated trained on all
        if rid != TRAINING and ":" not in rid:
            raise refuse(rid, "not a replica id (ROLE:SLOT)")
        try:
            return topo.gpus_of(rid)
        except SnapshotError as exc:
            raise refuse(rid, exc) from None

    return gpus_of
