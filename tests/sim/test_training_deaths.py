"""Injected deaths on GPUs that train (`sim.failures`, sim/cluster.py `_training_death`):
between steps the trainer engine restarts (the coordinator hears it, the next step waits
for it); inside a step, or a second time within deployment.engine_restart_window_s, the
job stops, the whole cluster pauses for `job_restart_s` and the step starts over. Every
sample is still trained exactly once."""

from __future__ import annotations

import math

import pytest

from pivot_hpc.coordinator.events import TrainingDone
from pivot_hpc.sim.failures import MAX_STALLED_RESTARTS, JobStalled
from tests.sim.test_failures import MODES, OFTEN, _job
from tests.sim.tokens import run_keeping_tokens

SAMPLES = list(range(3 * 12 * 4))  # TINY: 3 steps of 12 prompts × 4 samples


def _spy(job, on_train=None):
    """Record every training try (step, asked at, computes from, seconds, extensions) and
    every event the coordinator handles; `on_train(step, try)` runs after each ask."""
    coord, cluster = job.coordinator, job.cluster
    tries: list[tuple[int, float, float, float, tuple[str, ...]]] = []
    events: list = []
    train, handle = cluster.train, coord.handle

    def spy_train(step, samples, extensions=()):
        train(step, samples, extensions)
        s = cluster._step
        tries.append((step, cluster.now(), s.start, s.seconds, tuple(extensions)))
        if on_train is not None:
            on_train(step, s)

    def spy_handle(ev) -> None:
        events.append(ev)
        handle(ev)

    cluster.train, coord.handle = spy_train, spy_handle
    return tries, events


def _done(events) -> dict[int, float]:
    return {ev.step: ev.t for ev in events if isinstance(ev, TrainingDone)}


def _restart_s(cluster) -> float:
    return cluster.restart_s + sum(cluster.training.shift_up_s.values())


def test_a_death_between_steps_restarts_the_trainer_and_delays_the_next_step(capsys) -> None:
    """Killed the instant step 1 ends (before the coordinator asks for step 2, whose batch
    is ready then): the coordinator records a training engine restart, as live, and step 2
    computes only once the restarted trainer has started and refit from GPS."""
    job, rec = _job("deployment.mode=pivot")
    coord, cluster = job.coordinator, job.cluster
    killed: list[float] = []

    def kill_at_end(step, s) -> None:
        if step == 1:
            killed.append(s.start + s.seconds)
            cluster.kill("training", at=killed[0])

    tries, events = _spy(job, kill_at_end)
    coord.run()
    assert coord.rl.version == 3 and sorted(rec.sample_ids) == SAMPLES
    (t,) = killed
    assert _done(events)[1] == t  # the step ended: the death fell between steps
    assert [(f["t"], f["role"], f["replica"], f["action"]) for f in rec.failures] == [
        (t, "training", "training", "restart")
    ]
    stats = coord.stats
    assert stats.engine_failures == 1 and stats.engine_restarts == 1 and not stats.excluded
    assert (cluster.training_deaths, cluster.training_restarts, cluster.job_restarts) == (1, 1, 0)
    (step2,) = [x for x in tries if x[0] == 2]
    _, asked, start, seconds, _ = step2
    assert asked == t  # its batch was waiting: without the death it would compute now
    assert start == t + _restart_s(cluster) > asked
    assert _done(events)[2] == start + seconds
    assert "training engine of training: injected engine death" in capsys.readouterr().out


