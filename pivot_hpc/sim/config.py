"""Simulator and deployment configuration sections."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from pivot_hpc.errors import fail


@dataclass(kw_only=True)
class WorkloadConfig:
    """Lengths (tokens) of simulated prompts, responses and GenRM judgements (§8.1).

    Responses are log-normal around `response_median` (growing by `response_growth_per_step`
    of it per RL step, as responses lengthen during RL training: the paper's Figure 15
    setting, the DAPO recipe's curves), capped at `response_cap` (the paper's 15K). A GenRM
    judgement reasons over the response, so its median grows with the response it judges:
    `judgement_base + judgement_per_response_token × response_len`, log-normal around that
    with `judgement_sigma`, capped at `judgement_cap` (the paper's 20K). Prompts are uniform
    in [prompt_len_min, prompt_len_max] (DAPO-Math problems with a chat template: ≤ 2K).
    Defaults are a generic math-RL workload; the paper group configs document their own.
    """

    prompt_len_min: int = 100  # shortest prompt (tokens, chat template included)
    prompt_len_max: int = 1000  # longest prompt
    response_median: float = 1500.0  # median policy response at step 0
    response_sigma: float = 1.0  # log-normal sigma of response lengths
    response_cap: int = 15000  # max response tokens (generation stops there)
    response_growth_per_step: float = 0.0  # median grows by this fraction of itself per step
    judgement_base: float = 1000.0  # GenRM judgement median for an empty response
    judgement_per_response_token: float = 1.0  # added to the judgement median per response token
    judgement_sigma: float = 0.5  # log-normal sigma of judgement lengths around that median
    judgement_cap: int = 20000  # max GenRM tokens
    accuracy_start: float = 0.3  # synthetic reward curve: P(correct) at step 0 …
    accuracy_end: float = 0.6  # … approached over …
    accuracy_steps: float = 20.0  # … this many steps (exponential)

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
        for key in ("response_cap", "judgement_cap"):
            if getattr(self, key) < 1:
                fail(f"{path}.{key}", getattr(self, key), "must be >= 1")
        for key in ("accuracy_start", "accuracy_end"):
            v = getattr(self, key)
            if not (math.isfinite(v) and 0 <= v <= 1):
                fail(f"{path}.{key}", v, "must be a probability in [0, 1]")
        if not (math.isfinite(self.accuracy_steps) and self.accuracy_steps > 0):
            fail(f"{path}.accuracy_steps", self.accuracy_steps, "must be > 0")


@dataclass(kw_only=True)
class SimConfig:
    """The simulated cluster: hardware, the models of each role and how training is costed.

    Engine, shift and training costs come from `pivot-hpc calibration` (the catalog times
    the calibration table, every number with its source; see sim/calibration.py).
    """

    hardware: Literal["h20", "h100", "h200"] = "h20"  # GPU kind (catalog)
    policy_model: str = "qwen2.5-7b"  # catalog model of rollout and training
    reward_model: str = "qwen3-30b-a3b"  # catalog model of the GenRM
    training_tp: int = 1  # tensor parallelism of training (its GPS Read shard size)
    seed: int = 0  # workload seed (a run is deterministic for a seed)
    # Training passes (App. E: the paper's systems all run on veRL, which recomputes the
    # old-policy logprobs and checkpoints activations; our GRPO takes the ratio against
    # the rollout engine's logprobs, so this is off by default). A reference forward is
    # added when rl.grpo.kl_coef > 0.
    recompute_old_logprobs: bool = False
    activation_recompute: bool = True  # training re-runs the forward in backward
    # Running-request cap of one inference replica (None: the calibration table's).
    max_running_requests: int | None = None
    # Your own engine profile (`pivot-hpc profile` YAML) instead of the catalog's A-D for a
    # role; a `kv_capacity_tokens` entry in the file replaces the catalog's capacity too.
    rollout_profile: str | None = None
    reward_profile: str | None = None  # (the GenRM's profile)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)

    def validate(self, path: str) -> None:
        from pivot_hpc.sim.catalog import MODELS

        for key, profile in (
            ("policy_model", "rollout_profile"),
            ("reward_model", "reward_profile"),
        ):
            if getattr(self, key) not in MODELS and getattr(self, profile) is None:
                fail(
                    f"{path}.{key}",
                    getattr(self, key),
                    f"known models: {', '.join(sorted(MODELS))}; for another model, profile "
                    f"it (pivot-hpc profile), add a `model:` section to the file and set "
                    f"{path}.{profile}",
                )
        if self.training_tp < 1:
            fail(f"{path}.training_tp", self.training_tp, "must be >= 1")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            fail(f"{path}.max_running_requests", self.max_running_requests, "must be >= 1")
        from pathlib import Path

        for key in ("rollout_profile", "reward_profile"):
            v = getattr(self, key)
            if v is not None and not Path(v).is_file():
                fail(f"{path}.{key}", v, "no such file; write one with `pivot-hpc profile`")
