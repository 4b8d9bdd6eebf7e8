"""Throughput and GPU allocation over time for one run (paper Figure 10).

Usage:
    python analysis/timeline.py RUN_DIR --out fig10.png [--t0 S] [--t1 S] [--estimated]

Panels, top to bottom: rollout tokens/s, reward tokens/s, overall throughput (Eq. 1:
(N_ro + N_rm) / (N_ro/T_ro + N_rm/T_rm), N = n_seq incl. queued, T = tokens_per_s; 0 when
a role with work has no throughput), and the GPU allocation (RO rollout, RM reward, TR
training, idle, in transition). Each series is a step function of the `throughput` rows;
dashed vertical lines mark shift decisions (shifts grouped by plan_id) where they start,
annotated with the allocation once they are done; pink spans are intervals where training
holds GPUs.
"""

from __future__ import annotations

import numpy as np
from _common import main_guard, parser, plt, save

from pivot_hpc.errors import UsageError
from pivot_hpc.telemetry import open_run
from pivot_hpc.telemetry.summary import role_timeline

ALLOC = (
    ("rollout_gpus", "RO", "tab:blue"),
    ("reward_gpus", "RM", "tab:orange"),
    ("training_gpus", "TR", "tab:pink"),
    ("transition_gpus", "transition", "tab:gray"),
    ("idle_gpus", "idle", "lightgray"),
)


def training_spans(alloc: np.ndarray, end: float) -> list[tuple[float, float]]:
    """[start, end) intervals during which training_gpus > 0."""
    spans: list[tuple[float, float]] = []
    start = None
    for t, tr in zip(alloc["t"].tolist(), alloc["training_gpus"].tolist(), strict=True):
        if tr > 0 and start is None:
            start = t
        elif tr <= 0 and start is not None:
            spans.append((start, t))
            start = None
    if start is not None:
        spans.append((start, end))
    return spans


def shift_events(shifts: np.ndarray) -> list[np.ndarray]:
    """Shift rows grouped into decisions, ordered by start (a row's t is when it finished,
    it started at t - total_s): by plan_id; rows with plan_id 0 (not the planner's: initial
    placement, a baseline's stage switch) by chains of overlapping or back-to-back shifts."""
    start = shifts["t"] - shifts["total_s"]
    events = [shifts[shifts["plan_id"] == pid] for pid in np.unique(shifts["plan_id"]) if pid > 0]
    loose = np.flatnonzero(shifts["plan_id"] <= 0)
    group: list[int] = []
    group_end = -np.inf
    for i in loose[np.argsort(start[loose], kind="stable")].tolist():
        if group and start[i] > group_end + 1e-6:  # a gap: the previous chain is complete
            events.append(shifts[group])
            group, group_end = [], -np.inf
        group.append(i)
        group_end = max(group_end, float(shifts["t"][i]))
    if group:
        events.append(shifts[group])
    return sorted(events, key=lambda rows: float((rows["t"] - rows["total_s"]).min()))


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--t0", type=float, default=None, help="window start (s)")
    p.add_argument("--t1", type=float, default=None, help="window end (s)")
    p.add_argument(
        "--estimated",
        action="store_true",
        help="also draw the throughput model's estimates (dashed)",
    )
    args = p.parse_args()
    if len(args.run_dirs) != 1:
        raise UsageError(f"timeline.py takes one RUN_DIR, got {len(args.run_dirs)}")
    run = open_run(args.run_dirs[0])
    end = run.end_time
    tl = role_timeline(run)
    est = role_timeline(run, "est_tokens_per_s") if args.estimated else None
    alloc = run["allocation"]
    alloc = alloc[np.argsort(alloc["t"], kind="stable")]
    shifts = run["shifts"]

    fig, axes = plt.subplots(
        4, 1, figsize=(10, 8), sharex=True, gridspec_kw={"height_ratios": [1, 1, 1, 1.2]}
    )
    t_ext = np.append(tl["t"], end)  # last sample holds until the run's end
    for ax, key, title in zip(
        axes[:3],
        ("rollout", "reward", "overall"),
        ("Rollout", "Reward", "Overall (Eq. 1)"),
        strict=True,
    ):
        if len(tl["t"]):
            ax.step(t_ext, np.append(tl[key], tl[key][-1]), where="post", lw=1.2)
            if est is not None:
                ax.step(
                    t_ext,
                    np.append(est[key], est[key][-1]),
                    where="post",
                    lw=0.8,
                    ls="--",
                    color="tab:green",
                    label="estimated",
                )
                ax.legend(loc="upper right", fontsize=7)
        ax.set_ylabel(f"{title}\ntokens/s", fontsize=9)
        ax.set_ylim(bottom=0)

    ax = axes[3]
    if len(alloc):
        t_a = np.append(alloc["t"], max(end, float(alloc["t"][-1])))
        bottom = np.zeros(len(t_a))
        for field, name, color in ALLOC:
            v = np.append(alloc[field], alloc[field][-1]).astype(np.float64)
            if v.any():
                ax.fill_between(
                    t_a, bottom, bottom + v, step="post", color=color, label=name, alpha=0.8, lw=0
                )
            bottom = bottom + v
        ax.legend(loc="upper right", fontsize=7, ncol=len(ALLOC))
    ax.set_ylabel("GPUs", fontsize=9)
    ax.set_xlabel(f"time (s, {'simulated' if run.attr('simulated') else 'wall clock'})")

    for a, b in training_spans(alloc, end):
        for ax in axes:
            ax.axvspan(a, b, color="pink", alpha=0.35, lw=0)

    # One marker per shift decision, where its first shift started (rows are logged when a
    # shift finishes, at t; it started at t - total_s), annotated with the allocation in
    # effect once its last shift has finished.
    t_lo = args.t0 if args.t0 is not None else 0.0
    t_hi = args.t1 if args.t1 is not None else max(end, 1e-9)
    min_gap = 0.05 * (t_hi - t_lo)  # closer annotations would overprint each other
    last_note = -np.inf
    for rows in shift_events(shifts):
        t = float((rows["t"] - rows["total_s"]).min())
        for ax in axes:
            ax.axvline(t, color="k", ls="--", lw=0.6, alpha=0.6)
        if len(alloc) and t_lo <= t <= t_hi and t - last_note >= min_gap:
            last_note = t
            done = float(rows["t"].max())
            j = max(int(np.searchsorted(alloc["t"], done, side="right")) - 1, 0)
            row = alloc[j]
            axes[0].annotate(
                f"RO={row['rollout_gpus']}\nRM={row['reward_gpus']}\nTR={row['training_gpus']}",
                (t, 1.0),
                xycoords=("data", "axes fraction"),
                fontsize=6,
                va="bottom",
                ha="center",
                annotation_clip=False,
            )

    axes[-1].set_xlim(t_lo, t_hi)
    fig.suptitle(f"{run.label}: throughput and allocation", y=1.0)
    save(fig, args.out)
    return 0


if __name__ == "__main__":
    main_guard(main)
