"""A shift-down while tool-calling trajectories are parked (issue 37, docs/guide/agentic.md):
a parked trajectory has left the rollout scheduler, so taking down the replica its last
turn ran on sends it no abort, and its next turn simply runs elsewhere — greedy, every
trajectory ends with the same tokens as in a run without the shift.

Real parts, in one process and without MPI: two hf engines (rollout replicas) with the
warmed-up calculator policy's weights (configs/tiny-tools.yaml), the rollout `Scheduler`,
the coordinator's `TurnLoop` and `ShiftExecutor.take_down` (Alg. 3: abort what runs on
the leaving replica, re-dispatch), the live turn source (`LiveSamples`: context ids, the
cut at the call's closing tag, observations as ids) and the sandbox server running the
calculator. `EngineCluster` stands where `runtime.live_cluster.LiveCluster` stands: it
starts turns on the engines as the live cluster does (the aborted tokens resumed by
re-prefill) and records every abort it is asked for.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from pathlib import Path

import pytest
import torch

from pivot_hpc.agentic.server import SandboxServer
from pivot_hpc.bench.calculator_eval import held_out
from pivot_hpc.coordinator.coordinator import NullTelemetry, Stats
from pivot_hpc.coordinator.events import SequenceFinished, ToolReturned
from pivot_hpc.coordinator.rl_state import Sample
from pivot_hpc.coordinator.shifts import ShiftExecutor
from pivot_hpc.coordinator.turns import TurnLoop
from pivot_hpc.engines.hf.engine import HFEngine
from pivot_hpc.job.config import load_config
from pivot_hpc.models.zoo import load_model
from pivot_hpc.recipes.tiny_models import ensure_model
from pivot_hpc.rl.rewards import verifiable_reward
from pivot_hpc.runtime.live_samples import LiveSamples
from pivot_hpc.scheduler import Scheduler, SeqState, ThroughputModel

TOOLS = Path(__file__).parents[2] / "configs" / "tiny-tools.yaml"
ROLE = "rollout"
RIDS = ("rollout:0", "rollout:1")
MODEL = ThroughputModel(A=1e-6, B=5e-3, C=2e-4, D=1e-3)
KV = 8192
WAVE = 3  # trajectories per wave (two waves)


@pytest.fixture(scope="module")
def setup():
    torch.set_num_threads(1)
    cfg = load_config(TOOLS)
    model, tok = load_model(ensure_model(cfg.models, "policy", progress=False))
    src = LiveSamples(held_out(cfg.models, 2 * WAVE), tok, cfg.rl, tools=cfg.tools)
    # greedy (RLConfig refuses temperature 0 for training; the turns' sampling is the test's)
    src.rollout_sampling = dataclasses.replace(src.rollout_sampling, temperature=0.0)
    src.turn_sampling = dataclasses.replace(src.turn_sampling, temperature=0.0)
    with SandboxServer(src.registry, cfg.tools.sandbox_limits(), max_concurrent=2) as tools:
        yield cfg, model, src, tools


class EngineCluster:
    """The part of the `Cluster` protocol the turn loop and a shift-down use, over real
    engines in this process; each engine's `abort` is wrapped only to count its calls."""

    def __init__(self, engines: dict[str, HFEngine], source: LiveSamples, tools) -> None:
        self.engines, self.source, self.tools = engines, source, tools
        self.t0 = time.monotonic()
        self.partial: dict[int, object] = {}  # aborted SeqResults, resumed by re-prefill
        self.abort_requests: list[dict[int, str]] = []  # every `where` asked for
        self.aborted_tokens: dict[int, int] = {}  # tokens an abort took back, per sequence
        self.engine_aborts: dict[str, list[int]] = {rid: [] for rid in engines}
        self.started: list[tuple[str, int, int]] = []  # (replica, sample, its turn)
        self.down: list[str] = []
        for rid, engine in engines.items():
            real = engine.abort

            def counted(seq_id: int, rid: str = rid, real=real):
                self.engine_aborts[rid].append(seq_id)
                return real(seq_id)

            engine.abort = counted  # type: ignore[method-assign]

    def now(self) -> float:
        return time.monotonic() - self.t0

    def start(self, rid: str, sample: Sample, role: str) -> None:
        assert role == ROLE and rid not in self.down, (rid, role)
        prompt, sampling = self.source.rollout_turn(sample)  # as LiveCluster.start
        partial = self.partial.pop(sample.sample_id, None)
        gen = list(partial.token_ids) if partial is not None else None
        lps = list(partial.logprobs) if partial is not None else None
        self.engines[rid].add(sample.sample_id, prompt, gen, sampling, lps)
        self.started.append((rid, sample.sample_id, sample.turn))

    def abort(self, where) -> dict[int, int | None]:
        self.abort_requests.append(dict(where))
        out: dict[int, int | None] = {}
        for seq_id, rid in where.items():
            res = self.engines[rid].abort(seq_id)
            self.partial[seq_id] = res
            self.aborted_tokens[seq_id] = len(res.token_ids)
            out[seq_id] = len(res.prompt_ids) + len(res.token_ids)
        return out

    def take_finished(self, role: str, seq_id: int) -> SequenceFinished:
        raise AssertionError("no abort here comes after its sequence finished")

    def shift_down(self, rid: str) -> None:
        assert not self.engines[rid].has_unfinished(), f"{rid} goes down with work on it"
        self.down.append(rid)

    def prefill_time(self, role: str, tokens: int) -> float:
        return 0.0

    def call_tool(self, call) -> None:
        self.tools.submit(call)

    def step(self) -> list[SequenceFinished]:
        """One engine step on every replica with work: the turns that finished."""
        out = []
        for rid, engine in self.engines.items():
            if rid in self.down or not engine.has_unfinished():
                continue
            for r in engine.step():
                length = len(r.prompt_ids) + len(r.token_ids)
                out.append(
                    SequenceFinished(self.now(), ROLE, rid, r.seq_id, length, len(r.token_ids), r)
                )
        return out

    def busy(self) -> bool:
        return any(e.has_unfinished() for rid, e in self.engines.items() if rid not in self.down)


