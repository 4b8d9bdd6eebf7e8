"""Small helpers shared by the benchmarks."""

from __future__ import annotations

import numpy as np


def percentiles_ms(samples_s: list[float]) -> dict[str, float]:
    arr = np.asarray(samples_s) * 1e3
    return {
        "median_ms": round(float(np.median(arr)), 3),
        "p90_ms": round(float(np.percentile(arr, 90)), 3),
    }


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows)
