"""Configuration: typed dataclasses per component, YAML + dotted overrides, one validation pass."""

from __future__ import annotations

from pathlib import Path

from pivot_hpc.config.loader import (
    ConfigError,
    apply_overrides,
    from_dict,
    load_yaml,
    migrate_moved,
    to_dict,
    validate_tree,
)
from pivot_hpc.config.schema import Config


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    files: bool = True,
) -> Config:
    """Load a YAML file (or the defaults), apply `a.b=c` overrides, validate once.
    `files=False`: the config as the simulator reads it, `Config.without_files` (model
    directories and datasets need not exist here)."""
    data = load_yaml(path) if path is not None else {}
    migrate_moved(data, Config)  # deprecated keys read at their new ones (overrides win)
    apply_overrides(data, overrides, root=Config)
    cfg = from_dict(Config, data)
    if not files:
        cfg = cfg.without_files()
    validate_tree(cfg)
    return cfg


def default_dict() -> dict:
    """Every key at its default, as `to_dict` writes it (what a run that predates a key
    ran with: resume compares a checkpoint's config against it for keys it lacks)."""
    return to_dict(from_dict(Config, {}))


__all__ = [
    "Config",
    "ConfigError",
    "default_dict",
    "from_dict",
    "load_config",
    "to_dict",
    "validate_tree",
]
