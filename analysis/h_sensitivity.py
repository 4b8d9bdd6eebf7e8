"""Throughput and shifts per step versus the planner horizon H (paper Figure 14).

Usage:
    python analysis/h_sensitivity.py RUN_DIR [RUN_DIR ...] --out fig14.png

H of a run is its root attribute `horizon_s` (else `config["planner"]["horizon_s"]`).
Runs with the same H are averaged (error bars: standard deviation). Shifts per step counts
`shifts` rows of kind "up" divided by completed steps. The x axis is logarithmic (symlog
when some H is 0), as the paper sweeps H from 0.01 to 600 s.
"""

from __future__ import annotations

import numpy as np
from _common import load, main_guard, mean_std, parser, plt, save, table

from pivot_hpc.errors import UsageError
from pivot_hpc.telemetry import Run


def horizon(run: Run) -> float:
    h = run.attr("horizon_s")  # the reader checked it is a number
    if h is None:
        planner = run.config.get("planner")
        h = planner.get("horizon_s") if isinstance(planner, dict) else None
    if h is None:
        raise UsageError(
            f"{run.path}: no horizon_s attribute (nor config.planner.horizon_s); "
            "H is unknown for this run"
        )
    if not isinstance(h, int | float) or isinstance(h, bool):  # the config is the file's text
        raise UsageError(f"{run.path}: config.planner.horizon_s = {h!r:.60} is not a number")
    return float(h)


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--title", default="Sensitivity to H")
    args = p.parse_args()
    runs = load(args.run_dirs)
    by_h: dict[float, list[tuple[float, float]]] = {}
    for run, s in runs:
        by_h.setdefault(horizon(run), []).append((s["tokens_per_s"], s["shifts_per_step"]))
    hs = sorted(by_h)
    tput = [mean_std(np.array([v[0] for v in by_h[h]])) for h in hs]
    shifts = [mean_std(np.array([v[1] for v in by_h[h]])) for h in hs]

    rows = [["H (s)", "runs", "tokens/s", "±", "shifts/step", "±"]]
    for h, (tm, ts), (sm, ss) in zip(hs, tput, shifts, strict=True):
        rows.append(
            [f"{h:g}", str(len(by_h[h])), f"{tm:.1f}", f"{ts:.1f}", f"{sm:.2f}", f"{ss:.2f}"]
        )
    print(table(rows))

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(8, 3.2))
    for ax, data, ylabel in ((a1, tput, "tokens/s"), (a2, shifts, "shifts per step")):
        ax.errorbar(hs, [m for m, _ in data], yerr=[s for _, s in data], marker="o", capsize=3)
        if min(hs) > 0:
            ax.set_xscale("log")
        elif max(hs) > 0:
            ax.set_xscale("symlog", linthresh=min((h for h in hs if h > 0), default=1.0))
        ax.set_xlabel("H (s)")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
    fig.suptitle(args.title)
    save(fig, args.out)
    return 0


if __name__ == "__main__":
    main_guard(main)
