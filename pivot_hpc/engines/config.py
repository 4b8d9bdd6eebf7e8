"""Config of the inference engines (one section per inference role)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal


def fail(path: str, value: object, why: str) -> None:
    # Imported lazily: pivot_hpc.config.schema imports this module, and importing
    # pivot_hpc.config.loader at the top would run that package first (a cycle).
    from pivot_hpc.config.loader import fail as _fail

    _fail(path, value, why)


@dataclass(kw_only=True)
class InferenceEngineConfig:
    """`hf` = the CPU continuous-batching engine; `sglang` = GPU production engine."""

    engine: Literal["hf", "sglang"] = "hf"
    max_batch: int = 256  # running sequences at most (KV slots)
    max_seq_len: int | None = None  # None = the model's max_position_embeddings
    prefill_chunk_tokens: int = 4096  # padded tokens per prefill forward
    num_threads: int = 1  # torch threads of the worker process
    seed: int = 0
    # A YAML file written by `pivot-hpc profile`; its fitted constants replace the role's
    # `throughput` section (see pivot_hpc.engines.profile.apply_profiles).
    throughput_profile: Path | None = None

    def validate(self, path: str) -> None:
        if self.max_batch < 1:
            fail(f"{path}.max_batch", self.max_batch, "must be >= 1")
        if self.prefill_chunk_tokens < 1:
            fail(f"{path}.prefill_chunk_tokens", self.prefill_chunk_tokens, "must be >= 1")
        if self.num_threads < 1:
            fail(f"{path}.num_threads", self.num_threads, "must be >= 1")
        if self.throughput_profile is not None and not Path(self.throughput_profile).is_file():
            fail(
                f"{path}.throughput_profile",
                str(self.throughput_profile),
                "file not found; create it with `pivot-hpc profile`",
            )


@dataclass(kw_only=True)
class EnginesConfig:
    rollout: InferenceEngineConfig = field(default_factory=InferenceEngineConfig)
    reward: InferenceEngineConfig = field(default_factory=InferenceEngineConfig)
