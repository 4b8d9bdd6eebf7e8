"""Fixtures shared by the unit tests of the model layer and GPS."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def arch_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny random-init bf16 directory of every architecture of recipes/tiny_arch_dirs.py
    (about a second for all of them, once per session)."""
    from pivot_hpc.recipes.tiny_arch_dirs import ARCHITECTURES, build_arch_dir

    root = tmp_path_factory.mktemp("archs")
    return {a: build_arch_dir(a, root / a, dtype="bfloat16", seed=7) for a in ARCHITECTURES}
