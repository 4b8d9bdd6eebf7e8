"""The monitor's refits: τ_shift from measured shifts, A–D from decode-step statistics;
and the planner's promise that a shift it makes pays for its measured cost."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivot_hpc.coordinator.monitor import OnlineFit, ShiftClock
from pivot_hpc.planner import Snapshot, Topology, TrainingState, replica_id
from pivot_hpc.planner.config import PlannerConfig, ShiftTimes
from pivot_hpc.planner.pairs import penalty
from pivot_hpc.planner.planner import make_strategy
from pivot_hpc.planner.prewarm import reload_worth, training_return
from pivot_hpc.scheduler import Scheduler, SeqState, ThroughputModel


def test_shift_clock_starts_from_the_config_and_follows_measurements() -> None:
    configured = ShiftTimes(rollout=0.5, reward=0.5, training=1.0)
    clock = ShiftClock(configured, alpha=0.5)
    assert clock.shift_times() == configured  # nothing measured yet
    clock.observe("rollout", "down", 0.02)
    clock.observe("reward", "up", 0.1)
    t = clock.shift_times()
    assert t.rollout == 0.02 + 0.1  # its down + the up of what takes its GPU
    assert t.reward == 0.5 and t.training == 1.0  # not measured: configured
    for _ in range(30):  # shifts got slower: the estimate follows
        clock.observe("rollout", "down", 0.2)
    assert abs(clock.shift_times().rollout - 0.3) < 1e-3


def synthetic_steps(model: ThroughputModel, rng, k: int, noise: float = 0.02):
    n = rng.integers(1, 32, size=k)
    tok = n * rng.integers(20, 400, size=k)
    lat = np.array([model.latency(int(a), int(b)) for a, b in zip(n, tok, strict=True)])
    lat *= 1 + noise * rng.standard_normal(k)
    return list(zip(lat.tolist(), n.tolist(), tok.tolist(), strict=True))


def test_online_fit_converges_and_follows_an_engine_that_changes() -> None:
    rng = np.random.default_rng(0)
    first = ThroughputModel(A=2e-6, B=4e-3, C=3e-4, D=1e-3)
    second = ThroughputModel(A=6e-6, B=9e-3, C=6e-4, D=2e-3)  # e.g. another job shares it
    fit = OnlineFit(window=256, min_steps=64, every=64)
    fitted = None
    for _ in range(8):
        fit.add(synthetic_steps(first, rng, 64))
        fitted = fit.refit() or fitted
    assert fitted is not None

    def rel_err(m: ThroughputModel, truth: ThroughputModel) -> float:
        probe = [(n, n * t) for n in (1, 4, 16, 32) for t in (50, 300)]
        return max(abs(m.latency(n, k) / truth.latency(n, k) - 1) for n, k in probe)

    assert rel_err(fitted, first) < 0.05
    for _ in range(8):  # the window forgets the old engine
        fit.add(synthetic_steps(second, rng, 64))
        fitted = fit.refit() or fitted
    assert rel_err(fitted, second) < 0.05


def test_online_fit_waits_for_varied_steps() -> None:
    fit = OnlineFit(min_steps=8, every=8)
    fit.add([(0.01, 4, 400)] * 20)  # one batch size: B vs C·N is not identifiable
    assert fit.refit() is None


MODEL = ThroughputModel(A=1e-6, B=5e-3, C=2e-4, D=1e-3)


@settings(max_examples=60, deadline=None)
@given(
    n_rollout=st.integers(1, 6),
    n_reward=st.integers(1, 6),
    queued_rollout=st.integers(0, 120),
    queued_reward=st.integers(0, 120),
    tau=st.floats(0.001, 30.0),
    horizon=st.floats(0.0, 300.0),
    seed=st.integers(0, 1000),
    plus=st.booleans(),
    training=st.sampled_from(["busy", "idle, batch in flight", "down, batch in flight"]),
)
def test_planner_never_shifts_at_a_loss_on_measured_cost(
    n_rollout, n_reward, queued_rollout, queued_reward, tau, horizon, seed, plus, training
) -> None:
    """Whatever the snapshot, a plan the pivot strategy makes has a benefit that covers
    its penalty at the (measured) τ_shift of the topology it was given; pivot+'s penalty
    adds the re-prefill of what it migrates and the return of idle training on top of
    that, and its training pre-warm hides a reload worth at least its penalty."""
    rng = np.random.default_rng(seed)
    topo = Topology.build(
        num_gpus=16,
        gpus_per_node=8,
        tp={"rollout": 1, "reward": 1},
        kv_capacity={"rollout": 20_000, "reward": 20_000},
        models={"rollout": MODEL, "reward": MODEL},
        training_gpus=[14, 15],
        shift_time=ShiftTimes(rollout=tau, reward=tau, training=tau),
        prefill_s_per_token={"rollout": 1e-4, "reward": 1e-4},
    )
    scheds = {r: Scheduler(r) for r in ("rollout", "reward")}
    for g in range(n_rollout):
        scheds["rollout"].add_replica(replica_id("rollout", g), 20_000, MODEL)
    for g in range(n_rollout, n_rollout + n_reward):
        scheds["reward"].add_replica(replica_id("reward", g), 20_000, MODEL)
    sid = 0
    for role, k in (("rollout", queued_rollout), ("reward", queued_reward)):
        for _ in range(k):
            scheds[role].submit(SeqState(sid, int(rng.integers(20, 600))))
            sid += 1
        scheds[role].dispatch()
    state = {
        "busy": TrainingState(active=True, busy=True),
        "idle, batch in flight": TrainingState(active=True, batch_pending=True),
        "down, batch in flight": TrainingState(batch_pending=True),
    }[training]
    snap = Snapshot(topo, scheds, state)
    cfg = PlannerConfig(horizon_s=horizon, strategy="pivot+" if plus else "pivot")
    plan = make_strategy(cfg).plan(snap)
    if plan.is_noop:
        return
    phi = penalty(snap, plan.down)
    gain = horizon * (plan.throughput_expected - plan.throughput_current)
    if plan.up == ["training"]:  # pivot+'s pre-warm: Eq. 1 unchanged, a reload hidden
        assert plus and not state.active
        assert plan.penalty == pytest.approx(phi)
        assert plan.benefit == pytest.approx(reload_worth(snap) - phi) and plan.benefit >= 0
        return
    if plus:
        floor = phi + training_return(snap) * ("training" in plan.down)
        assert plan.penalty >= floor - 1e-9 * max(1.0, floor)
    else:
        assert abs(plan.penalty - phi) <= 1e-9 * max(1.0, phi)
    assert gain > plan.penalty  # the benefit covers the measured cost
    assert plan.benefit > 0
