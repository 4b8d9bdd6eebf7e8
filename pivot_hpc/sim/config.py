"""The simulator's own config section: only what a live run measures for itself.

A deployment is one config, read by `pivot-hpc run`, `pivot-hpc simulate` and `pivot-hpc
plan` alike. Every setting a live run has is read from its live key (the GPU from
`cluster.gpu`, the caps from `rl.max_response_tokens` / `rl.reward.genrm_max_tokens`,
training from `rl.trainer` and `rl.grpo`, models from `models`, engine profiles and
running caps from `engines`); job/sim_settings.py gathers them in one place. What is left here
is what a live run does not choose but observes: the lengths its policy and GenRM
generate (the synthetic workload the simulator draws instead), the workload's seed, and
the engine deaths a live run suffers rather than chooses (`sim.failures`, off by default).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

from pivot_hpc.config.loader import Moved
from pivot_hpc.errors import fail

# at most this many characters in a tool's name (telemetry's `tool_calls.tool` column)
TOOL_NAME_MAX_CHARS = 16


@dataclass(kw_only=True)
class ToolLatencyConfig:
    """One tool of `sim.workload.tool_latency_mix`: the share of calls that go to it and
    its log-normal call latency."""

    # the tool's name in telemetry (`tool_calls.tool`, the report's `tool_latency`) and in
    # the planner's per-tool wait estimate; "" = tool<i>, i its index in the mix
    name: str = ""
    share: float  # fraction of all calls that call this tool (the mix's shares sum to 1)
    latency_s: float  # median seconds one of its calls takes
    latency_sigma: float = 0.5  # log-normal sigma of its call latencies (0: always latency_s)

    def validate(self, path: str) -> None:
        if not (math.isfinite(self.share) and self.share > 0):
            fail(f"{path}.share", self.share, "must be a share > 0 (the mix's shares sum to 1)")
        if not (math.isfinite(self.latency_s) and self.latency_s > 0):
            fail(f"{path}.latency_s", self.latency_s, "must be > 0 seconds")
        if not (math.isfinite(self.latency_sigma) and self.latency_sigma >= 0):
            fail(f"{path}.latency_sigma", self.latency_sigma, "must be a finite number >= 0")
        name = self.name
        if len(name) > TOOL_NAME_MAX_CHARS or not (name.isascii() and name.isprintable()):
            fail(f"{path}.name", name, f"need <= {TOOL_NAME_MAX_CHARS} printable ASCII characters")


@dataclass(kw_only=True)
class WorkloadConfig:
    """Lengths (tokens) of simulated prompts, responses and GenRM judgements (§8.1).

    Responses are log-normal around `response_median` (growing by `response_growth_per_step`
    of it per RL step, as responses lengthen during RL training: the paper's Figure 15
    setting, the DAPO recipe's curves), cut at `rl.max_response_tokens` (the paper's 15K). A
    GenRM judgement reasons over the response, so its median grows with the response it
    judges: `judgement_base + judgement_per_response_token × response_len`, log-normal around
    that with `judgement_sigma`, cut at `rl.reward.genrm_max_tokens` (the paper's 20K).
    Prompts are uniform in [prompt_len_min, prompt_len_max] (DAPO-Math problems with a chat
    template: ≤ 2K). Defaults are a generic math-RL workload; the paper group configs
    document their own.
    """

    prompt_len_min: int = 100  # shortest prompt (tokens, chat template included)
    prompt_len_max: int = 1000  # longest prompt
    response_median: float = 1500.0  # median policy response at step 0
    response_sigma: float = 1.0  # log-normal sigma of response lengths
    response_growth_per_step: float = 0.0  # median grows by this fraction of itself per step
    judgement_base: float = 1000.0  # GenRM judgement median for an empty response
    judgement_per_response_token: float = 1.0  # added to the judgement median per response token
    judgement_sigma: float = 0.5  # log-normal sigma of judgement lengths around that median
    accuracy_start: float = 0.3  # synthetic reward curve: P(correct) at step 0 …
    accuracy_end: float = 0.6  # … approached over …
    accuracy_steps: float = 20.0  # … this many steps (exponential)
    # Tool-calling rollouts (tools.enabled; ignored otherwise): each trajectory makes
    # floor(m) or ceil(m) calls (mean m = tool_calls_mean, at most tools.max_turns − 1); its
    # response is split evenly into one turn per call plus the answer, and each call's
    # observation adds tool_output_tokens (at most tools.max_tool_output_tokens)
    tool_calls_mean: float = 0.0  # mean tool calls per trajectory
    tool_latency_s: float = 1.0  # median seconds a call takes (its trajectory is parked)
    tool_latency_sigma: float = 0.5  # log-normal sigma of call latencies
    # Latency per tool (empty: every call is one tool, tools.tools' first, with the latency
    # above): a list of {name, share, latency_s, latency_sigma}; each call picks its tool by
    # share (shares > 0, summing to 1), then its latency from that tool's log-normal (median
    # latency_s, sigma latency_sigma); tool_latency_s/_sigma are then unused. E.g. bimodal:
    # [{name: fast, share: 0.8, latency_s: 1}, {name: slow, share: 0.2, latency_s: 200}]
    tool_latency_mix: list[ToolLatencyConfig] = field(default_factory=list)
    tool_output_tokens: int = 16  # tokens of one observation

    # Keys that moved to the live vocabulary (issue 34): deprecated aliases, read there.
    MOVED_KEYS: ClassVar[dict[str, Moved]] = {
        "response_cap": Moved(("rl.max_response_tokens",)),
        "judgement_cap": Moved(("rl.reward.genrm_max_tokens",)),
    }

    def validate(self, path: str) -> None:
        if not 1 <= self.prompt_len_min <= self.prompt_len_max:
            fail(f"{path}.prompt_len_min", self.prompt_len_min, "need 1 <= min <= prompt_len_max")
        for key in (
            "response_median",
            "response_sigma",
            "response_growth_per_step",
            "judgement_base",
            "judgement_per_response_token",
            "judgement_sigma",
            "tool_calls_mean",
            "tool_latency_s",
            "tool_latency_sigma",
        ):
            v = getattr(self, key)
            if not math.isfinite(v) or v < 0:
                fail(f"{path}.{key}", v, "must be a finite number >= 0")
        if self.response_median <= 0:
            fail(f"{path}.response_median", self.response_median, "must be > 0")
        if self.judgement_base + self.judgement_per_response_token <= 0:
            fail(f"{path}.judgement_base", self.judgement_base, "judgements need a length > 0")
        for key in ("accuracy_start", "accuracy_end"):
            v = getattr(self, key)
            if not (math.isfinite(v) and 0 <= v <= 1):
                fail(f"{path}.{key}", v, "must be a probability in [0, 1]")
        if not (math.isfinite(self.accuracy_steps) and self.accuracy_steps > 0):
            fail(f"{path}.accuracy_steps", self.accuracy_steps, "must be > 0")
        if self.tool_output_tokens < 1:
            fail(f"{path}.tool_output_tokens", self.tool_output_tokens, "must be >= 1")
        if self.tool_latency_mix:
            for i, tool in enumerate(self.tool_latency_mix):  # each first: its own key named
                tool.validate(f"{path}.tool_latency_mix[{i}]")
            total = sum(t.share for t in self.tool_latency_mix)
            if not abs(total - 1.0) <= 1e-6:  # NaN fails too (each share is checked itself)
                fail(
                    f"{path}.tool_latency_mix",
                    [t.share for t in self.tool_latency_mix],
                    f"the shares sum to {total:.6g}; they must sum to 1",
                )
            names = tool_names(self.tool_latency_mix)
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                fail(f"{path}.tool_latency_mix", dup, "each tool needs a name of its own")


def tool_names(mix: list[ToolLatencyConfig]) -> list[str]:
    """The name of each tool of a latency mix ("" = tool<i>)."""
    return [t.name or f"tool{i}" for i, t in enumerate(mix)]


@dataclass(kw_only=True)
class Workload(WorkloadConfig):
    """The workload the simulator draws: the `sim.workload` section with the caps a live
    run generates under (job/sim_settings.py fills them in from `rl`; not a config section)."""

    response_cap: int  # max response tokens (rl.max_response_tokens)
    judgement_cap: int  # max GenRM tokens (rl.reward.genrm_max_tokens)
    # tools.enabled: tools.max_turns − 1 (the calls a trajectory may make), else 0; the tool
    # called (the first of tools.tools); observations cut at tools.max_tool_output_tokens
    max_tool_calls: int = 0
    tool: str = ""
    tool_output_cap: int = 64


@dataclass(kw_only=True)
class FailureConfig:
    """Injected inference-engine deaths (sim/failures.py; a live run has them, not sets
    them). Each GPU fails at exponential intervals of mean `mtbf_gpu_hours` of simulated
    time, drawn from `sim.seed` alone, so every mode of one seed meets the same deaths. A
    death on a GPU serving an inference replica kills that replica's engine: it is
    reported as a live engine's death is (`ReplicaFailed`) and the coordinator recovers it
    the same way — an unplanned shift-down, then a restart or, dying again within
    `deployment.engine_restart_window_s`, exclusion (docs/guide/vllm.md). A death on a GPU that
    training holds (its set or an elastic extension) restarts the training engine between
    steps (`restart_s` plus a training shift-up), and stops the job inside a step or when
    training died within the restart window before (`job_restart_s`: the step is redone).
    A death on a GPU that idles or shifts is not modelled (counted as `deaths_elsewhere`)."""

    # mean time between failures of one GPU, hours of simulated time (0: no failures).
    # Meta's Llama 3 run saw one interruption per ~50,000 GPU-hours; engine software
    # faults (OOM, hangs) add to that
    mtbf_gpu_hours: float = 0.0
    # extra seconds a restarted engine takes before its shift-up completes, on top of the
    # ordinary shift-up (which reads the policy from GPS): a fresh engine process starting
    # (CUDA context, NCCL for its tensor parallelism, CUDA graph capture) where a shift-up
    # only resumes a sleeping one. An estimate: vLLM and SGLang cold-start a large model
    # in about a minute once its weights are at hand
    restart_s: float = 60.0
    # seconds a job stop costs (a training death inside a step, or a second one within
    # deployment.engine_restart_window_s): the whole cluster pauses this long, then the
    # step starts over (its work so far is lost). An estimate: Slurm requeues the job and
    # allocates nodes (about a minute when nodes are free), then the job starts again —
    # MPI and NCCL set up, every engine cold-started, the checkpoint's policy and optimizer
    # state read back (minutes for a 70B-class policy)
    job_restart_s: float = 300.0
    # deaths on GPUs that training holds are dealt as above (false: they are counted with
    # `deaths_elsewhere` and only inference engines die, as before issue 38's training
    # deaths; `pivot-hpc bench failures` runs so unless given --training-deaths)
    training: bool = True

    def validate(self, path: str) -> None:
        for key in ("mtbf_gpu_hours", "restart_s", "job_restart_s"):
            v = getattr(self, key)
            if not math.isfinite(v) or v < 0:
                fail(f"{path}.{key}", v, "must be a finite number >= 0")

    @property
    def enabled(self) -> bool:
        return self.mtbf_gpu_hours > 0


def _recompute(value: object) -> object:
    """sim.activation_recompute (a bool) as rl.trainer.recompute."""
    return {True: "full", False: "none"}.get(value, value) if isinstance(value, bool) else value


@dataclass(kw_only=True)
class SimConfig:
    """What only the simulator needs: the synthetic workload in place of the generations a
    live run measures. Engine, shift and training costs come from `pivot-hpc calibration`
    for `cluster.gpu` and the models of `models` (job/sim_settings.py, sim/calibration.py)."""

    seed: int = 0  # workload seed (a run is deterministic for a seed; --seed)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    failures: FailureConfig = field(default_factory=FailureConfig)  # injected engine deaths

    # Keys that moved to the live vocabulary (one description per deployment, issue 34):
    # deprecated aliases, read at their new keys with one line saying so.
    MOVED_KEYS: ClassVar[dict[str, Moved]] = {
        "hardware": Moved(("cluster.gpu",)),
        "policy_model": Moved(("models.policy_catalog",)),
        "reward_model": Moved(("models.genrm_catalog",)),
        "training_tp": Moved(("rl.trainer.tp",)),
        "recompute_old_logprobs": Moved(("rl.grpo.recompute_old_logprobs",)),
        "activation_recompute": Moved(
            ("rl.trainer.recompute",), _recompute, "true = full, false = none"
        ),
        "max_running_requests": Moved(("engines.rollout.max_batch", "engines.reward.max_batch")),
        "rollout_profile": Moved(("engines.rollout.throughput_profile",)),
        "reward_profile": Moved(("engines.reward.throughput_profile",)),
    }
