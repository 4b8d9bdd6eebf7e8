"""Configuration machinery: YAML without aliases, dotted overrides, typed dataclasses from
mappings and back, one validation pass. Each component's section lives with its owner
(`*/config.py`); the composition of them all, `Config` and `load_config`, is the job's
(pivot_hpc/job/config.py)."""

from __future__ import annotations

from pivot_hpc.config.loader import (
    ConfigError,
    from_dict,
    to_dict,
    validate_tree,
)

__all__ = [
    "ConfigError",
    "from_dict",
    "to_dict",
    "validate_tree",
]
