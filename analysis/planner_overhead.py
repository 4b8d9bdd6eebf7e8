"""Planner time breakdown per cluster size (paper Table 2).

Usage:
    python analysis/planner_overhead.py RUN_DIR [RUN_DIR ...] [--csv table2.csv] [--out table2.png]

Cluster size is each run's root attribute `gpus`; the `planner` rows of all runs with the
same size are pooled. Printed: mean ± std (population std; milliseconds when all means are under 0.1 s) of pre-processing
(steps 1-2), candidate construction (step 3, Alg. 1), simulation (step 4) and their total,
per planner decision. --csv writes the same table; --out draws stacked mean bars with the
total's std as an error bar.
"""

from __future__ import annotations

import csv

import numpy as np
from _common import load, main_guard, parser, plt, save, table

from pivot_hpc.errors import UsageError
from pivot_hpc.safe_files import open_for_write
from pivot_hpc.telemetry.summary import PLANNER_PHASES, planner_stats

HEADERS = {
    "preprocess": "Pre-processing",
    "construct": "Construction",
    "simulate": "Simulation",
    "total": "Total",
}


def main() -> int:
    p = parser(__doc__, out_required=False)
    p.add_argument("--csv", metavar="CSV", help="also write the table as CSV (seconds)")
    p.add_argument(
        "--unit",
        choices=("auto", "s", "ms"),
        default="auto",
        help="unit of the printed table (auto: ms when every mean total is under 0.1 s)",
    )
    args = p.parse_args()
    pooled: dict[int, list[np.ndarray]] = {}
    for run, _ in load(args.run_dirs):
        gpus = run.attr("gpus")
        if gpus is None:
            raise UsageError(f"{run.path}: no `gpus` root attribute; cluster size unknown")
        pooled.setdefault(int(gpus), []).append(run["planner"])
    sizes = sorted(pooled)
    stats = {g: planner_stats(np.concatenate(pooled[g])) for g in sizes}
    decisions = {g: sum(len(a) for a in pooled[g]) for g in sizes}

    unit = args.unit
    if unit == "auto":
        unit = "ms" if all(stats[g]["total"]["mean"] < 0.1 for g in sizes) else "s"
    k = 1e3 if unit == "ms" else 1.0
    rows = [["GPUs", "decisions", *(f"{HEADERS[ph]} ({unit})" for ph in PLANNER_PHASES)]]
    for g in sizes:
        cells = [
            f"{k * stats[g][ph]['mean']:.3f} ±{k * stats[g][ph]['std']:.3f}"
            for ph in PLANNER_PHASES
        ]
        rows.append([str(g), str(decisions[g]), *cells])
    print(table(rows))

    if args.csv:
        with open_for_write(args.csv, "w", private=False) as fh:  # never through a link
            w = csv.writer(fh)
            w.writerow(
                ["gpus", "decisions"]
                + [f"{ph}_{k}" for ph in PLANNER_PHASES for k in ("mean", "std")]
            )
            for g in sizes:
                w.writerow(
                    [g, decisions[g]]
                    + [stats[g][ph][k] for ph in PLANNER_PHASES for k in ("mean", "std")]
                )
        print(f"wrote {args.csv}")

    if args.out:
        fig, ax = plt.subplots(figsize=(max(4.0, 1.0 * len(sizes) + 2), 3.4))
        x = np.arange(len(sizes))
        bottom = np.zeros(len(sizes))
        for ph in PLANNER_PHASES[:-1]:
            v = np.nan_to_num([stats[g][ph]["mean"] for g in sizes])
            ax.bar(x, v, bottom=bottom, label=HEADERS[ph])
            bottom += v
        ax.errorbar(
            x,
            bottom,
            yerr=np.nan_to_num([stats[g]["total"]["std"] for g in sizes]),
            fmt="none",
            ecolor="k",
            capsize=4,
        )
        ax.set_xticks(x, [str(g) for g in sizes])
        ax.set_xlabel("GPUs")
        ax.set_ylabel("planner time per decision (s)")
        ax.legend(fontsize=8)
        save(fig, args.out)
    return 0


if __name__ == "__main__":
    main_guard(main)
