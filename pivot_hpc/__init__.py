"""pivot_hpc: Slurm-native RL post-training with generative rewards (PivotRL)."""

from __future__ import annotations

__version__ = "0.1.0"
