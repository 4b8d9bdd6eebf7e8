"""`pivot-hpc bench convergence [--seeds K] [--steps N] --json`: Figure 15 on our own runs.

Runs the embedded default (`configs/tiny.yaml`, or --config) in pivot, colocated and
disaggregated mode for K seeds each (`rl.trainer.seed` = 0..K-1: sampling and training
randomness; the models and the data stay the same), one run after another, then draws
held-out accuracy and the moving-average training reward against RL step and wall-clock
time (`analysis/convergence.py`) into OUT/convergence.png.

JSON keys (a contract): `modes` → mode → {`accuracy_first`, `accuracy_last`,
`accuracy_last_std`, `wall_s`} (means over seeds; std: population std over seeds); also
`accuracy_gain_min` per mode (the smallest first→last gain of any seed), `runs` (one entry
per run) and `figure`.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np

from pivot_hpc.bench.live_bench import DEFAULT_CONFIG, ROOT, launch, out_dir
from pivot_hpc.bench.stats import table

MODES = ("pivot", "colocated", "disaggregated")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seeds", type=int, default=3, help="seeds per mode (default 3)")
    p.add_argument("--steps", type=int, default=None, help="RL steps (default: the config's)")
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="live config to run")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated modes")
    p.add_argument("--out", type=Path, default=None, help="directory for runs and figure")
    p.add_argument("--timeout-s", type=int, default=3600, help="limit per run (seconds)")
    p.add_argument("overrides", nargs="*", help="dotted config overrides for every run")


def run(args: argparse.Namespace) -> dict:
    from pivot_hpc.errors import UsageError
    from pivot_hpc.telemetry import open_run
    from pivot_hpc.telemetry.convergence import curves

    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        raise UsageError(f"--modes {args.modes}: choose from {', '.join(MODES)}")
    if args.seeds < 1:
        raise UsageError(f"--seeds {args.seeds}: must be >= 1")
    if not args.config.is_file():
        raise UsageError(f"--config {args.config}: no such file")
    root = out_dir(args.out, "pivot-bench-convergence-")
    steps = [] if args.steps is None else [f"loop.steps={args.steps}"]
    runs, dirs = [], []
    for mode in modes:
        for seed in range(args.seeds):
            d = root / f"{mode}-seed{seed}"
            if not args.json:
                print(f"bench convergence: {mode}, seed {seed} …", flush=True)
            over = [f"deployment.mode={mode}", f"rl.trainer.seed={seed}", *steps]
            launch(args.config, d, [*over, *args.overrides], args.timeout_s)
            c = curves(open_run(d))
            if c.accuracy_first is None:
                raise UsageError(f"{d}: no held-out evaluation (set loop.eval_problems > 0)")
            runs.append(
                {
                    "mode": mode,
                    "seed": seed,
                    "accuracy_first": c.accuracy_first,
                    "accuracy_last": c.accuracy_last,
                    "reward_ma_last": float(c.reward_ma[-1]) if len(c.reward_ma) else None,
                    "wall_s": c.wall_s,
                    "run_dir": str(d),
                }
            )
            dirs.append(str(d))
    per_mode = {}
    for mode in modes:
        mine = [r for r in runs if r["mode"] == mode]
        last = np.array([r["accuracy_last"] for r in mine])
        first = np.array([r["accuracy_first"] for r in mine])
        per_mode[mode] = {
            "accuracy_first": float(first.mean()),
            "accuracy_last": float(last.mean()),
            "accuracy_last_std": float(last.std()),
            "accuracy_gain_min": float((last - first).min()),
            "wall_s": float(np.mean([r["wall_s"] for r in mine])),
        }
    figure = root / "convergence.png"
    plot = subprocess.run(
        [sys.executable, str(ROOT / "analysis/convergence.py"), *dirs, "--out", str(figure)],
        capture_output=True,
        text=True,
    )
    out = {
        "modes": per_mode,
        "seeds": args.seeds,
        "runs": runs,
        "figure": str(figure) if plot.returncode == 0 else None,
        "out": str(root),
    }
    if not args.json:
        rows = [["mode", "acc first", "acc last", "± (std)", "min gain", "wall s"]]
        for m, v in per_mode.items():
            rows.append(
                [
                    m,
                    f"{v['accuracy_first']:.3f}",
                    f"{v['accuracy_last']:.3f}",
                    f"{v['accuracy_last_std']:.3f}",
                    f"{v['accuracy_gain_min']:+.3f}",
                    f"{v['wall_s']:.0f}",
                ]
            )
        print(table(rows))
        print(f"figure: {out['figure'] or 'not drawn: ' + plot.stderr.strip()[-200:]}")
    return out
