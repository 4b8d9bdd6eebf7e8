"""Shared pytest setup: fast tests by default; each multi-process test carries a timeout."""

from __future__ import annotations

import os

os.environ.setdefault("PYTHONHASHSEED", "0")