def test_a_death_inside_a_step_stops_the_job_and_the_step_is_redone() -> None:
    """Killed halfway through step 0: the job stops; nothing happens for job_restart_s
    (no event falls in the pause), then step 0 computes again from the start: it ends
    job_restart_s plus its lost half later. The coordinator is not told (live, it stops
    with the job)."""
    job, rec = _job("deployment.mode=disaggregated", "sim.failures.job_restart_s=120")
    coord, cluster = job.coordinator, job.cluster
    killed: list[float] = []

    def kill_inside(step, s) -> None:
        if step == 0 and not killed:
            killed.append(s.start + s.seconds / 2)
            cluster.kill("training", at=killed[0])

    tries, events = _spy(job, kill_inside)
    run_keeping_tokens(coord)
    assert coord.rl.version == 3 and sorted(rec.sample_ids) == SAMPLES
    (t,) = killed
    seconds = tries[0][3]
    assert math.isclose(_done(events)[0], t + 120.0 + seconds)
    assert math.isclose(cluster.lost_train_s, seconds / 2)
    assert (cluster.training_deaths, cluster.training_restarts, cluster.job_restarts) == (1, 0, 1)
    assert coord.stats.engine_failures == 0 and not rec.failures
    assert not [ev for ev in events if t < ev.t < t + 120.0]  # the whole cluster paused


@pytest.mark.parametrize(("window", "actions"), [(600.0, ["restart"]), (0.0, ["restart"] * 2)])
def test_a_second_training_death_within_the_window_stops_the_job_not_the_simulation(
    window: float, actions: list[str]
) -> None:
    """Live, the coordinator stops the job (drains, saves a checkpoint, exits to be
    requeued) when training dies twice within the window. The simulator stops the job
    itself instead, without telling the coordinator (which would end the simulated run),
    and the run goes on from the pause."""
    job, rec = _job(
        "deployment.mode=pivot",
        f"deployment.engine_restart_window_s={window}",
        "sim.failures.job_restart_s=50",
    )
    coord, cluster = job.coordinator, job.cluster

    def kill_at_end(step, s) -> None:
        if step in (0, 1):
            cluster.kill("training", at=s.start + s.seconds)

    tries, events = _spy(job, kill_at_end)
    coord.run()
    assert coord.rl.version == 3 and sorted(rec.sample_ids) == SAMPLES
    assert [f["action"] for f in rec.failures] == actions
    again = len(actions) == 1
    assert cluster.training_deaths == 2 and cluster.job_restarts == int(again)
    assert coord.stats.engine_failures == coord.stats.engine_restarts == len(actions)
    assert cluster.lost_train_s == 0.0  # both fell between steps
    if again:  # step 2 was asked for at the end of the pause, no sooner
        end1 = _done(events)[1]
        (asked,) = [x[1] for x in tries if x[0] == 2]
        assert asked >= end1 + 50.0


@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_trains_every_sample_once_through_training_deaths(mode: str, capsys) -> None:
    """Random deaths everywhere, and a training death forced at the end of step 0 and
    halfway through step 1: every sequence finishes once with its target generated,
    every sample is trained once, and every training death is a restart or a job stop."""
    job, rec = _job(*MODES[mode], *OFTEN, "sim.failures.job_restart_s=30")
    coord, cluster = job.coordinator, job.cluster
    forced: set[int] = set()

    def kill(step, s) -> None:
        if step not in forced:
            forced.add(step)
            if step == 0:
                cluster.kill("training", at=s.start + s.seconds)
            elif step == 1:
                cluster.kill("training", at=s.start + s.seconds / 2)

    _spy(job, kill)
    run_keeping_tokens(coord)
    rl, stats = coord.rl, coord.stats
    assert rl.version == 3 and not rl.batches and not coord.samples
    assert sorted(rec.sample_ids) == SAMPLES == list(range(rl.next_sample_id))
    for role in ("rollout", "reward"):
        assert coord.schedulers[role].n_seq == 0
        coord.schedulers[role].check_invariants()
    assert cluster.training_deaths >= 2 and cluster.job_restarts >= 1
    assert cluster.training_deaths == cluster.training_restarts + cluster.job_restarts
    assert stats.engine_failures == len(rec.failures) == cluster.deaths + cluster.training_restarts
    trained = [f for f in rec.failures if f["role"] == "training"]
    assert len(trained) == cluster.training_restarts
    assert all(f["action"] == "restart" and f["replica"] == "training" for f in trained)
    capsys.readouterr()


