"""Simulated samples: prompt, response and GenRM judgement lengths, and synthetic rewards.

Lengths are long-tailed (log-normal, capped at the paper's 15K policy / 20K GenRM tokens;
prompts up to 2K, §8.1). Response medians grow with the RL step; a judgement's median grows
with the length of the response it judges (see `WorkloadConfig`; the caps are the live
run's rl.max_response_tokens and rl.reward.genrm_max_tokens). Rewards are synthetic (the simulator has no model): a sample is
correct with probability p(step) = p0 + (p1 − p0)·(1 − e^(−step/τ)), the GenRM score
agrees with correctness 80 % of the time — enough for reward curves in the traces; the
simulator's purpose is throughput, not learning.

With tools enabled (`sim.workload.tool_*`), a sample is a trajectory of turns: its response
is split evenly into one turn per tool call plus the answer, each call parks it for a
log-normal latency (drawn by `tool_latency`, which the SimCluster asks), and each
observation adds `tool_output_tokens`. With `tool_latency_mix`, each call first picks its
tool by share (from the sample and turn), then its latency from that tool's log-normal.
The coordinator's turn loop (coordinator/turns.py) drives it exactly as it drives live
trajectories.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from pivot_hpc.agentic.messages import ToolCall, ToolResult
from pivot_hpc.coordinator.rl_state import Sample
from pivot_hpc.coordinator.turns import Turn
from pivot_hpc.sim.config import Workload, tool_names


@dataclass(frozen=True, slots=True)
class SimPayload:
    response_len: int
    judgement_len: int
    correct: bool
    genrm_score: float
    # tools: generated tokens of each turn (one per call, then the answer); () = one turn
    turn_lens: tuple[int, ...] = ()


_MASK = (1 << 64) - 1


def _splitmix(x: int) -> int:
    """SplitMix64: a well-mixed 64-bit hash (fast in pure Python, no generator objects)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


class _Stream:
    """Uniform and normal draws from a counter-based hash of (seed, stream, index)."""

    __slots__ = ("key", "n")

    def __init__(self, seed: int, stream: int, index: int) -> None:
        self.key = _splitmix(_splitmix(_splitmix(seed & _MASK) ^ stream) ^ index)
        self.n = 0

    def random(self) -> float:
        self.n += 1
        return ((_splitmix(self.key ^ (self.n * 0xD1B54A32D192ED03 & _MASK)) >> 11) + 0.5) / (
            1 << 53
        )

    def normal(self) -> float:
        u, v = self.random(), self.random()
        return math.sqrt(-2.0 * math.log(u)) * math.cos(2.0 * math.pi * v)


# The draws of the latest (workload, seed), shared by the SimWorkloads made for it: a run
# draws each sample twice (for its bound, job/sim_bound.py, then to run it), and `bench
# failures` runs every mode on the same samples. A draw is ~15 µs of pure-Python hashing.
_latest: tuple[tuple, dict] = ((), {})


