"""Injected engine deaths (`sim.failures`): the simulator drives the coordinator's own
recovery (coordinator/shifts.py `on_failure`) and every sample is still trained once."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from pivot_hpc.cli.main import main
from pivot_hpc.config.loader import ConfigError
from pivot_hpc.coordinator.events import ShiftDone
from pivot_hpc.job import build as builder
from pivot_hpc.job.config import load_config
from pivot_hpc.job.sim_backend import SimBackend
from pivot_hpc.job.simulate import simulate
from pivot_hpc.planner import role_of
from pivot_hpc.sim.failures import REFRESH_S, DeathClock
from tests.sim.test_simulator import TINY
from tests.sim.tokens import run_keeping_tokens

# 16 GPUs each failing every 6 simulated minutes on average: a death every ~22 s
OFTEN = ["sim.failures.mtbf_gpu_hours=0.1", "sim.failures.restart_s=10"]
MODES = {
    "colocated": ["deployment.mode=colocated"],
    "disaggregated": ["deployment.mode=disaggregated"],
    "rr_colocated": ["deployment.mode=rr_colocated"],
    "pivot": ["deployment.mode=pivot"],
    "pivot+elastic": [
        "deployment.mode=pivot",
        "planner.strategy=pivot+",
        "planner.elastic_training=true",
    ],
}


class Recorder:
    """Telemetry that keeps the `trained` and `failures` rows (the rest is dropped)."""

    def __init__(self) -> None:
        self.sample_ids: list[int] = []  # trained, in order
        self.failures: list[dict] = []

    def trained(self, step: int, **fields) -> None:
        self.sample_ids.append(fields["sample_id"])

    def failure(self, t: float, **fields) -> None:
        self.failures.append({"t": t, **fields})

    def __getattr__(self, name: str):
        return lambda *a, **k: None


def _job(*overrides: str):
    cfg = load_config(None, [*TINY, *overrides])
    job = builder.build(cfg, SimBackend())
    rec = Recorder()
    job.coordinator.telemetry = rec
    return job, rec


@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_trains_every_sample_once_through_engine_deaths(mode: str, capsys) -> None:
    job, rec = _job(*MODES[mode], *OFTEN)
    coord, cluster = job.coordinator, job.cluster
    # every sequence finishes once, with exactly its target generated: the tokens a dead
    # engine kept plus those generated again add up, none twice
    run_keeping_tokens(coord)
    rl, stats = coord.rl, coord.stats
    assert rl.version == 3 and not rl.batches and not coord.samples
    assert sorted(rec.sample_ids) == list(range(3 * 12 * 4)) == list(range(rl.next_sample_id))
    for role in ("rollout", "reward"):
        assert coord.schedulers[role].n_seq == 0
        coord.schedulers[role].check_invariants()
    # every death the cluster dealt was recovered, one telemetry row each (a training
    # engine's between steps too: tests/sim/test_training_deaths.py; a job stop has none)
    assert stats.engine_failures > 0
    assert stats.engine_failures == len(rec.failures) == cluster.deaths + cluster.training_restarts
    assert stats.engine_restarts + len(stats.excluded) >= stats.engine_failures - 1
    assert cluster.training_deaths == cluster.training_restarts + cluster.job_restarts
    inference = [f for f in rec.failures if f["role"] != "training"]
    assert stats.sequences_recovered == sum(f["sequences"] for f in inference)
    assert stats.tokens_regenerated == sum(f["tokens_lost"] for f in inference) > 0
    for f in inference:  # ≤ one token per sequence per decode step since the refresh
        costs = cluster.inference[f["role"]]
        assert f["tokens_lost"] <= f["sequences"] * REFRESH_S / costs.fixed(1) + 1
        assert f["action"] in ("restart", "excluded")
    excluded = {f["replica"] for f in rec.failures if f["action"] == "excluded"}
    assert excluded == set(stats.excluded)
    for rid in excluded:  # its GPUs left the inference roles and elastic training
        spec = coord.topology.roles[role_of(rid)]
        gone = set(cluster._gpus(rid))
        assert all(
            not gone & set(g) for r in coord.topology.roles.values() for g in r.slots.values()
        )
        assert int(rid.split(":")[1]) not in spec.slots
        assert all(not gone & set(g) for g in coord.topology.elastic.values())
    assert "injected engine death" in capsys.readouterr().out


@pytest.mark.parametrize(("window", "excluded"), [(600.0, True), (20.0, False)])
def test_a_replica_dying_again_within_the_window_is_excluded(window: float, excluded: bool) -> None:
    job, rec = _job(
        "deployment.mode=disaggregated",
        f"deployment.engine_restart_window_s={window}",
        "sim.failures.restart_s=7",
    )
    coord, cluster = job.coordinator, job.cluster
    # a GenRM replica, busy throughout the first step; back in service by the second
    # death (the restart takes ≈ 10 s)
    cluster.kill("reward:6", at=10.0)
    cluster.kill("reward:6", at=40.0)
    restarts: list[ShiftDone] = []
    starts: list[float] = []
    handle, start = coord.handle, cluster.start

    def spy_handle(ev) -> None:
        if isinstance(ev, ShiftDone) and ev.rid == "reward:6" and "restart_s" in ev.phases:
            restarts.append(ev)
        handle(ev)

    def spy_start(rid, sample, role) -> None:
        if rid == "reward:6":
            starts.append(cluster.now())
        start(rid, sample, role)

    coord.handle, cluster.start = spy_handle, spy_start
    coord.run()
    assert coord.rl.version == 3 and sorted(rec.sample_ids) == list(range(3 * 12 * 4))
    assert [f["t"] for f in rec.failures] == [10.0, 40.0]
    assert all(f["sequences"] > 0 for f in rec.failures)  # it was serving
    # the restart's shift-up took restart_s more than a shift-up, and the replica then
    # served again (sequences were started on it between its two deaths)
    assert restarts and restarts[0].phases["restart_s"] == 7.0
    assert any(restarts[0].t <= t < 40.0 for t in starts)
    gpus = set(cluster._gpus("reward:6"))
    if excluded:
        assert [f["action"] for f in rec.failures] == ["restart", "excluded"]
        assert coord.stats.excluded == ["reward:6"] and coord.stats.engine_restarts == 1
        assert not any(t > 40.0 for t in starts)
        for spec in coord.topology.roles.values():
            assert all(not gpus & set(g) for g in spec.slots.values())
        assert not gpus & set(coord.shifts.owner)
    else:
        assert [f["action"] for f in rec.failures] == ["restart", "restart"]
        assert coord.stats.excluded == [] and coord.stats.engine_restarts == 2
        assert any(t > 40.0 for t in starts)


def test_no_failures_changes_nothing() -> None:
    """Off (the default) and on with its first death long after the run ends give the
    same run, bit for bit: the pending death changes no event order."""
    plain = simulate(load_config(None, [*TINY, "deployment.mode=pivot"]), None, progress=False)
    never = simulate(
        load_config(None, [*TINY, "deployment.mode=pivot", "sim.failures.mtbf_gpu_hours=1e12"]),
        None,
        progress=False,
    )
    for s in (plain, never):
        s.pop("wall_s")
    assert plain == never


def test_deaths_are_deterministic_for_a_seed_whatever_the_gpus_do() -> None:
    """A run with failures repeats exactly; the deaths' times and GPUs come from the seed
    alone (every mode of one seed meets the same ones)."""
    rows = []
    for _ in range(2):
        job, rec = _job("deployment.mode=pivot", *OFTEN)
        job.run()
        rows.append(rec.failures)
    assert rows[0] == rows[1] and rows[0]
    failures = load_config(None, OFTEN).sim.failures
    a, b = DeathClock(failures, 16, 0), DeathClock(failures, 16, 0)
    assert [a.next(float(i)) for i in range(5)] == [b.next(float(i)) for i in range(5)]
    assert DeathClock(failures, 16, 1).next(0.0) != DeathClock(failures, 16, 0).next(0.0)


@pytest.mark.parametrize("key", ["mtbf_gpu_hours", "restart_s", "job_restart_s"])
@pytest.mark.parametrize("value", ["-1", "inf", "nan"])
def test_bad_failure_settings_are_refused(key: str, value: str) -> None:
    with pytest.raises(ConfigError, match=f"sim.failures.{key}"):
        load_config(None, [f"sim.failures.{key}={value}"])


@pytest.mark.slow  # a benchmark
def test_bench_failures_json(tmp_path: Path, capsys) -> None:
    tree: dict = {}
    for item in TINY:
        key, value = item.split("=", 1)
        *parents, leaf = key.split(".")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(value)
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tree))
    args = ["bench", "failures", "--config", str(config), "--gpus", "16", "--steps", "2"]
    rc = main([*args, "--mtbf", "0.1", "--modes", "pivot+,disaggregated", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)  # stdout is the one JSON object
    assert out["gpus"] == 16 and out["steps"] == 2 and out["mtbf_gpu_hours"] == 0.1
    assert out["restart_s"] == 60.0 and out["restart_window_s"] == 600.0
    assert set(out["runs"]) == {"pivot+", "disaggregated"}
    for r in out["runs"].values():
        assert r["engine_failures"] > 0 and r["tokens_regenerated"] > 0
        assert r["job_restarts"] <= r["training_deaths"] and r["stalled"] is False
        assert r["tokens_per_s_no_failures"] > 0
        assert math.isclose(r["lost_share"], 1 - r["tokens_per_s"] / r["tokens_per_s_no_failures"])
