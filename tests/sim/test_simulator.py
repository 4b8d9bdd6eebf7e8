"""The coordinator driven by the discrete-event simulated cluster (docs/design.md §8)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pivot_hpc.coordinator.hooks import Hooks
from pivot_hpc.coordinator.rl_state import ConservationError, Sample
from pivot_hpc.job import build as builder
from pivot_hpc.job import modes
from pivot_hpc.job.config import load_config
from pivot_hpc.job.sim_backend import SimBackend
from pivot_hpc.job.simulate import build, simulate
from pivot_hpc.planner import role_of
from pivot_hpc.scheduler import ThroughputModel
from pivot_hpc.sim.catalog import HARDWARE, MODELS, InferenceCosts, TrainingCosts, inference_costs
from pivot_hpc.sim.cluster import SimCluster
from pivot_hpc.sim.workload import SimPayload
from pivot_hpc.telemetry import open_run
from tests.sim.tokens import run_keeping_tokens

TINY = [
    "cluster.nodes=2",
    "cluster.gpus_per_node=8",
    "rollout.tp=1",
    "training.num_gpus=4",
    "loop.steps=3",
    "loop.batch_prompts=12",
    "loop.samples_per_prompt=4",
    "loop.monitor_interval_s=2.0",
    "planner.interval_s=2.0",
    "models.policy_catalog=qwen2.5-1.5b",
    "models.genrm_catalog=glm-z1-9b",
    # the paper's caps and veRL's activation recompute
    "rl.max_response_tokens=15000",
    "rl.reward.genrm_max_tokens=20000",
    "rl.trainer.recompute=full",
    "reward.tp=1",
]


def tiny(mode: str, *extra: str):
    return load_config(None, [*TINY, f"deployment.mode={mode}", *extra])


MODES = [
    ("colocated", "pivot"),
    ("disaggregated", "pivot"),
    ("rr_colocated", "pivot"),
    ("pivot", "pivot"),
    ("pivot", "pivot+"),
    ("pivot", "static"),
    ("pivot", "rule"),
    ("pivot", "vanilla"),
]
# beyond the paper: elastic training and pipeline admission, on together and apart
OPTIONS = {
    "paper": [],
    "elastic": ["planner.elastic_training=true"],
    "elastic+pipeline": ["planner.elastic_training=true", "scheduler.admission=pipeline"],
    "rebalance": ["scheduler.rebalance=true"],
}


@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize("late", [0.0, 0.3], ids=["exact", "late-finishes"])
@pytest.mark.parametrize(("mode", "strategy"), MODES)
def test_every_mode_completes_with_conservation(
    mode: str, strategy: str, late: float, options: str
) -> None:
    """`late`: that share of aborted sequences finishes just before its abort arrives (a
    live engine's race), so the coordinator's late-abort path runs on every shift kind."""
    cfg = tiny(mode, f"planner.strategy={strategy}", *OPTIONS[options])
    trained: list[int] = []

    class Record(Hooks):
        def on_step(self, coord, step, m):
            trained.append(step)

    job = builder.build(cfg, SimBackend(hooks=Record(), late_finish_share=late))
    coord, cluster = job.coordinator, job.cluster
    job.run()
    rl = coord.rl
    assert rl.version == 3 and trained == [0, 1, 2]
    # Every sample rolled out, rewarded and trained exactly once (RLState raises on a
    # second time); nothing is left in flight or in a queue.
    assert rl.released == 3 and not rl.batches and not coord.samples
    assert rl.next_sample_id == 3 * 12 * 4
    for role in ("rollout", "reward"):
        assert coord.schedulers[role].n_seq == 0
        coord.schedulers[role].check_invariants()
    bound = 0 if mode == "colocated" else 2
    assert max(coord.stats.staleness) <= bound
    if mode == "pivot":
        assert coord.stats.plans > 0
    if mode == "pivot" and strategy == "pivot":
        assert coord.stats.shifts_up > 0
        assert (cluster.late_finishes > 0) == (late > 0)
    assert not coord.training.extensions or coord.topology.elastic  # only where elastic
    if options != "rebalance":
        assert coord.stats.rebalanced == 0
    elif strategy == "pivot":  # (every static mode, and pivot's planner)
        assert coord.stats.rebalanced > 0
    elif strategy == "vanilla":  # the ablation without migration moves nothing
        assert coord.stats.rebalanced == 0


@pytest.mark.slow
def test_pivot_plus_never_moves_gpus_back_before_a_plan_has_repaid() -> None:
    """In a whole simulated run, no pivot+ plan takes GPUs back to a role before the plan
    that took them from it has repaid its penalty (φ / gain after its decision), unless
    that role starves (work and no replica)."""
    # group 3's models under pipeline admission: the paper's pivot moves GPUs back and
    # forth there every few seconds (docs/results/2026-12-simulator-paper-groups.md)
    cfg = load_config(
        Path(__file__).parents[2] / "configs/groups/group3-qwen32b-qwen30b.yaml",
        ["planner.strategy=pivot+", "scheduler.admission=pipeline", "loop.steps=4"],
        files=False,
    )
    coord, cluster, _ = build(cfg)
    repaid: list[tuple[str, str, float]] = []  # (up role, down role, repaid at)
    execute = coord.shifts.execute

    def checked(plan) -> None:
        now = cluster.now()
        downs = {role_of(r) for r in plan.down}
        if not plan.is_noop and not plan.mandatory:
            sched = coord.schedulers.get(plan.up_role)
            starves = sched is not None and sched.n_seq and not sched.replicas
            for up, down, at in repaid:
                back = plan.up_role == up and down in downs and now < at
                assert not back or starves, plan.reason
            gain = plan.throughput_expected - plan.throughput_current
            if plan.penalty > 0 and gain > 0:
                repaid.extend((d, plan.up_role, now + plan.penalty / gain) for d in downs)
        execute(plan)

    coord.shifts.execute = checked
    coord.run()
    assert coord.rl.version == 4
    assert repaid, "no plan paid a penalty: the check saw nothing"


@pytest.mark.parametrize("options", list(OPTIONS))
def test_pivot_plus_plans_at_a_stall_without_waiting_for_its_interval(options: str) -> None:
    """With a planning interval longer than the run, pivot+ still finishes: after the
    first plan, each stall (GPUs idle while the other role has work, a training batch
    waiting for its GPUs) gets a plan at once. The paper's planner plans once at the
    start and then waits: the stall guard fires."""
    once = ["planner.interval_s=1e9", *OPTIONS[options]]
    coord, _, _ = build(tiny("pivot", "planner.strategy=pivot+", *once))
    mode, plans = coord.mode, []
    plan = mode._plan
    mode._plan = lambda c: (plans.append(modes.stall_cues(c)), plan(c))[-1]
    coord.run()
    assert coord.rl.version == 3 and not coord.samples
    assert len(plans) >= 3 and all(plans[1:]), plans  # after the first, only at stalls
    paper, _, _ = build(tiny("pivot", "planner.strategy=pivot", *once))
    with pytest.raises(ConservationError, match="no progress"):
        paper.run()


def test_elastic_training_grows_and_trains_faster() -> None:
    """Training-bound (a long step on 4 GPUs, inference short): before each step training
    takes the GPUs inference leaves idle, trains data parallel on them (the simulated step
    shrinks with the GPUs) and gives them back; the run ends sooner than without."""
    heavy = ["models.policy_catalog=qwen2.5-7b", "loop.batch_prompts=24"]
    seen: list[tuple[str, int]] = []
    coord, cluster, _ = build(tiny("pivot", *heavy, "planner.elastic_training=true"))
    train = cluster.train
    cluster.train = lambda step, samples, ext=(): (
        seen.append((step, len(ext))),
        train(step, samples, ext),
    )[-1]
    coord.run()
    assert max(n for _, n in seen) > 0, seen  # some step ran on extensions
    assert coord.rl.version == 3 and not coord.samples
    plain, _, _ = build(tiny("pivot", *heavy))
    plain.run()
    assert coord.cluster.now() < plain.cluster.now()


def test_deterministic_for_a_seed() -> None:
    a = simulate(tiny("pivot"), None, progress=False)
    b = simulate(tiny("pivot"), None, progress=False)
    for s in (a, b):
        s.pop("wall_s")
    assert a == b
    c = simulate(tiny("pivot", "sim.seed=7"), None, progress=False)
    assert c["tokens"] != a["tokens"]


def test_migrations_keep_generated_tokens() -> None:
    """A sequence aborted by a shift resumes with its tokens: generated totals match."""
    coord, _cluster, _ = build(tiny("pivot"))
    seen = run_keeping_tokens(coord)
    assert coord.stats.migrated > 0
    assert len(seen) == 2 * 3 * 12 * 4


def test_replica_advances_by_the_throughput_model() -> None:
    """One replica, constant step time L: a sequence needing k tokens ends at prefill + k·L."""
    L = 0.01
    costs = InferenceCosts(
        model=ThroughputModel(A=0.0, B=L, C=0.0, D=0.0),
        kv_capacity_tokens=10**6,
        prefill_s_per_token=1e-4,
        shift_up_s={"read_s": 1.0},
        shift_down_s={"discard_s": 0.5},
        weight_update_s=0.2,
    )
    train = TrainingCosts(
        gpus=1,
        tp=1,
        flops_per_token=0.0,
        attn_flops_per_token2=0.0,
        flops_per_s_per_gpu=1.0,
        grad_bytes_per_gpu=0.0,
        gpus_per_node=8,
        link_gb_s=(900.0, 50.0),
        shift_up_s={},
        shift_down_s={},
        extension_up_s={},
        extension_down_s={},
        publish_s=0.0,
    )
    sim = SimCluster(inference={"rollout": costs, "reward": costs}, training=train)
    sim.shift_up("rollout:0", 0)
    (up,) = sim.poll(10.0)
    assert up.kind == "up" and up.t == pytest.approx(1.0)
    payload = SimPayload(response_len=50, judgement_len=1, correct=True, genrm_score=1.0)
    sim.start("rollout:0", Sample(1, 0, 0, 0, prompt_len=100, payload=payload), "rollout")
    sim.start(
        "rollout:0",
        Sample(2, 0, 0, 1, prompt_len=100, payload=SimPayload(20, 1, True, 1.0)),
        "rollout",
    )
    (first,) = sim.poll(100.0)
    # two prefills of 100 tokens (0.01 s each), then 20 iterations of L
    assert first.seq_id == 2 and first.t == pytest.approx(1.0 + 0.02 + 20 * L)
    assert sim.abort({1: "rollout:0"}) == {1: 100 + 20}  # kept 20 generated tokens
    sim.start("rollout:0", Sample(1, 0, 0, 0, prompt_len=100, payload=payload), "rollout")
    (second,) = sim.poll(100.0)
    # re-prefill of 120 tokens, then the 30 tokens it still needed
    assert second.seq_id == 1 and second.generated == 50 and second.length == 150
    assert second.t == pytest.approx(first.t + 0.012 + 30 * L)


def test_catalog_from_first_principles() -> None:
    q7 = MODELS["qwen2.5-7b"]
    assert q7.params == pytest.approx(7.62e9, rel=0.01)
    moe = MODELS["qwen3-30b-a3b"]
    assert moe.params == pytest.approx(30.5e9, rel=0.02)
    assert moe.active_params == pytest.approx(3.3e9, rel=0.03)
    c = inference_costs(q7, HARDWARE["h20"], 1)
    # dense weights streamed at the calibrated fraction of HBM bandwidth
    assert c.decode.B(1) == pytest.approx(q7.params * 2 / (4.0e12 * 0.34))
    assert 5e5 < c.kv_capacity_tokens < 2e6
    with pytest.raises(Exception, match="does not fit"):
        inference_costs(MODELS["qwen2.5-72b"], HARDWARE["h20"], 1)


def test_colocated_never_overlaps_stages_and_telemetry_is_complete(tmp_path: Path) -> None:
    simulate(tiny("colocated"), tmp_path, progress=False)
    run = open_run(tmp_path)
    alloc = run["allocation"]
    busy = np.stack([alloc["rollout_gpus"], alloc["reward_gpus"], alloc["training_gpus"]])
    assert ((busy > 0).sum(axis=0) <= 1).all(), "two stages held GPUs at once"
    for name in ("throughput", "allocation", "shifts", "planner", "migrations", "steps"):
        assert name in run.datasets
    steps = run["steps"]
    assert list(steps["step"]) == [0, 1, 2]
    assert (steps["staleness_max"] == 0).all()
    assert run.attr("mode") == "colocated"


def test_simulate_cli_json_and_report(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pivot_hpc",
            "simulate",
            "configs/groups/group1-qwen1.5b-glm9b.yaml",
            "--mode",
            "pivot",
            "--steps",
            "2",
            "--out",
            str(tmp_path),
            "--json",
            "loop.batch_prompts=8",
            "--gpus",
            "16",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parents[2],
    )
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["gpus"] == 16 and summary["steps"] == 2 and summary["tokens_per_s"] > 0
    rep = subprocess.run(
        [sys.executable, "-m", "pivot_hpc", "report", str(tmp_path), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert rep.returncode == 0, rep.stderr
    data = json.loads(rep.stdout)
    assert data["mode"] == "pivot" and data["steps"] == 2
    assert data["tokens_per_s"] == pytest.approx(summary["tokens_per_s"], rel=1e-6)
    for key in ("shifts", "reward_mean_first", "reward_mean_last"):
        assert key in data


def test_bad_split_is_a_clear_error() -> None:
    from pivot_hpc.config import ConfigError

    with pytest.raises(ConfigError, match="rollout_gpus"):
        build(tiny("disaggregated", "deployment.rollout_gpus=10", "deployment.reward_gpus=4"))
    with pytest.raises(ConfigError, match="colocated runs synchronously"):
        tiny("colocated", "deployment.staleness=2")


def test_a_shift_up_on_the_gpus_of_a_shift_down_is_chained_after_it() -> None:
    """A replica taking over exactly the GPUs of one shifting down is sent up with that
    down (`after`): it starts when the down is done and finishes its own phases later;
    the coordinator hears of the down first, and the run conserves every sample."""
    coord, cluster, _ = build(tiny("pivot", "planner.strategy=pivot"))
    chained: list[tuple[float, str, str]] = []  # (when sent, up rid, down rid)
    done: list[tuple[float, str, str]] = []  # (t, rid, kind) in the order delivered
    shift_up, poll = cluster.shift_up, cluster.poll

    def recording_up(rid: str, version: int, after: str | None = None) -> None:
        if after is not None:
            assert set(coord.topology.gpus_of(rid)) == set(coord.topology.gpus_of(after))
            assert coord.shifts.shifting.get(after) == "down"
            chained.append((cluster.now(), rid, after))
        shift_up(rid, version, after=after)

    def recording_poll(until: float) -> list:
        events = poll(until)
        done.extend((e.t, e.rid, e.kind) for e in events if hasattr(e, "kind"))
        return events

    cluster.shift_up, cluster.poll = recording_up, recording_poll
    coord.run()
    assert coord.rl.version == 3 and coord.stats.shifts_chained == len(chained) > 0
    for sent, rid, after in chained:
        down = next(
            i for i, (t, r, k) in enumerate(done) if r == after and k == "down" and t >= sent
        )
        up = next(i for i, (t, r, k) in enumerate(done) if r == rid and k == "up" and i > down)
        phases = sum(cluster.inference[role_of(rid)].shift_up_s.values())
        # its phases alone, plus any wait for its node's host link (other reads first)
        wait = done[up][0] - (done[down][0] + phases)
        assert phases > 0 and wait >= -1e-9


def test_a_chained_shift_up_after_a_down_that_already_fired_starts_at_once() -> None:
    """The coordinator may chain after a down whose completion it has not handled yet
    (the same batch of events): the cluster then starts the up at once."""
    costs = inference_costs(MODELS["qwen2.5-1.5b"], HARDWARE["h20"], 1)
    sim = SimCluster(inference={"rollout": costs, "reward": costs}, training=None)
    up_s = sum(costs.shift_up_s.values())
    sim.shift_up("rollout:0", 0)
    assert [e.kind for e in sim.poll(1e9)] == ["up"]
    sim.shift_down("rollout:0")
    sim.shift_up("reward:0", 0, after="rollout:0")  # chained: waits for the down
    (down,) = sim.poll(1e9)
    (chained,) = sim.poll(1e9)
    assert (down.kind, chained.kind, chained.rid) == ("down", "up", "reward:0")
    assert chained.t == pytest.approx(down.t + up_s)
    sim.shift_down("reward:0")
    (down,) = sim.poll(1e9)
    sim.shift_up("rollout:0", 0, after="reward:0")  # its down has fired already
    (late,) = sim.poll(1e9)
    assert late.rid == "rollout:0" and late.t == pytest.approx(down.t + up_s)


@pytest.mark.parametrize("strategy", ["pivot", "pivot+"])
def test_training_never_starts_inside_a_plan(strategy: str) -> None:
    """A sequence that finishes just before its abort lands is handled inside a plan's
    take-down; the training step it makes ready must not start between the plan's downs
    and its ups (a live elastic extension then joined with the previous policy version:
    the training rank had trained past it when asked to publish)."""
    cfg = tiny("pivot", f"planner.strategy={strategy}", "planner.elastic_training=true")
    job = builder.build(cfg, SimBackend(late_finish_share=0.5))
    coord = job.coordinator
    carry_out = coord.shifts.execute
    started_inside: list = []

    def watched(plan) -> None:  # (instrumentation: the real executor runs)
        before = coord.training.busy
        carry_out(plan)
        if coord.training.busy and not before:
            started_inside.append(plan)

    coord.shifts.execute = watched
    job.run()
    assert coord.rl.version == cfg.loop.steps and not started_inside


def test_pipeline_admission_spreads_over_the_slots_a_role_can_hold() -> None:
    """C* is spread over the slots the role can hold, not training's own GPUs: sized over
    every slot of a 32-GPU cluster whose training holds 16, a role could reach only half
    of C* (it held group 4's GenRM to small batches)."""
    cfg = load_config(
        Path(__file__).parents[2] / "configs/groups/group1-qwen1.5b-glm9b.yaml",
        ["planner.strategy=pivot+", "scheduler.admission=pipeline", "loop.steps=2"],
        files=False,
    )
    coord, _, _ = build(cfg)
    coord.run()
    topo, adm = coord.topology, coord.admission
    holdable = len(topo.roles["reward"].slots) - len(topo.training_gpus)  # tp 1
    assert holdable == 16 and coord.training.active
    assert coord._slots("reward") == holdable
    c = adm.concurrency("reward")
    assert c > 0 and coord.schedulers["reward"].replica_limit == -(-c // holdable)
