"""Will it fit, before anything starts: the memory plan of a run config (`pivot-hpc plan`).

- `inputs`: what the plan needs from a config (models, GPUs, sequence lengths, knobs);
- `memory`: bytes per GPU of each role (training, an inference engine, a shift);
- `host`: bytes per node in host memory (GPS, pinned buffers, Read staging) and Read time;
- `plan`: the whole plan, the knob that fixes a role that does not fit, the pre-launch check.

Pure arithmetic over the config (no torch, no GPU): it runs in well under a second.
"""

from __future__ import annotations

from pivot_hpc.planning.plan import MemoryPlanError, build_plan, check_memory

__all__ = ["MemoryPlanError", "build_plan", "check_memory"]
