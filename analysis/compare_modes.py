"""End-to-end throughput of deployment modes (paper Figure 9).

Usage:
    python analysis/compare_modes.py RUN_DIR [RUN_DIR ...] --out fig9.png [--labels A,B,...]

One bar per configuration (label: the run's `label` attribute, else mode, plus the strategy
when it is not the mode's own). Repeats of one configuration (same label) are averaged and
their standard deviation drawn as an error bar, as in the paper (three runs each). Each other
bar is annotated with the best bar's speedup over it. The table is also printed as text.
End-to-end throughput = Σ steps (rollout_tokens + reward_tokens) / (last end − first start).
Beside it: steady-state throughput (after the first staleness+1 steps) and the
work-conserving bound, and both throughputs as a fraction of the bound (analysis/README.md),
so every mode reads as a fraction of what the hardware allows. The figure draws end-to-end
bars with the steady-state value as a dot and the bound as a dash.
"""

from __future__ import annotations

import numpy as np
from _common import group, load, main_guard, mean_std, ordered, parser, plt, save, table

from pivot_hpc.errors import UsageError


def _num(x: float | None) -> float:
    return float("nan") if x is None else float(x)


def _mean(x: np.ndarray) -> float:
    x = x[np.isfinite(x)]
    return float(x.mean()) if len(x) else float("nan")


def _fmt(x: float, fmt: str = "{:.1f}") -> str:
    return fmt.format(x) if np.isfinite(x) else "-"


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--labels", help="comma-separated bar labels, one per RUN_DIR")
    p.add_argument("--title", default="End-to-end throughput")
    args = p.parse_args()
    runs = load(args.run_dirs)
    labels = [run.label for run, _ in runs]
    if args.labels:
        labels = args.labels.split(",")
        if len(labels) != len(runs):
            raise UsageError(
                f"--labels has {len(labels)} names for {len(runs)} run directories; "
                "give one per RUN_DIR"
            )
    pairs = list(zip(labels, runs, strict=True))
    groups = dict(group([(lab, s["tokens_per_s"]) for lab, (_, s) in pairs]))
    steady = dict(group([(lab, _num(s.get("tokens_per_s_steady"))) for lab, (_, s) in pairs]))
    bound = dict(group([(lab, _num(s.get("tokens_per_s_bound"))) for lab, (_, s) in pairs]))
    names = ordered(groups)
    stats = [mean_std(groups[n]) for n in names]
    best = max(range(len(names)), key=lambda i: stats[i][0])
    best_mean = stats[best][0]

    head = ["config", "runs", "tokens/s", "±", f"{names[best]} speedup", "steady", "bound"]
    rows = [[*head, "e2e/bound", "steady/bound"]]
    for n, (m, s) in zip(names, stats, strict=True):
        speedup = f"{best_mean / m:.2f}x" if m > 0 else "inf"
        st, bd = _mean(steady[n]), _mean(bound[n])
        cells = [n, str(len(groups[n])), f"{m:.1f}", f"{s:.1f}", speedup, _fmt(st), _fmt(bd)]
        rows.append([*cells, _fmt(m / bd, "{:.2f}"), _fmt(st / bd, "{:.2f}")])
    print(table(rows))

    fig, ax = plt.subplots(figsize=(max(4.0, 1.3 * len(names) + 1.5), 3.6))
    means = [m for m, _ in stats]
    colors = ["tab:red" if i == best else "tab:gray" for i in range(len(names))]
    ax.bar(names, means, yerr=[s for _, s in stats], color=colors, capsize=4)
    for i, (m, s) in enumerate(stats):
        text = f"{m:.0f}" if i == best else f"{m:.0f}\n({best_mean / m:.2f}x)" if m > 0 else "0"
        ax.annotate(
            text,
            (i, m + s),
            ha="center",
            va="bottom",
            fontsize=8,
            xytext=(0, 2),
            textcoords="offset points",
        )
    for i, n in enumerate(names):
        st, bd = _mean(steady[n]), _mean(bound[n])
        if np.isfinite(st):
            ax.plot([i], [st], "o", color="black", markersize=4, label="steady" if i == 0 else "")
        if np.isfinite(bd):
            ax.plot(
                [i - 0.4, i + 0.4],
                [bd, bd],
                "--",
                color="tab:blue",
                lw=1,
                label="bound" if i == 0 else "",
            )
    finite_bounds = [b for b in (_mean(bound[n]) for n in names) if np.isfinite(b)]
    if finite_bounds:
        means = [*means, *finite_bounds]
        ax.legend(fontsize=7, loc="upper right")
    ax.set_ylabel("tokens/s")
    ax.set_title(args.title)
    ax.set_ylim(0, max([*means, 1e-9]) * 1.25)
    save(fig, args.out)
    return 0


if __name__ == "__main__":
    main_guard(main)
