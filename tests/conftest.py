"""Shared pytest setup: markers by directory, and every multi-process test has a timeout.

`pytest -m "not slow"` is the fast tier a developer runs while working (under 2 minutes on
2 cores; still touches every package); `bash tests/run_all.sh` runs everything (CI).
Tests under tests/mpi are marked `mpi` and `slow`, under tests/slurm `slurm` and `slow`;
single slow tests elsewhere carry `@pytest.mark.slow` themselves.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("PYTHONHASHSEED", "0")
# This machine kind: NIXL's bundled libnl vs Debian's libibverbs crash at exit unless UCX
# leaves InfiniBand out (docs/platform.md). The launchers set it for local and CPU-only worlds;
# tests that create NIXL agents outside them inherit it from here. Never in pivot_hpc/.
os.environ.setdefault("UCX_MODULES", "^ib")

HERE = Path(__file__).parent
BY_DIRECTORY = {"mpi": ("mpi", "slow"), "slurm": ("slurm", "slow"), "gpu": ("gpu",)}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        try:
            top = Path(item.fspath).relative_to(HERE).parts[0]
        except ValueError:
            continue
        for name in BY_DIRECTORY.get(top, ()):
            item.add_marker(getattr(pytest.mark, name))


_MPI_REPORTED = False  # the first test to initialise MPI fails, not every one after it


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    """MPI must not be initialised in the test process (importing pivot_hpc.runtime.worker
    or mpi4py's MPI does it): every job a later test starts would inherit the singleton
    world's environment and see a one-rank world. Fail the test that did it, not the many
    that would fail after it (it once cost a CI run of four unrelated failures)."""
    import sys

    global _MPI_REPORTED
    mpi = sys.modules.get("mpi4py.MPI")
    initialized = getattr(mpi, "Is_initialized", None)
    if not _MPI_REPORTED and callable(initialized) and initialized():
        _MPI_REPORTED = True
        pytest.fail(
            f"{item.nodeid} initialised MPI in the test process; run MPI code in a "
            "subprocess (mpirun) and keep pivot_hpc.runtime.worker/main out of test imports",
            pytrace=False,
        )