def test_an_elastic_extension_dying_inside_a_step_stops_the_job() -> None:
    """An extension's GPUs are training's while it is up: a death on one inside a step
    it trains is a job stop too (training-bound, so steps run on extensions)."""
    job, rec = _job(
        "deployment.mode=pivot",
        "planner.elastic_training=true",
        "models.policy_catalog=qwen2.5-7b",
        "loop.batch_prompts=24",
        "sim.failures.job_restart_s=40",
    )
    coord, cluster = job.coordinator, job.cluster
    killed: list[tuple[str, float]] = []

    def kill_extension(step, s) -> None:
        ext = [g for g in s.groups if g != "training"]
        if ext and not killed:
            slot = int(ext[0].split(":")[1])
            assert cluster._training_group(slot * cluster.training.tp) == ext[0]
            killed.append((ext[0], s.start + s.seconds / 2))
            cluster.kill(*killed[0])

    tries, events = _spy(job, kill_extension)
    coord.run()
    assert coord.rl.version == 3 and sorted(rec.sample_ids) == list(range(3 * 24 * 4))
    assert killed, tries  # some step trained on an extension
    (_, t) = killed[0]
    (step, _, _, seconds, _) = next(x for x in tries if x[4])
    assert math.isclose(_done(events)[step], t + 40.0 + seconds)
    assert cluster.job_restarts == 1 and cluster.training_deaths == 1


def test_a_step_that_never_escapes_the_deaths_ends_the_run_with_job_stalled() -> None:
    """A death in every try of a step: after MAX_STALLED_RESTARTS job stops in a row the
    run ends with JobStalled instead of simulating forever."""
    job, _ = _job("deployment.mode=disaggregated", "sim.failures.job_restart_s=1")
    cluster = job.cluster
    start_step = cluster._start_step

    def kill_every_try(step, start) -> None:
        start_step(step, start)
        cluster.kill("training", at=start + step.seconds / 2)

    cluster._start_step = kill_every_try
    with pytest.raises(JobStalled, match="job stops in a row"):
        job.coordinator.run()
    assert cluster.job_restarts == MAX_STALLED_RESTARTS + 1
    assert job.coordinator.rl.version == 0  # step 0 never trained


def test_training_deaths_off_leaves_training_gpus_to_deaths_elsewhere(capsys) -> None:
    """`sim.failures.training=false` (what `bench failures` runs without
    --training-deaths): the same seed's deaths on training's GPUs are counted, not dealt,
    so only inference engines die."""
    counts = {}
    for on in (True, False):
        job, _ = _job(
            "deployment.mode=disaggregated",  # training holds its GPUs throughout
            *OFTEN,
            "sim.failures.mtbf_gpu_hours=0.03",
            "deployment.engine_restart_window_s=0",
            f"sim.failures.training={str(on).lower()}",
        )
        job.run()
        c = job.cluster
        counts[on] = (c.training_deaths, c.job_restarts, c.deaths_elsewhere)
        assert job.coordinator.rl.version == 3
    assert counts[True][0] > 0
    assert counts[False][:2] == (0, 0) and counts[False][2] > 0
    capsys.readouterr()


def test_simulate_reports_training_deaths_and_job_stops(capsys) -> None:
    from pivot_hpc.job.config import load_config
    from pivot_hpc.job.simulate import simulate
    from tests.sim.test_simulator import TINY

    overrides = ["deployment.mode=disaggregated", *OFTEN, "sim.failures.mtbf_gpu_hours=0.03"]
    summary = simulate(load_config(None, [*TINY, *overrides]), None, progress=False)
    assert summary["training_deaths"] > 0
    assert 0 <= summary["job_restarts"] <= summary["training_deaths"]
    capsys.readouterr()
