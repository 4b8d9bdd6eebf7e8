"""`pivot-hpc bench live [--steps N] --json`: the live tiny run, pivot against the static
deployments, side by side.

Runs `pivot-hpc run CONFIG` (default: the embedded tiny config) once per mode, one after
another on this machine, each for N steps with held-out evaluation off (it pauses the
coordinator and is not part of the throughput), and reads each run's HDF5 telemetry:
end-to-end tokens/s (rollout + reward tokens of the completed steps over their span, the
paper's §8.1 measure), the share of GPU time in transition, shift-ups per step.

JSON keys (a contract): `tokens_per_s` {mode: tokens/s}, `ratio_vs_best_static` (pivot
over the best static mode), `transition_share` (pivot's fraction of GPU-seconds in
transition); also `steps`, `best_static`, and per mode `runs` {strategy, duration_s,
shifts_up, shifts_up_per_step, utilisation, wall_s}. pivot runs the config's planner
strategy (the tiny config's: pivot+; `planner.strategy=pivot` for the paper's).
`--modes …,pivot+elastic` adds pivot with elastic training
(`planner.elastic_training=true`) and `ratio_elastic_vs_best_static`.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

from pivot_hpc.bench.stats import table

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = ROOT / "configs/tiny.yaml"
MODES = ("pivot", "colocated", "disaggregated", "rr_colocated")  # pivot first: the subject
ELASTIC = "pivot+elastic"  # opt-in: pivot mode with planner.elastic_training=true


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=20, help="RL steps per run (default 20)")
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="live config to run")
    p.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"comma-separated deployment modes; pivot and at least one other (default {','.join(MODES)})",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="directory for the runs (one run dir per mode); default a private temp dir",
    )
    p.add_argument("--timeout-s", type=int, default=1800, help="limit per run (seconds)")
    p.add_argument("overrides", nargs="*", help="dotted config overrides for every run")


def _check(args: argparse.Namespace) -> list[str]:
    from pivot_hpc.errors import UsageError

    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in (*MODES, ELASTIC)]
    if bad:
        raise UsageError(f"--modes: unknown {bad}; valid: {', '.join((*MODES, ELASTIC))}")
    if "pivot" not in modes or not set(modes) - {"pivot", ELASTIC}:
        raise UsageError("--modes: needs pivot and at least one static mode to compare with")
    if args.steps < 2:
        raise UsageError(f"--steps {args.steps}: needs at least 2 steps")
    if not args.config.is_file():
        raise UsageError(f"--config {args.config}: no such file")
    return modes


def launch(config: Path, run_dir: Path, overrides: list[str], timeout_s: int) -> float:
    """`pivot-hpc run CONFIG --run-dir RUN_DIR OVERRIDES…`; its output goes to
    RUN_DIR.log beside the run dir; returns the wall seconds. A failed run is one line."""
    from pivot_hpc import interpreter
    from pivot_hpc.errors import UsageError

    cmd = interpreter.python("-m", "pivot_hpc", "run", str(config), "--run-dir", str(run_dir))
    t0 = time.monotonic()
    out = subprocess.run(
        [*cmd, *overrides],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=ROOT,
        env=interpreter.environ(),
    )
    wall = time.monotonic() - t0
    log = run_dir.parent / f"{run_dir.name}.log"
    log.write_text(out.stdout + out.stderr)
    if out.returncode != 0:
        tail = (out.stdout + out.stderr).strip().splitlines()[-5:]
        raise UsageError(f"the run {run_dir} failed (log: {log}):\n" + "\n".join(tail))
    return wall


def run_mode(args: argparse.Namespace, mode: str, run_dir: Path) -> dict:
    """One live run of `mode`; its summary from the telemetry."""
    from pivot_hpc.telemetry import open_run
    from pivot_hpc.telemetry.summary import summarise

    overrides = [f"deployment.mode={mode}", f"loop.steps={args.steps}", "loop.eval_problems=0"]
    if mode == ELASTIC:
        overrides[0:1] = ["deployment.mode=pivot", "planner.elastic_training=true"]
    wall = launch(args.config, run_dir, [*overrides, *args.overrides], args.timeout_s)
    run = open_run(run_dir)
    s = summarise(run)
    return {
        "strategy": run.attr("strategy") or "",  # the planner's, in pivot mode
        "tokens_per_s": s["tokens_per_s"],
        "duration_s": s["duration_s"],
        "shifts_up": s["shifts"],
        "shifts_up_per_step": s["shifts_per_step"],
        "utilisation": s["utilisation"],
        "wall_s": wall,
        "run_dir": str(run_dir),
    }


def out_dir(out: Path | None, prefix: str) -> Path:
    if out is None:
        return Path(tempfile.mkdtemp(prefix=prefix))  # mode 700
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    return out


def run(args: argparse.Namespace) -> dict:
    modes = _check(args)
    root = out_dir(args.out, "pivot-bench-live-")
    runs = {}
    for mode in modes:
        if not args.json:
            print(f"bench live: {mode} ({args.steps} steps) …", flush=True)
        runs[mode] = run_mode(args, mode, root / mode)
    tps = {m: r["tokens_per_s"] for m, r in runs.items()}
    best = max((m for m in modes if m not in ("pivot", ELASTIC)), key=lambda m: tps[m])
    out = {
        "steps": args.steps,
        "tokens_per_s": tps,
        "best_static": best,
        "ratio_vs_best_static": tps["pivot"] / tps[best] if tps[best] > 0 else None,
        "transition_share": runs["pivot"]["utilisation"]["transition"],
        "runs": runs,
        "out": str(root),
    }
    if ELASTIC in tps:
        out["ratio_elastic_vs_best_static"] = tps[ELASTIC] / tps[best] if tps[best] > 0 else None
    if not args.json:
        rows = [["mode", "tokens/s", "shift-ups/step", "transition", "idle", "wall s"]]
        for m, r in runs.items():
            u = r["utilisation"]
            rows.append(
                [
                    m,
                    f"{r['tokens_per_s']:.0f}",
                    f"{r['shifts_up_per_step']:.2f}",
                    f"{u['transition']:.1%}",
                    f"{u['idle']:.1%}",
                    f"{r['wall_s']:.0f}",
                ]
            )
        print(table(rows))
        ratio = out["ratio_vs_best_static"]
        strategy = runs["pivot"]["strategy"]
        print(f"pivot ({strategy}) / best static ({best}): {ratio:.2f}×; runs in {root}")
        if ELASTIC in tps:
            print(f"pivot+elastic / best static: {out['ratio_elastic_vs_best_static']:.2f}×")
    return out
