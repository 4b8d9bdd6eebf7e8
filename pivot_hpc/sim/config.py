"""The simulator's own config section: only what a live run measures for itself.

A deployment is one config, read by `pivot-hpc run`, `pivot-hpc simulate` and `pivot-hpc
plan` alike. Every setting a live run has is read from its live key (the GPU from
`cluster.gpu`, the caps from `rl.max_response_tokens` / `rl.reward.genrm_max_tokens`,
training from `rl.trainer` and `rl.grpo`, models from `models`, engine profiles and
running caps from `engines`); sim/settings.py gathers them in one place. What is left here
is what a live run does not choose but observes: the lengths its policy and GenRM
generate (the synthetic workload the simulator draws instead) and the workload's seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

from pivot_hpc.errors import fail


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

    # Keys that moved to the live vocabulary: the loader refuses them with this hint.
    MOVED_KEYS: ClassVar[dict[str, str]] = {
        "response_cap": "rl.max_response_tokens",
        "judgement_cap": "rl.reward.genrm_max_tokens",
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


@dataclass(kw_only=True)
class Workload(WorkloadConfig):
    """The workload the simulator draws: the `sim.workload` section with the caps a live
    run generates under (sim/settings.py fills them in from `rl`; not a config section)."""

    response_cap: int  # max response tokens (rl.max_response_tokens)
    judgement_cap: int  # max GenRM tokens (rl.reward.genrm_max_tokens)


@dataclass(kw_only=True)
class SimConfig:
    """What only the simulator needs: the synthetic workload in place of the generations a
    live run measures. Engine, shift and training costs come from `pivot-hpc calibration`
    for `cluster.gpu` and the models of `models` (sim/settings.py, sim/calibration.py)."""

    seed: int = 0  # workload seed (a run is deterministic for a seed; --seed)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)

    # Keys that moved to the live vocabulary (one description per deployment, issue 34):
    # the loader refuses them with this hint instead of the list of valid keys.
    MOVED_KEYS: ClassVar[dict[str, str]] = {
        "hardware": "cluster.gpu",
        "policy_model": "models.policy_catalog (or a models.policy_path whose directory names it)",
        "reward_model": "models.genrm_catalog (or a models.genrm_path whose directory names it)",
        "training_tp": "rl.trainer.tp",
        "recompute_old_logprobs": "rl.grpo.recompute_old_logprobs",
        "activation_recompute": "rl.trainer.recompute (true = full, false = none)",
        "max_running_requests": "engines.rollout.max_batch and engines.reward.max_batch",
        "rollout_profile": "engines.rollout.throughput_profile",
        "reward_profile": "engines.reward.throughput_profile",
    }
