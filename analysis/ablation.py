"""Throughput of shift strategies normalised to the disaggregated baseline (paper Figure 11).

Usage:
    python analysis/ablation.py RUN_DIR [RUN_DIR ...] --out fig11.png [--baseline disaggregated]

Each run is labelled by its `label` attribute, else by its strategy for mode "pivot"
(pivot / static / rule / vanilla / ...), else by its mode. Repeats of one label are averaged.
Bars show mean end-to-end throughput ÷ the baseline's mean (default label "disaggregated",
which must be among the runs); error bars are the repeats' standard deviation, normalised.
"""

from __future__ import annotations

from _common import group, load, main_guard, mean_std, ordered, parser, plt, save, table

from pivot_hpc.errors import UsageError
from pivot_hpc.telemetry import Run


def strategy_label(run: Run) -> str:
    if run.attr("label"):
        return str(run.attr("label"))
    if run.mode == "pivot":
        return str(run.attr("strategy") or "pivot")
    return run.mode


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--baseline", default="disaggregated", help="label the bars are divided by")
    p.add_argument("--title", default="Shift strategies (normalised throughput)")
    args = p.parse_args()
    runs = load(args.run_dirs)
    groups = dict(group([(strategy_label(r), s["tokens_per_s"]) for r, s in runs]))
    if args.baseline not in groups:
        raise UsageError(
            f"--baseline {args.baseline!r}: no run has that label (labels: "
            f"{', '.join(sorted(groups))}); add a disaggregated run or pick one of these"
        )
    base = mean_std(groups[args.baseline])[0]
    if base <= 0:
        raise UsageError(f"baseline {args.baseline!r} has zero throughput; cannot normalise")
    names = ordered(groups)
    stats = [mean_std(groups[n]) for n in names]

    rows = [["strategy", "runs", "tokens/s", "±", f"x {args.baseline}"]]
    for n, (m, s) in zip(names, stats, strict=True):
        rows.append([n, str(len(groups[n])), f"{m:.1f}", f"{s:.1f}", f"{m / base:.2f}"])
    print(table(rows))

    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(names) + 1.5), 3.4))
    norm = [m / base for m, _ in stats]
    colors = ["tab:gray" if n == args.baseline else "tab:blue" for n in names]
    ax.bar(names, norm, yerr=[s / base for _, s in stats], color=colors, capsize=4)
    for i, v in enumerate(norm):
        ax.annotate(
            f"{v:.2f}x",
            (i, v),
            ha="center",
            va="bottom",
            fontsize=8,
            xytext=(0, 2),
            textcoords="offset points",
        )
    ax.axhline(1.0, color="k", lw=0.6, ls=":")
    ax.set_ylabel(f"throughput / {args.baseline}")
    ax.set_ylim(0, max(norm) * 1.2)
    ax.set_title(args.title)
    save(fig, args.out)
    return 0


if __name__ == "__main__":
    main_guard(main)
