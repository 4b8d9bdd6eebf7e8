"""Which GPU a worker rank drives (docs/design.md §2): bound before anything touches CUDA.

A worker (node-local rank j ≥ 1) owns GPU slot j-1 of its node. It sees exactly that GPU:
`CUDA_VISIBLE_DEVICES` is narrowed to it and `LOCAL_RANK` is 0, its index in what it
sees, so torch, Megatron (`select_cuda_device`) and the `hf` engine all use "cuda:0".
CUDA reads the variable once, at its first initialisation, so `bind_worker_gpu` runs at
the start of the rank (cli/run.py), before torch or mpi4py do anything with a device.

What the launcher shows the rank decides how:
- every GPU of the node (CUDA_VISIBLE_DEVICES unset, or a list of `cluster.gpus_per_node`
  ids, as `srun --gpus-per-node` sets it): the worker takes entry j-1;
- one GPU (srun's per-task binding, `--gpus-per-task=1` / `--gpu-bind`): already its own;
- none (CUDA_VISIBLE_DEVICES empty, or no NVIDIA driver): a CPU run, nothing to bind;
- any other count: an error naming `cluster.gpus_per_node` (the slot would be a guess).

An SGLang replica leader starts its engine over the replica's `tp` GPUs, which only it
knows how to name: the node's list is kept in `PIVOT_HPC_NODE_GPUS` for
`engines.sglang.launch.replica_gpus`
(SGLang's scheduler processes inherit CUDA_VISIBLE_DEVICES from the leader at their
start; veRL starts its servers the same way). With per-task binding there is no such list,
and a tp > 1 replica cannot see its GPUs: that is refused by name.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path

from pivot_hpc.engines.sglang.launch import NODE_GPUS_ENV
from pivot_hpc.errors import PlacementError

# where each launcher puts the world rank (OpenMPI, PMIx, MPICH/PMI, srun)
RANK_ENV = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")
NVIDIA_PROC = Path("/proc/driver/nvidia/gpus")  # one entry per GPU; reading it starts no CUDA


@dataclass(frozen=True, slots=True)
class Binding:
    rank: int
    slot: int  # node-local GPU index of the worker
    gpu: str  # the device id it now sees alone (CUDA_VISIBLE_DEVICES)
    node_gpus: tuple[str, ...]  # the node's GPUs in slot order; () with per-task binding


def world_rank(env: MutableMapping[str, str] | None = None) -> int | None:
    env = os.environ if env is None else env
    for key in RANK_ENV:
        if env.get(key, "").strip().isdigit():
            return int(env[key])
    return None


def visible_gpus(env: MutableMapping[str, str], proc: Path = NVIDIA_PROC) -> list[str]:
    """What the launcher shows this rank: CUDA_VISIBLE_DEVICES, else every GPU the driver
    lists (none without a driver)."""
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is not None:
        return [d.strip() for d in raw.split(",") if d.strip()]
    try:
        return [str(i) for i in range(sum(1 for _ in proc.iterdir()))]
    except OSError:
        return []


def bind_worker_gpu(
    ranks_per_node: int,
    gpus_per_node: int,
    env: MutableMapping[str, str] | None = None,
    proc: Path = NVIDIA_PROC,
) -> Binding | None:
    """Narrow a worker rank to its GPU (see the module docstring). Host ranks and CPU runs
    are left as they are (None); every rank checks the layout, so all of them fail alike."""
    env = os.environ if env is None else env
    rank = world_rank(env)
    if rank is None:
        return None
    visible = visible_gpus(env, proc)
    if not visible:
        return None
    if len(visible) == gpus_per_node:
        node = tuple(visible)
    elif len(visible) == 1:
        node = ()  # the launcher bound one GPU per task
    else:
        raise PlacementError(
            f"config key 'cluster.gpus_per_node' = {gpus_per_node}, but rank {rank} sees "
            f"{len(visible)} GPUs (CUDA_VISIBLE_DEVICES={','.join(visible)}): give each node "
            f"exactly {gpus_per_node} GPUs (sbatch --gpus-per-node={gpus_per_node}), bind one "
            "GPU per task (srun --gpus-per-task=1), set cluster.gpus_per_node to the GPUs a node "
            "has, or hide them (CUDA_VISIBLE_DEVICES=) to run on CPU"
        )
    local = rank % ranks_per_node
    if local == 0:
        return None  # the host rank: parameter storage only, no GPU of its own
    slot = local - 1
    gpu = node[slot] if node else visible[0]
    env["CUDA_VISIBLE_DEVICES"] = gpu
    env["LOCAL_RANK"] = "0"  # its index among the devices it sees
    env[NODE_GPUS_ENV] = ",".join(node)
    return Binding(rank, slot, gpu, node)
