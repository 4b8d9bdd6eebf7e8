"""Simulator and deployment configuration sections."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pivot_hpc.config.loader import fail


@dataclass(kw_only=True)
class WorkloadConfig:
    """Lengths (tokens) of simulated prompts, responses and GenRM judgements (§8.1).

    Defaults describe math RL with a reasoning GenRM: short prompts (DAPO-Math problems),
    policy responses with a long tail up to the 15K cap, and GenRM judgements that reason
    at length (up to 20K) over prompt + response. They are workload assumptions; set them
    from your own data (e.g. lengths of a previous run) to study your workload.
    """

    prompt_len_min: int = 100
    prompt_len_max: int = 1000
    response_median: float = 1500.0
    response_sigma: float = 1.0
    response_cap: int = 15000
    judgement_median: float = 4000.0
    judgement_sigma: float = 0.8
    judgement_cap: int = 20000
    accuracy_start: float = 0.3  # synthetic reward curve
    accuracy_end: float = 0.6
    accuracy_steps: float = 20.0

    def validate(self, path: str) -> None:
        if not 1 <= self.prompt_len_min <= self.prompt_len_max:
            fail(f"{path}.prompt_len_min", self.prompt_len_min, "need 1 <= min <= prompt_len_max")
        for name in ("response", "judgement"):
            med, sig, cap = (getattr(self, f"{name}_{k}") for k in ("median", "sigma", "cap"))
            if med <= 0 or sig < 0 or cap < 1:
                fail(
                    f"{path}.{name}_median",
                    (med, sig, cap),
                    "need median > 0, sigma >= 0, cap >= 1",
                )


@dataclass(kw_only=True)
class SimConfig:
    """The simulated cluster: hardware and the models of each role (see sim/catalog.py)."""

    hardware: Literal["h20", "h100", "h200"] = "h20"
    policy_model: str = "qwen2.5-7b"
    reward_model: str = "qwen3-30b-a3b"
    training_tp: int = 1
    seed: int = 0
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)

    def validate(self, path: str) -> None:
        from pivot_hpc.sim.catalog import MODELS

        for key in ("policy_model", "reward_model"):
            if getattr(self, key) not in MODELS:
                fail(
                    f"{path}.{key}",
                    getattr(self, key),
                    f"known models: {', '.join(sorted(MODELS))}",
                )
