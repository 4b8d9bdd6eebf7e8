"""Injected engine deaths (`sim.failures`): when and where they strike.

Every GPU fails at exponential intervals of mean `mtbf_gpu_hours`. The cluster's deaths are
then one Poisson process of rate gpus / MTBF, each death on a GPU drawn uniformly (the
superposition of the per-GPU processes), so a replica serving on k GPUs dies at rate
k / MTBF, as the brief of issue 38 asks, while only one death is pending at a time.
The draws depend on the seed alone, never on what the GPUs do: every mode of one seed
meets the same deaths at the same times on the same GPUs (common random numbers), and a
bench's difference between modes is the modes', not the dice's.

What a death costs is SimCluster's (sim/cluster.py): the dead replica's sequences keep the
tokens streamed up to its engine guard's last refresh (engines/process/guard.py), so each
loses what it decoded since then; the coordinator's own recovery (coordinator/shifts.py,
`on_failure`) does the rest. A death on a GPU that training holds restarts the training
engine between steps and stops the job inside one (SimCluster `_training_death`); a job
stop's step starts over after `job_restart_s`, so at a high enough death rate no step
completes: after MAX_STALLED_RESTARTS job stops in a row the run ends with JobStalled.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from pivot_hpc.errors import PivotError

if TYPE_CHECKING:  # (imported first, sim/config.py would import itself through config/)
    from pivot_hpc.sim.config import FailureConfig

# Seconds between a live worker's length reports, at each of which its engine guard
# refreshes the tokens it keeps for every running sequence (runtime/worker.py
# LENGTHS_EVERY_S; not imported: the worker needs torch and MPI).
REFRESH_S = 0.5

# Job stops (training deaths inside a step, or twice within the restart window) in a row
# without a step trained, after which a simulated run gives up: a step of W GPU-seconds
# escapes every death with probability e^(−W / MTBF) (MTBF in GPU-seconds), so at a stress
# MTBF a long step never completes, live or simulated. A false alarm needs 50 failed tries
# in a row: 0.5 % of the time where each try fails with probability 0.9.
MAX_STALLED_RESTARTS = 50


class JobStalled(PivotError, RuntimeError):
    """MAX_STALLED_RESTARTS job stops in a row without a training step completing."""


class DeathClock:
    """The next engine death of a cluster of `gpus` GPUs: (time, GPU, seconds since the
    dead engine's last token refresh — uniform in [0, REFRESH_S), its phase unknown)."""

    def __init__(self, config: FailureConfig, gpus: int, seed: int) -> None:
        if not config.enabled or gpus <= 0:
            raise ValueError("DeathClock needs sim.failures.mtbf_gpu_hours > 0 and GPUs")
        # a stream of its own: the workload's and the late-finish draws stay as they were
        self._rng = random.Random(f"sim.failures/{seed}")
        self.gpus = gpus
        self.rate = gpus / (config.mtbf_gpu_hours * 3600.0)  # deaths per simulated second

    def next(self, t: float) -> tuple[float, int, float]:
        at = t + self._rng.expovariate(self.rate)
        return at, self._rng.randrange(self.gpus), self._rng.random() * REFRESH_S
