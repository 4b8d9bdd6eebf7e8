"""Held-out accuracy and training reward against RL step and wall-clock time (Figure 15).

Usage:
    python analysis/convergence.py RUN_DIR [RUN_DIR ...] --out fig15.png [--window 8]

One line per run, coloured by its label (mode, or the `label` attribute); runs of one
label (seeds) share a colour. Held-out accuracy comes from the `evals` rows (greedy, on
the validation problems), the training reward from `steps.reward_mean` as a trailing
moving average over `--window` steps. Time is seconds since the run's first step started.
Curves that overlap against RL steps mean the deployment did not change learning; against
time, the faster deployment gets there sooner (the paper's §8.6).
"""

from __future__ import annotations

from _common import load, main_guard, ordered, parser, plt, save, table

from pivot_hpc.errors import UsageError
from pivot_hpc.telemetry.convergence import curves


def fmt(x: float | None) -> str:
    return "–" if x is None else f"{x:.3f}"


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--window", type=int, default=8, help="moving-average window (steps)")
    p.add_argument("--title", default="Convergence")
    args = p.parse_args()
    if args.window < 1:
        raise UsageError(f"--window {args.window}: must be >= 1")
    runs = [curves(run, args.window) for run, _ in load(args.run_dirs)]
    if not any(len(c.accuracy) for c in runs):
        raise UsageError("no run has held-out evaluations (loop.eval_problems > 0 records them)")
    labels = ordered(c.label for c in runs)
    colour = {lab: f"C{i}" for i, lab in enumerate(labels)}
    rows = [["run", "label", "seed", "acc first", "acc last", "reward (MA) last", "wall s"]]
    fig, axes = plt.subplots(2, 2, figsize=(9, 6), sharey="row")
    drawn: set[str] = set()
    for d, c in zip(args.run_dirs, runs, strict=True):
        kw = {"color": colour[c.label], "alpha": 0.8}
        name = c.label if c.label not in drawn else None
        drawn.add(c.label)
        axes[0, 0].plot(c.eval_version, c.accuracy, marker="o", label=name, **kw)
        axes[0, 1].plot(c.eval_t, c.accuracy, marker="o", **kw)
        axes[1, 0].plot(c.step, c.reward_ma, **kw)
        axes[1, 1].plot(c.step_t, c.reward_ma, **kw)
        last_r = c.reward_ma[-1] if len(c.reward_ma) else None
        rows.append(
            [d, c.label, str(c.seed), fmt(c.accuracy_first), fmt(c.accuracy_last), fmt(last_r),
             f"{c.wall_s:.0f}"]
        )  # fmt: skip
    print(table(rows))
    axes[0, 0].set_ylabel("held-out accuracy")
    axes[1, 0].set_ylabel(f"training reward (MA {args.window})")
    axes[1, 0].set_xlabel("RL step")
    axes[1, 1].set_xlabel("wall-clock (s)")
    axes[0, 0].legend()
    fig.suptitle(args.title)
    save(fig, args.out)
    return 0


if __name__ == "__main__":
    main_guard(main)
