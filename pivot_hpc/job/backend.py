"""A job: the coordinator with its cluster, telemetry and hooks, ready to run — and the
backend that says what differs between a simulated and a live one (docs/design.md §2).

`job.build.build(cfg, backend)` is the one call that makes a `Job`: `pivot-hpc
simulate`, `pivot-hpc run`, the benches and the tests all go through it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from pivot_hpc.coordinator.hooks import Hooks
from pivot_hpc.coordinator.monitor import TrainingTime
from pivot_hpc.scheduler import ReplicaModel

if TYPE_CHECKING:
    from pivot_hpc.coordinator.cluster import Cluster
    from pivot_hpc.coordinator.coordinator import Coordinator, Rewarder
    from pivot_hpc.coordinator.rl_state import RLState, SampleSource
    from pivot_hpc.job.config import Config
    from pivot_hpc.planner import Topology
    from pivot_hpc.telemetry import TelemetryWriter


@dataclass(frozen=True)
class Costs:
    """What the schedulers and the planner plan with: the simulator's catalog costs, or
    live, the engines' profiled constants and KV capacities."""

    models: Mapping[str, ReplicaModel]  # per inference role: its replicas' throughput model
    kv_capacity: Mapping[str, int]  # per inference role: KV tokens of one replica
    training_tp: int  # GPUs of one training extension slot (elastic training)
    prefill_s_per_token: Mapping[str, float] | None = None  # re-prefill cost (φ)
    training_time: TrainingTime | None = None  # step-time model; None = measured steps


class Backend(Protocol):
    """What a simulated and a live job do differently. `build` calls these in order."""

    simulated: bool

    def configure(self, cfg: Config) -> Config:
        """The config the job runs (live: engine profiles fill in throughput constants)."""
        ...

    def costs(self, cfg: Config) -> Costs: ...

    def samples(self, cfg: Config) -> tuple[SampleSource, Rewarder]:
        """Where samples come from, and how a finished sample is rewarded."""
        ...

    def cluster(self, cfg: Config, topology: Topology, source: SampleSource) -> Cluster: ...

    def restore(self, cluster: Cluster, rl: RLState) -> dict[str, Any]:
        """Resume into `rl` and the cluster before anything is logged; returns the
        telemetry header's resume attributes ({} for a fresh job)."""
        ...

    def meta(self, cfg: Config, rl: RLState, costs: Costs) -> dict[str, Any]:
        """The telemetry header's attributes of this kind of job."""
        ...

    def telemetry(self, meta: dict[str, Any]) -> TelemetryWriter | None: ...

    def hooks(self, cfg: Config, cluster: Cluster, writer: TelemetryWriter | None) -> Hooks: ...

    def ready(self, coord: Coordinator) -> None:
        """The coordinator exists: hand it what was restored (requeued sequences)."""
        ...


@dataclass
class Job:
    """A built job. `run` drives it to the end (or a drained stop) and always closes its
    telemetry and hooks."""

    cfg: Config  # as the job runs it (after `Backend.configure`)
    coordinator: Coordinator
    cluster: Cluster
    meta: dict[str, Any]  # the telemetry header
    telemetry: TelemetryWriter | None
    hooks: Hooks

    def run(self, progress: Callable[[int], None] | None = None) -> None:
        try:
            self.hooks.before_run(self.coordinator)
            self.coordinator.run(progress=progress)
            self.hooks.after_run(self.coordinator)
        finally:
            if self.telemetry is not None:
                self.telemetry.close()
            self.hooks.close()
