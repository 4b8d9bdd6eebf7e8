"""One builder for both clusters: the simulator's coordinator and the live run's are told
the same thing by the same config (which GPUs train, the mode, the first shifts)."""

from __future__ import annotations

import pytest

from pivot_hpc.job import build as builder
from pivot_hpc.job.config import load_config
from pivot_hpc.job.sim_backend import SimBackend

TINY = ["cluster.nodes=1", "cluster.gpus_per_node=4", "training.num_gpus=1", "loop.steps=2"]
# the paper's caps and veRL's activation recompute
TINY += [
    "rl.max_response_tokens=15000",
    "rl.reward.genrm_max_tokens=20000",
    "rl.trainer.recompute=full",
]


class RecordingCluster:
    """Stands where `runtime.live_cluster.LiveCluster` stands (which needs an MPI world:
    tests/mpi runs that one): records what the coordinator asks of it."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def now(self) -> float:
        return 0.0

    def shift_up(self, rid: str, version: int, after: str | None = None) -> None:
        self.calls.append(("up", rid, version))

    def shift_down(self, rid: str) -> None:
        self.calls.append(("down", rid))

    def start(self, rid, sample, role) -> None:
        self.calls.append(("start", rid, sample.sample_id, role))


class LiveShapedBackend(SimBackend):
    """The live run's costs (the config's own constants, job/build.py) over a
    recording cluster: what `build` decides from the config alone."""

    simulated = False

    def costs(self, cfg):
        super().costs(cfg)  # (the header's bound rates need the catalog costs)
        return builder.configured_costs(cfg)

    def cluster(self, cfg, topology, source):
        return RecordingCluster()


def first_requests(coord) -> list[tuple]:
    """The shift-ups the mode asks for at start (the replicas are not up yet, so nothing is
    dispatched)."""
    asked: list[tuple] = []
    coord.cluster.shift_up = lambda rid, version: asked.append(("up", rid, version))
    coord.mode.start(coord)
    coord.release()
    return asked


@pytest.mark.parametrize(
    "mode,strategy",
    [
        ("colocated", "pivot"),
        ("disaggregated", "pivot"),
        ("rr_colocated", "pivot"),
        ("pivot", "pivot"),
        ("pivot", "static"),
        ("pivot", "vanilla"),
    ],
)
def test_sim_and_live_builds_agree(mode: str, strategy: str) -> None:
    cfg = load_config(None, [*TINY, f"deployment.mode={mode}", f"planner.strategy={strategy}"])
    sim_job = builder.build(cfg, SimBackend())
    sim, meta = sim_job.coordinator, sim_job.meta
    live_job = builder.build(cfg, LiveShapedBackend())
    live = live_job.coordinator
    assert not live_job.meta["simulated"] and meta["simulated"]
    assert sim.topology.training_gpus == live.topology.training_gpus
    if mode == "colocated":  # every GPU trains, in both
        assert sim.topology.training_gpus == (0, 1, 2, 3)
    else:
        assert live.topology.training_gpus == (3,)
    assert type(sim.mode) is type(live.mode)
    for role in ("rollout", "reward"):
        a, b = sim.schedulers[role], live.schedulers[role]
        assert (a.migration, a.priority_key) == (b.migration, b.priority_key)
        assert type(sim.topology.roles[role].model) is type(live.topology.roles[role].model)
    assert sim.schedulers["rollout"].migration == (strategy != "vanilla" or mode != "pivot")
    assert first_requests(sim) == first_requests(live)
    assert meta["strategy"] == (strategy if mode == "pivot" else "")
    assert {k: meta[k] for k in ("mode", "gpus", "staleness")} == {
        k: v for k, v in live_job.meta.items() if k in ("mode", "gpus", "staleness")
    }


def test_a_job_calls_its_hooks_in_order_and_always_closes() -> None:
    from pivot_hpc.coordinator.hooks import Hooks

    calls: list[str] = []

    class Record(Hooks):
        def before_run(self, coord):
            calls.append("before")

        def on_step(self, coord, step, metrics):
            calls.append(f"step {step}")

        def after_run(self, coord):
            calls.append("after")

        def close(self):
            calls.append("close")

    builder.build(load_config(None, TINY), SimBackend(hooks=Record())).run()
    assert calls == ["before", "step 0", "step 1", "after", "close"]

    class Fails(Record):
        def on_step(self, coord, step, metrics):
            raise RuntimeError("a hook failed")

    calls.clear()
    with pytest.raises(RuntimeError, match="a hook failed"):
        builder.build(load_config(None, TINY), SimBackend(hooks=Fails())).run()
    assert calls == ["before", "close"]