class Host:
    """What `TurnLoop` and `ShiftExecutor` use of their coordinator; a finished turn is
    handled as `Coordinator._on_finished` handles a rollout turn (no reward role here)."""

    def __init__(self, cluster: EngineCluster, source: LiveSamples) -> None:
        self.cluster = cluster
        self.source = source
        sched = Scheduler(ROLE, affinity_slack=1.0)  # a parked turn prefers its replica
        for rid in RIDS:
            sched.add_replica(rid, KV, MODEL)
        self.schedulers = {ROLE: sched}
        self.telemetry = NullTelemetry()
        self.stats = Stats()
        self.draining = False
        self.samples: dict[int, Sample] = {}
        self.done: dict[int, Sample] = {}
        self.shifts = ShiftExecutor(self, clock=None)
        self.turns = TurnLoop(
            self,
            source,
            call_timeout_s=source.tools.call_timeout_s,
            rolled_out=lambda s, n, r: self.done.setdefault(s.sample_id, s),
        )

    # ShiftHost / the TurnLoop's coordinator
    def dispatch(self, role: str) -> None:
        if self.shifts.hold_dispatch:
            return
        for seq_id, rid in self.schedulers[role].dispatch():
            self.start_sequence(role, rid, seq_id)

    def start_sequence(self, role: str, rid: str, seq_id: int) -> None:
        self.cluster.start(rid, self.samples[seq_id], role)

    def finish_early(self, ev: SequenceFinished) -> None:
        raise AssertionError("no late finish here")

    def maybe_train(self) -> None:
        pass

    # the test's drive
    def submit(self, sample_ids: range) -> None:
        sched = self.schedulers[ROLE]
        for i in sample_ids:
            s = self.source.make(i, 0, i, 0)
            self.samples[i] = s
            sched.submit(SeqState(i, s.prompt_len, s))
        self.dispatch(ROLE)

    def step(self) -> None:
        sched = self.schedulers[ROLE]
        for ev in self.cluster.step():
            assert sched.location(ev.seq_id) == ev.rid
            sched.finish(ev.seq_id)
            s = self.samples[ev.seq_id]
            if self.turns.on_turn(s, ev):
                self.done[s.sample_id] = s
            self.dispatch(ROLE)
        sched.check_invariants()

    def run_turns(self, steps: int | None = None) -> None:
        """Step the engines until they are idle (or `steps` times); no tool result is
        taken meanwhile, so a trajectory that called stays parked."""
        n = 0
        while self.cluster.busy() and (steps is None or n < steps):
            self.step()
            n += 1

    def deliver_results(self, timeout_s: float = 60.0) -> None:
        """Wait for every call outstanding and hand the results to the turn loop in call
        order (deterministic: the next turns queue in the same order every run)."""
        tools = self.cluster.tools
        results = []
        deadline = time.monotonic() + timeout_s
        while len(results) < self.turns.n_parked:
            results += tools.poll()
            assert time.monotonic() < deadline, "the sandbox did not answer"
            time.sleep(0.01)
        for r in sorted(results, key=lambda r: r.call_id):
            assert r.status == "ok", r
            self.turns.on_result(ToolReturned(self.cluster.now(), r))

    def finish(self) -> None:
        while len(self.done) < len(self.samples):
            self.run_turns()
            if len(self.done) < len(self.samples):
                assert self.turns.n_parked, "nothing runs and nothing is parked"
                self.deliver_results()


def engines(model) -> dict[str, HFEngine]:
    # two replicas with the same weights (each its own copy, as two GPUs would hold)
    return {rid: HFEngine(copy.deepcopy(model), kv_capacity_tokens=KV) for rid in RIDS}


def trajectories(host: Host) -> dict[int, tuple[list[int], str, list[float]]]:
    src = host.source
    out = {}
    for i, s in sorted(host.done.items()):
        traj = s.payload.traj
        assert traj.state == "done", (i, traj.state)
        out[i] = (
            traj.context_ids(),
            src.text(src.answer_ids(s.payload)),
            traj.response_logprobs(),
        )
    return out


