"""Shared plumbing of the analysis scripts: argument parsing, loading runs, saving figures.

Runs are read by `open_run` (pivot_hpc/telemetry/reader.py), which refuses hostile files in
one line; figures and tables are written with `open_for_write` (pivot_hpc/safe_files.py).

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

from pivot_hpc.errors import PivotError, UsageError
from pivot_hpc.safe_files import open_for_write
from pivot_hpc.telemetry import Run, open_run
from pivot_hpc.telemetry.errors import printable
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
    """Write the figure to `out`, in the format its suffix names (no suffix: `out`.png, as
    matplotlib does). Never through a symbolic link planted at `out` (open_for_write
    refuses it in one line)."""
    if not Path(out).suffix:
        out = f"{out}.png"
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fmt = Path(out).suffix.lstrip(".").lower()
    if fmt not in fig.canvas.get_supported_filetypes():
        raise UsageError(f"--out {out}: unknown figure format {fmt!r}; use .png, .pdf or .svg")
    with open_for_write(out, "wb", private=False) as fh:
        fig.savefig(fh, dpi=120, format=fmt)
    plt.close(fig)
    print(f"wrote {out}")


def table(rows: list[list[str]]) -> str:
    from pivot_hpc.bench.stats import table as _table

    # labels come from the runs' telemetry, which may be someone else's: no escapes
    return _table([[printable(str(cell)) for cell in row] for row in rows])


def main_guard(fn: Callable[[], int]) -> None:
    """Run a script's main: user errors become one line on stderr and exit status 2."""
    try:
        raise SystemExit(fn())
    except PivotError as exc:
        print(f"{Path(sys.argv[0]).name}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
