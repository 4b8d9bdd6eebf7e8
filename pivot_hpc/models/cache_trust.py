"""The model cache gets the run directory's ownership rule.

`<cache>/models/<kind>-<key>/` is used as it is whenever it holds a `meta.json`, and its
key is a hash of public settings (models/zoo.spec_key): anyone who can write to the cache
(`models.cache_dir`, which a resume may change, or $PIVOT_HPC_CACHE) can plant the weights,
tokenizer and throughput profiles a job trains with. So the cache root, its `models/`,
`profiles/` and `compile/` directories and each model directory used must belong to this
user and be writable by no one else (private_dirs.py): else one line, before the model is
used (by the launcher before any rank starts, and by `ensure_model` itself).
"""

from __future__ import annotations

from pathlib import Path

from pivot_hpc import private_dirs
from pivot_hpc.models.config import ModelsConfig, cache_root

PARTS = ("models", "profiles", "compile")
FIX = "use a cache directory of your own (models.cache_dir or $PIVOT_HPC_CACHE)"


def check_root(cache_dir: Path | str | None) -> Path:
    """The cache root of `cache_dir` (models.cache_dir), after checking it and its parts."""
    root = cache_root(cache_dir)
    private_dirs.check([root, *(root / p for p in PARTS)], "the model cache", FIX)
    return root


def check_entry(path: Path) -> None:
    """One cached model directory, before it is used."""
    private_dirs.check([path], "the cached model", FIX)


def check(cfg: ModelsConfig) -> None:
    """The cache root and the cached models `cfg` would use (not a model directory the
    config names itself: that one is the user's choice, like any path they give)."""
    from pivot_hpc.models.zoo import model_dir

    check_root(cfg.cache_dir)
    for kind in ("policy", "genrm"):
        if getattr(cfg, f"{kind}_path") is None:
            check_entry(model_dir(cfg, kind))
