"""What an SGLang Engine needs around its start: its GPUs, its ports, its memory budget.

SGLang 0.5.23 starts its scheduler processes with `spawn`, and they inherit the leader's
environment at that moment; the leader's own CUDA state (if any) is untouched. So a replica
is placed the way veRL places its servers: `CUDA_VISIBLE_DEVICES` = exactly the replica's
GPUs while `Engine(...)` runs, `base_gpu_id` 0 (the scheduler's GPU is base_gpu_id + tp_rank
among the *visible* devices, entrypoints/engine.py:935), and the variable restored after.

- Ports: without `nccl_port` SGLang picks a random free one in each leader, which two
  leaders starting at once on a node can both pick. Each node-local GPU slot gets its own
  block of PORTS_PER_SLOT ports from `engines.<role>.port_base`; the first free ones become
  `port` and `nccl_port` (= `dist_init_addr`'s port, what torch.distributed binds).
- `PYTORCH_CUDA_ALLOC_CONF`: the memory saver (release/resume_memory_occupation) does not
  support expandable segments, so they are removed for the scheduler processes (as slime
  does); the rest of the setting is kept.
- Memory: SGLang sizes its KV pool once, at the start, as
  free_after_weights - free_before_weights · (1 - mem_fraction_static)
  (kv_cache_configurator._profile_available_bytes). With `mem_fraction_static` unset the
  fraction is chosen from the memory free right now so that exactly
  `memory_reserve_gib` stays outside the pool (activations, CUDA graphs), instead of a
  fraction tuned for an empty GPU; too little free memory is an error naming the key.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pivot_hpc.engines.config import InferenceEngineConfig
from pivot_hpc.engines.process import job_signals
from pivot_hpc.errors import PivotError, PlacementError
from pivot_hpc.models.limits import model_limits

if TYPE_CHECKING:
    from pivot_hpc.engines.sglang.engine import SGLangEngine

PORTS_PER_SLOT = 16
GIB = 1 << 30


class LaunchError(PivotError, RuntimeError):
    pass


@contextlib.contextmanager
def scoped_env(changes: Mapping[str, str | None]) -> Iterator[None]:
    """Set (or, for None, remove) environment variables for the block; restore after."""
    before = {k: os.environ.get(k) for k in changes}
    try:
        for k, v in changes.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def without_expandable_segments(conf: str | None) -> str | None:
    """PYTORCH_CUDA_ALLOC_CONF without `expandable_segments:...`; None if nothing is left."""
    if conf is None:
        return None
    kept = [p for p in conf.split(",") if p.strip() and not p.strip().startswith("expandable")]
    return ",".join(kept) or None


def launch_env(visible: str | None) -> dict[str, str | None]:
    """The environment changes around `Engine(...)` (see the module docstring)."""
    changes: dict[str, str | None] = {
        "PYTORCH_CUDA_ALLOC_CONF": without_expandable_segments(
            os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
        )
    }
    if visible is not None:
        changes["CUDA_VISIBLE_DEVICES"] = visible
    return changes


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def engine_ports(
    port_base: int,
    slot: int,
    *,
    config_key: str,
    n: int = 2,
    is_free: Callable[[int], bool] = port_is_free,
) -> list[int]:
    """`n` free ports from the block of node-local GPU `slot` (a port in use is skipped;
    blocks of other slots are not entered, so leaders starting together never collide)."""
    start = port_base + PORTS_PER_SLOT * slot
    found = [p for p in range(start, start + PORTS_PER_SLOT) if is_free(p)][:n]
    if len(found) < n:
        raise LaunchError(
            f"config key '{config_key}' = {port_base}: ports {start}..{start + PORTS_PER_SLOT - 1}"
            f" of GPU slot {slot} are in use; choose another port_base"
        )
    return found


def weights_bytes(model_dir: str | Path) -> int:
    """Bytes of the model's safetensors files (what its weights take on the GPUs)."""
    return sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))


