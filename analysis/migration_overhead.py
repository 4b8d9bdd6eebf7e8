"""Per-sequence migration time breakdown per cluster size (paper Table 3).

Usage:
    python analysis/migration_overhead.py RUN_DIR [RUN_DIR ...] [--out table3.png]

Cluster size is each run's root attribute `gpus`; the `migrations` rows of all runs with the
same size are pooled. A row's abort_s / dispatch_s / reprefill_s are the latencies every
sequence of that migration event experienced, so events are weighted by their `sequences`
(events that moved none are left out). Printed: mean ± std seconds per migrated sequence of each phase and their total.
"""

from __future__ import annotations

import numpy as np
from _common import load, main_guard, parser, plt, save, table

from pivot_hpc.errors import UsageError
from pivot_hpc.telemetry.summary import MIGRATION_PHASES, migration_stats

HEADERS = {
    "abort": "Abort (s)",
    "dispatch": "Dispatch (s)",
    "reprefill": "Re-prefill (s)",
    "total": "Total (s)",
}


def main() -> int:
    p = parser(__doc__, out_required=False)
    args = p.parse_args()
    pooled: dict[int, list[np.ndarray]] = {}
    for run, _ in load(args.run_dirs):
        gpus = run.attr("gpus")
        if gpus is None:
            raise UsageError(f"{run.path}: no `gpus` root attribute; cluster size unknown")
        pooled.setdefault(int(gpus), []).append(run["migrations"])
    sizes = sorted(pooled)
    merged = {g: np.concatenate(pooled[g]) for g in sizes}
    stats = {g: migration_stats(merged[g]) for g in sizes}

    rows = [["GPUs", "sequences", *(HEADERS[ph] for ph in MIGRATION_PHASES)]]
    for g in sizes:
        cells = [
            f"{stats[g][ph]['mean']:.3f} ±{stats[g][ph]['std']:.3f}" for ph in MIGRATION_PHASES
        ]
        rows.append([str(g), str(int(merged[g]["sequences"].sum())), *cells])
    print(table(rows))

    if args.out:
        fig, ax = plt.subplots(figsize=(max(4.0, 1.0 * len(sizes) + 2), 3.4))
        x = np.arange(len(sizes))
        bottom = np.zeros(len(sizes))
        for ph in MIGRATION_PHASES[:-1]:
            v = np.nan_to_num([stats[g][ph]["mean"] for g in sizes])
            ax.bar(x, v, bottom=bottom, label=HEADERS[ph])
            bottom += v
        ax.set_xticks(x, [str(g) for g in sizes])
        ax.set_xlabel("GPUs")
        ax.set_ylabel("seconds per migrated sequence")
        ax.legend(fontsize=8)
        save(fig, args.out)
    return 0


if __name__ == "__main__":
    main_guard(main)
