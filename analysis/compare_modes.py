"""End-to-end throughput of deployment modes (paper Figure 9).

Usage:
    python analysis/compare_modes.py RUN_DIR [RUN_DIR ...] --out fig9.png [--labels A,B,...]

One bar per configuration (label: the run's `label` attribute, else mode, plus the strategy
when it is not the mode's own). Repeats of one configuration (same label) are averaged and
their standard deviation drawn as an error bar, as in the paper (three runs each). Each other
bar is annotated with the best bar's speedup over it. The table is also printed as text.
End-to-end throughput = Σ steps (rollout_tokens + reward_tokens) / (last end − first start).
"""

from __future__ import annotations

from _common import group, load, main_guard, mean_std, ordered, parser, plt, save, table

from pivot_hpc.errors import UsageError


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
    groups = dict(
        group([(lab, s["tokens_per_s"]) for lab, (_, s) in zip(labels, runs, strict=True)])
    )
    names = ordered(groups)
    stats = [mean_std(groups[n]) for n in names]
    best = max(range(len(names)), key=lambda i: stats[i][0])
    best_mean = stats[best][0]

    rows = [["config", "runs", "tokens/s", "±", f"{names[best]} speedup"]]
    for n, (m, s) in zip(names, stats, strict=True):
        speedup = f"{best_mean / m:.2f}x" if m > 0 else "inf"
        rows.append([n, str(len(groups[n])), f"{m:.1f}", f"{s:.1f}", speedup])
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
    ax.set_ylabel("tokens/s")
    ax.set_title(args.title)
    ax.set_ylim(0, max([*means, 1e-9]) * 1.25)
    save(fig, args.out)
    return 0


if __name__ == "__main__":
    main_guard(main)