def mem_fraction_static(
    free_bytes: int, weights: int, reserve_bytes: int, *, config_key: str
) -> float:
    """The `mem_fraction_static` that leaves `reserve_bytes` of `free_bytes` (the memory
    free before SGLang loads `weights` bytes on this GPU) outside weights + KV pool."""
    pool = free_bytes - weights - reserve_bytes
    if free_bytes <= 0 or pool <= 0:
        raise LaunchError(
            f"config key '{config_key}' = {reserve_bytes / GIB:g}: SGLang would start with "
            f"{free_bytes / GIB:.2f} GiB free per GPU, the weights take {weights / GIB:.2f} "
            f"GiB and {reserve_bytes / GIB:g} GiB are kept for activations: no room for a KV "
            "cache; free the GPU first (release the training context before an inference "
            "shift up), use a larger tp, or lower the reserve"
        )
    return min(0.99, max(0.05, 1.0 - reserve_bytes / free_bytes))


def free_gpu_bytes(visible: str | None) -> list[int]:
    """Free memory of each GPU in `visible` (CUDA_VISIBLE_DEVICES syntax), through NVML, so
    that the leader does not create a CUDA context for it; [] if it cannot be measured."""
    try:
        import pynvml  # nvidia-ml-py, an SGLang dependency
    except ImportError:
        return []
    ids = [d.strip() for d in (visible or "").split(",") if d.strip()]
    try:
        pynvml.nvmlInit()
        try:
            if not ids:
                ids = [str(i) for i in range(pynvml.nvmlDeviceGetCount())]
            out = []
            for d in ids:
                h = (
                    pynvml.nvmlDeviceGetHandleByIndex(int(d))
                    if d.isdigit()
                    else pynvml.nvmlDeviceGetHandleByUUID(d)
                )
                out.append(int(pynvml.nvmlDeviceGetMemoryInfo(h).free))
            return out
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # NVML missing or refusing (no driver): SGLang's own choice
        return []


def check_balanced(free: list[int], *, config_key: str) -> None:
    """SGLang refuses a tp > 1 start when one GPU has < 90 % of another's free memory
    (distributed/bootstrap.py:442); say which key and what to do, before it starts."""
    if len(free) > 1 and min(free) < 0.9 * max(free):
        raise LaunchError(
            f"config key '{config_key}': the replica's GPUs have unequal free memory "
            f"({', '.join(f'{b / GIB:.1f}' for b in free)} GiB): something (a training context "
            "not yet released, another process) holds memory on some of them"
        )


# The node's GPUs in slot order, as runtime/devices.bind_worker_gpu found them ("": the
# launcher bound one GPU per task): how a replica leader names its replica's GPUs.
NODE_GPUS_ENV = "PIVOT_HPC_NODE_GPUS"


def replica_gpus(
    slot: int, tp: int, config_key: str, env: MutableMapping[str, str] | None = None
) -> str | None:
    """CUDA_VISIBLE_DEVICES for an engine over GPUs [slot, slot + tp) of this node, started
    by the worker of `slot`; None where no GPU was bound (CPU runs, tests)."""
    env = os.environ if env is None else env
    if NODE_GPUS_ENV not in env:
        return env.get("CUDA_VISIBLE_DEVICES") if tp == 1 else None
    node = [d for d in env[NODE_GPUS_ENV].split(",") if d]
    if not node:  # per-task binding: the worker sees its own GPU only
        if tp == 1:
            return env.get("CUDA_VISIBLE_DEVICES")
        raise PlacementError(
            f"config key '{config_key}' = {tp}: a tp > 1 replica leader must see its "
            "replica's GPUs, but the launcher bound one GPU per task; launch with every GPU "
            "of a node visible to each task (srun --gpus-per-node=N --gpu-bind=none) or use "
            f"{config_key}=1"
        )
    if slot + tp > len(node):
        raise PlacementError(
            f"config key '{config_key}' = {tp}: GPUs {slot}..{slot + tp - 1} of a node with "
            f"{len(node)} GPUs; replicas must fit on one node (cluster.gpus_per_node)"
        )
    return ",".join(node[slot : slot + tp])