def drive(setup, *, shift: bool, running_at_shift: bool):
    """Wave 1 runs its first turn and parks on its calls; wave 2 starts (before the shift
    and runs a few steps, or after it); the replica the most parked trajectories last ran
    on is taken down (`shift`); then everything runs to its end."""
    _, model, src, tools = setup
    cluster = EngineCluster(engines(model), src, tools)
    host = Host(cluster, src)
    sched = host.schedulers[ROLE]
    host.submit(range(WAVE))
    host.run_turns()
    parked = {p.sample.sample_id: p for p in host.turns.parked.values()}
    assert sorted(parked) == list(range(WAVE)), "greedy, every first turn calls the calculator"
    for i in parked:
        assert i not in sched and host.samples[i].payload.traj.state == "parked"
    if running_at_shift:
        host.submit(range(WAVE, 2 * WAVE))
        host.run_turns(steps=4)  # mid-turn: running on both replicas
    info = {}
    if shift:
        counts = {rid: sum(p.rid == rid for p in parked.values()) for rid in RIDS}
        leaving = max(RIDS, key=lambda rid: (counts[rid], rid))
        assert counts[leaving] > 0
        running = {q.seq_id for q in sched.running_on(leaving)}
        n_starts = len(cluster.started)
        host.shifts.take_down([leaving])
        # nothing parked is asked to stop; only what ran on the leaving replica is
        asked = {sid for where in cluster.abort_requests for sid in where}
        assert asked == running and not asked & set(parked)
        assert cluster.engine_aborts[leaving] == sorted(running)
        other = next(rid for rid in RIDS if rid != leaving)
        assert cluster.engine_aborts[other] == []
        assert cluster.down == [leaving] and leaving not in sched.replicas
        for i, p in parked.items():  # still parked, outside the scheduler, call pending
            assert i not in sched and any(q is p for q in host.turns.parked.values())
            assert host.samples[i].payload.traj.state == "parked"
        if running_at_shift:
            assert running, "the shift should catch wave 2 mid-turn on the leaving replica"
            moved = [rid for rid, sid, _ in cluster.started[n_starts:] if sid in running]
            assert moved == [other] * len(running)  # resumed there, by re-prefill
            assert all(cluster.aborted_tokens[i] > 0 for i in running)  # with their tokens
        info = {"leaving": leaving, "other": other, "parked": parked, "n_starts": n_starts}
    if not running_at_shift:
        host.submit(range(WAVE, 2 * WAVE))
    host.finish()
    return host, cluster, info


@pytest.mark.timeout(1800)  # a cold model cache builds the tools policy first (once)
@pytest.mark.parametrize("running_at_shift", [False, True], ids=["all-parked", "wave-running"])
def test_a_shift_down_while_parked_aborts_nothing_parked_and_changes_no_token(
    setup, running_at_shift: bool
) -> None:
    reference, ref_cluster, _ = drive(setup, shift=False, running_at_shift=running_at_shift)
    assert not ref_cluster.abort_requests and not any(ref_cluster.engine_aborts.values())
    assert {rid for rid, _, _ in ref_cluster.started} == set(RIDS)
    first = {sid: rid for rid, sid, turn in ref_cluster.started if turn == 0}
    again = {sid: rid for rid, sid, turn in ref_cluster.started if turn == 1}
    assert again == first, "without a shift each next turn goes back to its replica (affinity)"

    host, cluster, info = drive(setup, shift=True, running_at_shift=running_at_shift)
    leaving, other, parked = info["leaving"], info["other"], info["parked"]
    if not running_at_shift:  # everything was parked: no abort at all
        assert cluster.abort_requests == [{}] and not any(cluster.engine_aborts.values())
    # every turn after the shift ran on the remaining replica, the parked ones' next
    # turns included (their preferred replica is gone: no preference)
    after = cluster.started[info["n_starts"] :]
    assert after and {rid for rid, _, _ in after} == {other}
    assert {sid for _, sid, turn in after if turn == 1} >= set(parked)
    assert all(sid not in parked or rid == other for rid, sid, turn in after)
    assert not cluster.engines[leaving].has_unfinished()

    got, want = trajectories(host), trajectories(reference)
    assert got.keys() == want.keys() == set(range(2 * WAVE))
    for i in want:
        assert got[i][0] == want[i][0], f"trajectory {i}: tokens differ from the run without shift"
        assert got[i][1] == want[i][1]
        # the kept logprobs too (an aborted turn's come back with its tokens; re-prefill
        # and one decode step at a time differ only in rounding)
        assert got[i][2] == pytest.approx(want[i][2], abs=1e-4)
    # the trajectories are real calculator trajectories: a call, an observation, an answer
    cfg = setup[0]
    for i, s in host.done.items():
        assert s.tool_calls >= 1 and s.payload.traj.calls, i
    rc = cfg.rl.reward
    correct = sum(
        verifiable_reward(got[i][1], s.payload.problem.answer, rc) == rc.correct_score
        for i, s in host.done.items()
    )
    assert correct >= 2 * WAVE - 1, [answer for _, answer, _ in got.values()]
