"""Config of the inference engines (one section per inference role)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pivot_hpc.errors import fail

# ServerArgs the sglang adapter sets itself (pivot_hpc.engines.factory); it also relies on
# cumulative stream chunks and on a single scheduler (no data parallelism).
SGLANG_OWNED_ARGS = frozenset(
    {
        "model_path",
        "tp_size",
        "base_gpu_id",
        "skip_tokenizer_init",
        "enable_memory_saver",
        "context_length",
        "max_total_tokens",
        "max_running_requests",
        "mem_fraction_static",
        "random_seed",
        "incremental_streaming_output",
        "dp_size",
    }
)


@dataclass(kw_only=True)
class InferenceEngineConfig:
    """`hf` = the CPU continuous-batching engine; `sglang` = GPU production engine."""

    engine: Literal["hf", "sglang"] = "hf"  # which engine serves the role
    max_batch: int = 256  # running sequences at most (KV slots)
    max_seq_len: int | None = None  # None = the model's max_position_embeddings
    # padded tokens prefilled per engine step (hf: one prefill forward per step): bounds a
    # step's latency, and so how long an abort or shift waits for the engine
    prefill_chunk_tokens: int = 4096
    num_threads: int = 1  # torch threads of the worker process (hf)
    seed: int = 0  # sampling seed; each worker samples with seed + rl.trainer.seed + its rank
    # A YAML file written by `pivot-hpc profile`; its fitted constants replace the role's
    # `throughput` section (see pivot_hpc.engines.profile.apply_profiles).
    throughput_profile: Path | None = None
    # --- `sglang` only (pivot_hpc.engines.sglang_engine) ---
    # GPU memory fraction for weights + KV pool; None = SGLang's own choice. The pool is
    # further capped by the role's kv_capacity_tokens (SGLang's max_total_tokens).
    mem_fraction_static: float | None = None
    weight_bucket_mb: int = 512  # bytes per update_weights_from_tensor call (staging memory)
    stream_interval: int = 16  # tokens between progress reports (sequence lengths)
    poll_s: float = 0.005  # step() waits at most this long for a sequence to finish
    abort_timeout_s: float = 60.0  # an abort taking longer is an error
    # Extra SGLang ServerArgs (e.g. attention_backend, disable_cuda_graph, dtype); the
    # adapter owns the keys in SGLANG_OWNED_ARGS.
    server_args: dict[str, str | int | float | bool] = field(default_factory=dict)

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
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            fail(f"{path}.mem_fraction_static", self.mem_fraction_static, "must be in (0, 1)")
        for name in ("weight_bucket_mb", "stream_interval"):
            if getattr(self, name) < 1:
                fail(f"{path}.{name}", getattr(self, name), "must be >= 1")
        for name in ("poll_s", "abort_timeout_s"):
            if getattr(self, name) <= 0:
                fail(f"{path}.{name}", getattr(self, name), "must be > 0")
        owned = sorted(set(self.server_args) & SGLANG_OWNED_ARGS)
        if owned:
            fail(
                f"{path}.server_args",
                self.server_args,
                f"{owned} are set by the sglang adapter (from tp, kv_capacity_tokens, max_batch, "
                "max_seq_len, mem_fraction_static, seed); remove them",
            )


@dataclass(kw_only=True)
class EnginesConfig:
    rollout: InferenceEngineConfig = field(default_factory=InferenceEngineConfig)
    reward: InferenceEngineConfig = field(default_factory=InferenceEngineConfig)