def sglang_server_args(
    ec: InferenceEngineConfig,
    model_dir: str | Path,
    *,
    tp: int,
    kv_capacity_tokens: int,
    max_seq_len: int,
    seed: int,
    ports: list[int],
    mem_fraction_static: float | None,
) -> dict[str, Any]:
    """Keyword arguments of `sglang.Engine` (fields of SGLang 0.5.23's ServerArgs)."""
    port, nccl_port = ports
    args: dict[str, Any] = {
        **ec.server_args,
        "model_path": str(model_dir),
        "tp_size": tp,
        "base_gpu_id": 0,  # CUDA_VISIBLE_DEVICES is the replica's GPUs (engines/sglang/py)
        "skip_tokenizer_init": True,  # token ids in and out
        "enable_memory_saver": True,  # release/resume_memory_occupation on role shifts
        "context_length": max_seq_len,
        "max_total_tokens": kv_capacity_tokens,
        "max_running_requests": ec.max_batch,
        "chunked_prefill_size": ec.prefill_chunk_tokens,
        "random_seed": seed,
        "port": port,
        "nccl_port": nccl_port,
        "dist_init_addr": f"127.0.0.1:{nccl_port}",  # a replica is on one node
        "watchdog_timeout": ec.watchdog_timeout_s,
    }
    if mem_fraction_static is not None:
        args["mem_fraction_static"] = mem_fraction_static
    return args


def make_sglang_engine(
    ec: InferenceEngineConfig,
    model_dir: str | Path,
    *,
    role: str,
    tp: int,
    kv_capacity_tokens: int,
    slot: int,
    seed: int,
    api: Any = None,
    free_memory: Callable[[str | None], list[int]] | None = None,
    reclaim_signals: Callable[[], object] | None = None,
) -> SGLangEngine:
    """Start one SGLang Engine over GPUs [slot, slot + tp) of this node (this process
    becomes the replica leader) and wrap it. `api` replaces the sglang imports and
    `free_memory` the NVML query (tests)."""
    from pivot_hpc.engines.sglang.engine import SGLangEngine, load_sglang_api

    key = f"engines.{role}"
    api = api or load_sglang_api(f"{key}.engine")
    max_pos, eos = model_limits(model_dir)
    max_seq_len = ec.max_seq_len or max_pos
    visible = replica_gpus(slot, tp, f"{role}.tp")
    ports = engine_ports(ec.port_base, slot, config_key=f"{key}.port_base")
    fraction = ec.mem_fraction_static
    if fraction is None:
        free = (free_memory or free_gpu_bytes)(visible)
        if free:  # else SGLang's own choice (no NVML here)
            check_balanced(free, config_key=f"{role}.tp")
            fraction = mem_fraction_static(
                min(free),
                weights_bytes(model_dir) // tp,
                int(ec.memory_reserve_gib * GIB),
                config_key=f"{key}.memory_reserve_gib",
            )
    args = sglang_server_args(
        ec,
        model_dir,
        tp=tp,
        kv_capacity_tokens=kv_capacity_tokens,
        max_seq_len=max_seq_len,
        seed=seed,
        ports=ports,
        mem_fraction_static=fraction,
    )
    # its scheduler and detokenizer children must outlive Slurm's step-wide USR1/TERM
    with scoped_env(launch_env(visible)), job_signals.shielded():
        engine = api.engine_cls(**args)
    return SGLangEngine(
        engine,
        api=api,
        tp_size=tp,
        max_batch=ec.max_batch,
        max_seq_len=max_seq_len,
        eos_token_ids=eos,
        weight_bucket_bytes=ec.weight_bucket_mb << 20,
        stream_interval=ec.stream_interval,
        poll_s=ec.poll_s,
        abort_timeout_s=ec.abort_timeout_s,
        idle_timeout_s=ec.idle_timeout_s,
        pause_mode=ec.pause_mode,
        config_key=key,
        reclaim_signals=reclaim_signals,
    )
