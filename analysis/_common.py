"""Shared plumbing of the analysis scripts: argument parsing, loading runs, saving figures.

The scripts run as `python analysis/<name>.py ...`; the metrics themselves live in the
package (pivot_hpc.telemetry.summary) so that `pivot-hpc report` computes the same numbers.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

try:
    import pivot_hpc  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import matplotlib

matplotlib.use("Agg")  # files only; no display on compute nodes

import matplotlib.pyplot as plt
import numpy as np

from pivot_hpc.errors import PivotError
from pivot_hpc.telemetry import Run, open_run
from pivot_hpc.telemetry.summary import summarise

# Bar order of the paper's figures; labels not listed follow in first-seen order.
PREFERRED_ORDER = (
    "colocated",
    "disaggregated",
    "rr_colocated",
    "static",
    "rule",
    "vanilla",
    "vanilla+tm",
    "vanilla+tm+migration",
    "pivot",
)


def parser(doc: str | None, *, out_required: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=(doc or "").strip().splitlines()[0],
        epilog=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dirs", metavar="RUN_DIR", nargs="+", help="run directories")
    p.add_argument("--out", required=out_required, metavar="PNG", help="figure to write")
    return p


def load(run_dirs: Iterable[str]) -> list[tuple[Run, dict[str, Any]]]:
    """(Run, summary) per directory."""
    out = []
    for d in run_dirs:
        run = open_run(d)
        out.append((run, summarise(run)))
    return out


def group(items: list[tuple[Any, float]]) -> list[tuple[Any, np.ndarray]]:
    """Values grouped by key (repeats of one configuration), keys in first-seen order."""
    groups: dict[Any, list[float]] = {}
    for key, value in items:
        groups.setdefault(key, []).append(value)
    return [(k, np.asarray(v, dtype=np.float64)) for k, v in groups.items()]


def ordered(labels: Iterable[str]) -> list[str]:
    labels = list(dict.fromkeys(labels))
    rank = {name: i for i, name in enumerate(PREFERRED_ORDER)}
    return sorted(labels, key=lambda s: (rank.get(s, len(rank)), labels.index(s)))


def mean_std(x: np.ndarray) -> tuple[float, float]:
    return float(x.mean()), float(x.std()) if len(x) > 1 else 0.0


def save(fig: plt.Figure, out: str) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    print(f"wrote {out}")


def table(rows: list[list[str]]) -> str:
    from pivot_hpc.bench.stats import table as _table

    return _table(rows)


def main_guard(fn: Callable[[], int]) -> None:
    """Run a script's main: user errors become one line on stderr and exit status 2."""
    try:
        raise SystemExit(fn())
    except PivotError as exc:
        print(f"{Path(sys.argv[0]).name}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
