"""Configuration: typed dataclasses per component, YAML + dotted overrides, one validation pass."""

from __future__ import annotations

from pathlib import Path

from pivot_hpc.config.loader import (
    ConfigError,
    apply_overrides,
    from_dict,
    load_yaml,
    to_dict,
    validate_tree,
)
from pivot_hpc.config.schema import Config


def load_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> Config:
    """Load a YAML file (or the defaults), apply `a.b=c` overrides, validate once."""
    data = load_yaml(path) if path is not None else {}
    apply_overrides(data, overrides, root=Config)
    cfg = from_dict(Config, data)
    validate_tree(cfg)
    return cfg


__all__ = ["Config", "ConfigError", "from_dict", "load_config", "to_dict", "validate_tree"]
