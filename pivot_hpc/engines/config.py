"""Config of the inference engines (one section per inference role)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pivot_hpc.errors import fail

# ServerArgs the sglang adapter sets itself (pivot_hpc.engines.factory, engines/sglang/launch.py); it
# also relies on cumulative stream chunks and on a single scheduler (no data parallelism).
# Placement (base_gpu_id 0 over the replica's CUDA_VISIBLE_DEVICES) and ports are per
# replica, so a value in the config would be wrong for every replica but one.
SGLANG_OWNED_ARGS = frozenset(
    {
        "model_path",
        "tp_size",
        "base_gpu_id",
        "gpu_id_step",
        "skip_tokenizer_init",
        "enable_memory_saver",
        "context_length",
        "max_total_tokens",
        "max_running_requests",
        "mem_fraction_static",
        "chunked_prefill_size",
        "random_seed",
        "incremental_streaming_output",
        "dp_size",
        "port",
        "nccl_port",
        "dist_init_addr",
        "watchdog_timeout",
    }
)
DEVICES = ("auto", "cpu", "cuda")
# EngineArgs the vllm adapter sets itself (pivot_hpc.engines.vllm.launch): token ids in and
# out, the KV cache sized from the role's kv_capacity_tokens, logprobs in the contract's
# sense, one process (vLLM's engine core where the adapter runs), and the shared keys above.
VLLM_OWNED_ARGS = frozenset(
    {
        "model",
        "skip_tokenizer_init",
        "max_model_len",
        "max_num_seqs",
        "max_num_batched_tokens",
        "enable_chunked_prefill",
        "kv_cache_memory_bytes",
        "num_gpu_blocks_override",
        "logprobs_mode",
        "seed",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "data_parallel_size",
        "distributed_executor_backend",
        "enable_sleep_mode",
        "disable_log_stats",
        "async_scheduling",
    }
)


@dataclass(kw_only=True)
class InferenceEngineConfig:
    """`hf` = the embedded continuous-batching engine (CPU, or the worker's GPU);
    `sglang` = the GPU production engine; `vllm` = vLLM 0.32, by default in a child process
    of the worker rank (CPU build or CUDA build, pivot_hpc.engines.vllm.engine;
    docs/guide/vllm.md).

    The shared keys reach vLLM as: max_batch → max_num_seqs, max_seq_len → max_model_len,
    prefill_chunk_tokens → max_num_batched_tokens, the role's kv_capacity_tokens → the KV
    cache's size, num_threads → the worker's torch threads, seed → per-request sampling
    seeds, device → must match the platform of the installed vLLM build."""

    engine: Literal["hf", "sglang", "vllm"] = "hf"  # which engine serves the role
    max_batch: int = 256  # running sequences at most (KV slots)
    max_seq_len: int | None = None  # None = the model's max_position_embeddings
    # padded tokens prefilled per engine step (hf: one prefill forward per step; sglang:
    # its chunked_prefill_size): bounds a step's latency, and so how long an abort or shift
    # waits for the engine
    prefill_chunk_tokens: int = 4096
    num_threads: int = 1  # torch threads of the engine's process (hf, vllm; sglang: not used)
    seed: int = 0  # sampling seed; each worker samples with seed + rl.trainer.seed + its rank
    # hf: where the model, its KV cache and GPS reads live; auto = the worker's GPU if it
    # has one (cluster binding: one GPU per worker), else CPU. sglang always runs on GPUs.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # hf and vllm: where the engine runs. in_rank = in the worker rank's own process; child
    # = in a child process of the rank, the shape production engines have (the job's stop
    # signals do not reach it, its death is one error for the rank, and vLLM there is
    # apart from the training ranks' torch.distributed world: engines/process/child.py);
    # auto = child for vllm, in_rank for hf (docs/guide/vllm.md). sglang: not used
    process: Literal["auto", "in_rank", "child"] = "auto"
    # A YAML file written by `pivot-hpc profile`; its fitted constants replace the role's
    # `throughput` section (see pivot_hpc.engines.profile.apply_profiles).
    throughput_profile: Path | None = None
    # --- `sglang` only (pivot_hpc.engines.sglang.engine) ---
    # Fraction of the GPU memory free at the engine's start that SGLang gives to weights +
    # KV pool; None = sized at each start from the memory actually free there, keeping
    # memory_reserve_gib for activations and CUDA graphs. The pool is further capped by the
    # role's kv_capacity_tokens (SGLang's max_total_tokens).
    mem_fraction_static: float | None = None
    memory_reserve_gib: float = 10.0  # used when mem_fraction_static is None
    # SGLang must be idle before a memory release or a cache flush; it reaches idle one
    # scheduler step after the last request ends. Waiting longer than this is an error.
    idle_timeout_s: float = 60.0
    # First TCP port of this role's per-GPU port blocks (SGLang's port, nccl_port and
    # dist_init_addr, one block of 16 per node-local GPU; a port in use is skipped).
    port_base: int = 30000
    weight_bucket_mb: int = 512  # bytes per update_weights_from_tensor call (staging memory)
    stream_interval: int = 16  # tokens between progress reports (sequence lengths)
    poll_s: float = 0.005  # step() waits at most this long for a sequence to finish
    abort_timeout_s: float = 60.0  # an abort taking longer is an error
    # How a weight update pauses running requests. retract: SGLang drains the batch in
    # flight and retracts them (tokens kept, prefilled again under the new weights), so no
    # decode step reads weights mid-update; in_place: keeps their KV cache, safe only with
    # server_args.disable_overlap_schedule: true (the overlap scheduler's in-flight step
    # would read weights while they are overwritten)
    pause_mode: Literal["retract", "in_place"] = "retract"
    # SGLang's watchdog kills its scheduler when one forward batch takes longer than this;
    # a large model's first batches and a paused weight update can (SGLang's default: 300).
    # An engine in a child process (`process: child`) that does not answer one call within
    # this long is killed by its rank and handled as a dead engine (engines/process/guard.py).
    watchdog_timeout_s: float = 1800.0
    # Extra SGLang ServerArgs (e.g. attention_backend, disable_cuda_graph, dtype); the
    # adapter owns the keys in SGLANG_OWNED_ARGS.
    server_args: dict[str, str | int | float | bool] = field(default_factory=dict)
    # --- `vllm` only (pivot_hpc.engines.vllm.engine) ---
    # Extra vLLM EngineArgs (e.g. dtype, block_size, enable_prefix_caching, enforce_eager,
    # gpu_memory_utilization); the adapter owns the keys in VLLM_OWNED_ARGS. Unset, dtype is
    # the model directory's, block_size 32 on CPU (the smallest its attention supports, so
    # the KV cache is counted in tokens nearly as the scheduler counts it), eager mode.
    vllm_args: dict[str, str | int | float | bool] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # resolved at once, so checkpoints record (and compare) the mode the run used
        if self.process == "auto":
            self.process = "child" if self.engine == "vllm" else "in_rank"

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
        if self.device not in DEVICES:
            fail(f"{path}.device", self.device, f"must be one of {', '.join(DEVICES)}")
        if self.memory_reserve_gib < 0:
            fail(f"{path}.memory_reserve_gib", self.memory_reserve_gib, "must be >= 0")
        if not 1024 <= self.port_base <= 65535 - 16 * 64:
            fail(f"{path}.port_base", self.port_base, f"must be in [1024, {65535 - 16 * 64}]")
        for name in ("poll_s", "abort_timeout_s", "idle_timeout_s", "watchdog_timeout_s"):
            if getattr(self, name) <= 0:
                fail(f"{path}.{name}", getattr(self, name), "must be > 0")
        if (
            self.pause_mode == "in_place"
            and self.server_args.get("disable_overlap_schedule") is not True
        ):
            fail(
                f"{path}.pause_mode",
                self.pause_mode,
                "with SGLang's overlap scheduler an in-place pause lets a decode step read "
                "weights mid-update; set server_args.disable_overlap_schedule: true, or use "
                "pause_mode: retract",
            )
        vllm_owned = sorted(set(self.vllm_args) & VLLM_OWNED_ARGS)
        if vllm_owned:
            fail(
                f"{path}.vllm_args",
                self.vllm_args,
                f"{vllm_owned} are set by the vllm adapter (from kv_capacity_tokens, max_batch, "
                "max_seq_len, prefill_chunk_tokens, seed and tp); remove them",
            )
        owned = sorted(set(self.server_args) & SGLANG_OWNED_ARGS)
        if owned:
            fail(
                f"{path}.server_args",
                self.server_args,
                f"{owned} are set by the sglang adapter (from tp, kv_capacity_tokens, max_batch, "
                "max_seq_len, prefill_chunk_tokens, mem_fraction_static, seed, port_base and "
                "the replica's GPUs); remove them",
            )


@dataclass(kw_only=True)
class EnginesConfig:
    rollout: InferenceEngineConfig = field(default_factory=InferenceEngineConfig)
    reward: InferenceEngineConfig = field(default_factory=InferenceEngineConfig)