class SimWorkload:
    """A `SampleSource`: deterministic for (seed, sample id) whatever the release order.
    `cfg` is read when it is constructed (its draws are shared, see `_latest`)."""

    def __init__(self, cfg: Workload, seed: int) -> None:
        global _latest
        self.cfg = cfg
        self.seed = seed
        # tool_latency_mix: (name, cumulative share, median s, sigma) per tool
        mix = cfg.tool_latency_mix
        names = tool_names(mix)
        self._mix: list[tuple[str, float, float, float]] = []
        cum = 0.0
        for name, t in zip(names, mix, strict=True):
            cum += t.share
            self._mix.append((name, cum, t.latency_s, t.latency_sigma))
        self._latency = {name: (median, sigma) for name, _, median, sigma in self._mix}
        key = (seed, *(getattr(cfg, f.name) for f in dataclasses.fields(cfg)))
        if _latest[0] != key:
            _latest = (key, {})
        self._draws: dict[tuple[int, int, int], tuple[int, SimPayload]] = _latest[1]

    @staticmethod
    def _lognormal(rng: _Stream, median: float, sigma: float, cap: int) -> int:
        return int(min(cap, max(1, round(median * math.exp(sigma * rng.normal())))))

    def make(self, sample_id: int, step: int, prompt_index: int, group: int) -> Sample:
        key = (sample_id, step, prompt_index)
        drawn = self._draws.get(key)
        if drawn is None:
            drawn = self._draws[key] = self._draw(sample_id, step, prompt_index)
        prompt_len, payload = drawn
        return Sample(sample_id, step, prompt_index, group, prompt_len, payload)

    def _draw(self, sample_id: int, step: int, prompt_index: int) -> tuple[int, SimPayload]:
        """A sample's prompt length and payload (immutable: shared by every make)."""
        c = self.cfg
        prompt_rng = _Stream(self.seed, 0, prompt_index)
        span = c.prompt_len_max - c.prompt_len_min + 1
        prompt_len = c.prompt_len_min + min(span - 1, int(prompt_rng.random() * span))
        difficulty = 2.0 * prompt_rng.random() - 1.0
        rng = _Stream(self.seed, 1, sample_id)
        p = c.accuracy_start + (c.accuracy_end - c.accuracy_start) * (
            1.0 - math.exp(-step / c.accuracy_steps)
        )
        p = min(1.0, max(0.0, p + 0.2 * difficulty))
        correct = rng.random() < p
        agree = rng.random() < 0.8
        response_median = c.response_median * (1.0 + c.response_growth_per_step * step)
        response_len = self._lognormal(rng, response_median, c.response_sigma, c.response_cap)
        judgement_median = c.judgement_base + c.judgement_per_response_token * response_len
        payload = SimPayload(
            response_len=response_len,
            judgement_len=self._lognormal(
                rng, judgement_median, c.judgement_sigma, c.judgement_cap
            ),
            correct=correct,
            genrm_score=float(correct == agree),
            turn_lens=self._turns(sample_id, response_len),
        )
        return prompt_len, payload

    def _turns(self, sample_id: int, response_len: int) -> tuple[int, ...]:
        """The response split into turns: one per tool call, then the answer (() without
        calls). A stream of its own, so tools leave every other draw as it was."""
        c = self.cfg
        if c.max_tool_calls < 1 or c.tool_calls_mean <= 0:
            return ()
        rng = _Stream(self.seed, 2, sample_id)
        whole = math.floor(c.tool_calls_mean)
        calls = whole + (rng.random() < c.tool_calls_mean - whole)
        calls = min(calls, c.max_tool_calls, response_len - 1)
        if calls < 1:
            return ()
        base, extra = divmod(response_len, calls + 1)
        return tuple(base + (i < extra) for i in range(calls + 1))

    def on_rollout(self, sample: Sample, generated: int, result: object) -> int:
        return sample.prompt_len + generated  # the GenRM reads prompt + response

    # ------------------------------------------------- turns (coordinator/turns.py)
    def turn(self, s: Sample, generated: int, result: object, call_id: int) -> Turn:
        turns = s.payload.turn_lens
        if s.turn >= len(turns):  # the answer (or a one-turn trajectory)
            return Turn("done")
        return Turn("call", tool=self._tool(s), args_json="{}")

    def _tool(self, s: Sample) -> str:
        """The tool the call after turn `s.turn` of `s` calls: by share from a stream of
        (seed, sample) at the turn's index, so whatever the order calls are made in."""
        if not self._mix:
            return self.cfg.tool
        rng = _Stream(self.seed, 4, s.sample_id)
        rng.n = s.turn  # the turn-th draw of the sample's stream
        u = rng.random() * self._mix[-1][1]  # the shares sum to 1 within 1e-6
        return next((name for name, cum, _, _ in self._mix if u < cum), self._mix[-1][0])

    def observe(self, s: Sample, result: ToolResult) -> int | None:
        return s.prompt_len + self.response_len(s)

    def response_len(self, s: Sample) -> int:
        """Turns generated so far and the observations after all but the answer."""
        turns = s.payload.turn_lens
        if not turns:
            return s.payload.response_len
        obs = min(s.turn, len(turns) - 1) * self.observation_len
        return sum(turns[: s.turn]) + obs

    @property
    def observation_len(self) -> int:
        return min(self.cfg.tool_output_tokens, self.cfg.tool_output_cap)

    def tool_latency(self, call: ToolCall) -> float:
        """Seconds call `call` takes (log-normal: its tool's in `tool_latency_mix`, else
        tool_latency_s/_sigma; deterministic for the seed and call)."""
        rng = _Stream(self.seed, 3, call.call_id)
        c = self.cfg
        median, sigma = self._latency.get(call.tool, (c.tool_latency_s, c.tool_latency_sigma))
        return median * math.exp(sigma * rng.normal())


def sim_rewarder(sample: Sample, result: object) -> tuple[float, float]:
    """R = R_verifiable + R_GenRM (§8.1) from the synthetic outcome in the payload."""
    payload: SimPayload = sample.payload
    return float(payload.correct), payload.genrm_score
