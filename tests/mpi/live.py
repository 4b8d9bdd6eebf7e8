"""Shared by the live-runtime tests: the `pivot-hpc run` command line of the tiny config."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def run_command(run_dir: Path, *overrides: str) -> list[str]:
    """`python -m pivot_hpc run configs/tiny.yaml --run-dir RUN_DIR OVERRIDES…` (cwd: ROOT)."""
    return [
        sys.executable,
        "-m",
        "pivot_hpc",
        "run",
        "configs/tiny.yaml",
        "--run-dir",
        str(run_dir),
        *overrides,
    ]
