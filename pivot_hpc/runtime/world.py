"""World layout (docs/design.md §2): hosts, the coordinator, and workers bound to device slots.

COMM_WORLD is split into nodes (COMM_TYPE_SHARED, or pseudo-nodes of `gps.pseudo_node_size`
ranks for tests on one host). On each node local rank 0 is the HOST rank (GPS shard);
world rank 0 is also the COORDINATOR; local rank j ≥ 1 is a WORKER bound to device slot
j-1 of its node, i.e. global GPU id node·gpus_per_node + j-1.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from pivot_hpc.errors import PivotError
from pivot_hpc.job.config import ClusterConfig, Config


class LayoutError(PivotError, RuntimeError):
    pass


@dataclass(frozen=True)
class Layout:
    rank: int
    size: int
    node: int
    local_rank: int
    gpus_per_node: int

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    @property
    def is_host(self) -> bool:
        return self.local_rank == 0

    @property
    def gpu(self) -> int | None:
        return None if self.is_host else self.node * self.gpus_per_node + self.local_rank - 1

    def rank_of_gpu(self, gpu: int) -> int:
        node, slot = divmod(gpu, self.gpus_per_node)
        return node * self.ranks_per_node + slot + 1

    @property
    def ranks_per_node(self) -> int:
        return ClusterConfig(gpus_per_node=self.gpus_per_node).ranks_per_node


def expected_size(cfg: Config) -> int:
    return cfg.cluster.world_size


def check_launch(cfg: Config, size: int) -> None:
    """Validate the world against the config and Slurm before any work (clear errors)."""
    want = expected_size(cfg)
    if size != want:
        raise LayoutError(
            f"the MPI world has {size} ranks but the config needs {want}: cluster.nodes="
            f"{cfg.cluster.nodes} × (cluster.gpus_per_node={cfg.cluster.gpus_per_node} workers "
            "+ 1 host rank); launch with that many tasks (sbatch --ntasks-per-node="
            f"{cfg.cluster.ranks_per_node}) or change cluster.*"
        )
    check_live_config(cfg)
    ntasks = os.environ.get("SLURM_NTASKS")
    if ntasks is not None and int(ntasks) != size:
        raise LayoutError(
            f"SLURM_NTASKS={ntasks} but COMM_WORLD has {size} ranks: the MPI library did not "
            "form one world (use srun --mpi=pmix with OpenMPI)"
        )


def check_before_launch(cfg: Config) -> None:
    """Everything a launcher refuses before it starts a world, in one place (`pivot-hpc
    run`, `pivot-hpc submit`, slurm/pivot.sbatch): the memory plan when the config names
    its GPU, what only a live run cannot do, the experiment trackers asked for, tools, and
    each configured model directory for its roles (models/role_check.py)."""
    from pivot_hpc.models.role_check import check_model_dirs
    from pivot_hpc.planning import check_memory
    from pivot_hpc.tracking import check_available

    check_model_dirs(cfg)  # first: the memory plan reads these directories too
    check_memory(cfg)
    check_live_config(cfg)
    check_available(cfg.tracking)
    check_tools(cfg)


# What the live runtime lacks before `tools.enabled` can run (docs/guide/agentic.md): nothing
# since the coordinator's turn loop (coordinator/turns.py) landed; only the preflight is
# left. A later gap is named here and refused in one line.
TOOLS_MISSING = ""


def check_tools(cfg: Config) -> None:
    """`tools.enabled`: the sandbox must run the declared tools on this machine (one call
    each, `preflight`), and the live runtime must be able to run multi-turn rollouts."""
    if not cfg.tools.enabled:
        return
    from pivot_hpc.agentic.server import preflight
    from pivot_hpc.agentic.tools import build_registry

    why = preflight(build_registry(cfg.tools.tools), cfg.tools.sandbox_limits())
    if why is not None:
        raise LayoutError(why)
    if TOOLS_MISSING:
        raise LayoutError(
            "tools.enabled=true: the live runtime starts each node's tool sandbox but does "
            f"not have {TOOLS_MISSING} yet (issue 37; docs/guide/agentic.md says what is wired); "
            "set tools.enabled=false"
        )


def check_live_config(cfg: Config) -> None:
    """What only a live run cannot do (the simulator runs any tp with any engine); the
    launchers call this before starting anything, the world again on arrival."""
    for role in ("rollout", "reward"):
        tp = getattr(cfg, role).tp
        if tp > 1 and getattr(cfg.engines, role).engine == "hf":
            raise LayoutError(
                f"{role}.tp={tp} with engines.{role}.engine=hf: the hf engine serves a "
                f"replica on one device; use {role}.tp=1, or engines.{role}.engine=sglang "
                "for tensor-parallel replicas"
            )
    check_vllm_roles(cfg)
    from pivot_hpc.rl.grpo import resolve_loss

    resolve_loss(cfg.rl.grpo.loss_fn)  # importable here; every rank imports it again
    n_train = len(cfg.training_gpus())
    if n_train % cfg.rl.trainer.tp:
        raise LayoutError(
            f"training.num_gpus={n_train} is not a multiple of rl.trainer.tp="
            f"{cfg.rl.trainer.tp}: training runs tp-way tensor parallelism × "
            "num_gpus/tp-way data parallelism; make num_gpus a multiple of tp"
        )


def check_vllm_roles(cfg: Config) -> None:
    """`engines.<role>.engine: vllm` (engines/vllm/launch.py): installed, on one device, and,
    where vLLM runs in the worker rank's process (`process: in_rank`), beside a
    torch.distributed world of one rank (vLLM builds its groups over the whole default
    group; in a child process it has its own)."""
    roles = [r for r in ("rollout", "reward") if getattr(cfg.engines, r).engine == "vllm"]
    if not roles:
        return
    from pivot_hpc.engines.vllm.launch import check_installed
    from pivot_hpc.runtime.training_world import TrainingWorld

    for role in roles:
        check_installed(f"engines.{role}.engine")
        tp = getattr(cfg, role).tp
        if tp > 1:
            raise LayoutError(
                f"{role}.tp={tp} with engines.{role}.engine=vllm: a vllm engine serves a "
                "replica on its worker's one device (replicas over several workers' devices "
                f"are built for sglang only; docs/guide/vllm.md); use {role}.tp=1, or "
                f"engines.{role}.engine=sglang for tensor-parallel replicas"
            )
    in_rank = [r for r in roles if getattr(cfg.engines, r).process == "in_rank"]
    world = len(TrainingWorld.of(cfg, lambda gpu: gpu).ranks)
    if in_rank and world > 1:
        raise LayoutError(
            f"engines.{in_rank[0]}.engine=vllm with engines.{in_rank[0]}.process=in_rank and "
            f"a training world of {world} ranks (training.num_gpus={len(cfg.training_gpus())}"
            f", planner.elastic_training={cfg.planner.elastic_training}): vLLM in a worker's "
            "process joins that rank's torch.distributed group and would wait for every "
            f"training rank; use engines.{in_rank[0]}.process=child (docs/guide/vllm.md)"
        )


def layout(comm, cfg: Config) -> Layout:
    """This rank's place (collective: every rank checks where all the others run). Ranks
    must be node-major — the first `ranks_per_node` on the first node, and so on — which
    is srun's block distribution and mpirun's default, but not what srun does with
    `--distribution=cyclic` or an arbitrary SLURM_DISTRIBUTION a site sets."""
    per = cfg.cluster.ranks_per_node
    # Slurm's node id counts only where srun started this rank (its task id is the rank);
    # an mpirun inside an allocation inherits one id for every rank
    srun = os.environ.get("SLURM_PROCID") == str(comm.Get_rank())
    node_id = os.environ.get("SLURM_NODEID") if srun else None
    places = comm.allgather((node_id, socket.gethostname()))
    why = node_major_problem(places, per)
    if why is not None:
        raise LayoutError(
            f"{why}: the layout needs {per} consecutive ranks per node (cluster.gpus_per_node="
            f"{cfg.cluster.gpus_per_node} workers + 1 host rank); launch with srun "
            "--distribution=block (slurm/pivot.sbatch and pivot-hpc submit do) or mpirun "
            "--map-by slot"
        )
    node, local = divmod(comm.Get_rank(), per)
    return Layout(comm.Get_rank(), comm.Get_size(), node, local, cfg.cluster.gpus_per_node)


def node_major_problem(places: list[tuple[str | None, str]], per: int) -> str | None:
    """Why ranks placed at `places` (each rank's (SLURM_NODEID or None, hostname), in rank
    order) are not node-major with `per` ranks per node; None when they are. Each block of
    `per` consecutive ranks must share one node; under Slurm (every rank has a node id)
    each block a node of its own. Without Slurm hosts may hold several blocks (pseudo-nodes
    on one host: gps.pseudo_node_size), never a block split over hosts."""
    slurm = all(nid is not None for nid, _ in places)
    where = [f"Slurm node {nid}" for nid, _ in places] if slurm else [h for _, h in places]
    firsts: dict[str, int] = {}
    for start in range(0, len(where), per):
        for r in range(start, min(start + per, len(where))):
            if where[r] != where[start]:
                return (
                    f"rank {r} runs on {where[r]} but rank {start} of its block on {where[start]}"
                )
        if slurm and where[start] in firsts:
            return f"ranks {firsts[where[start]]} and {start} start two blocks on {where[start]}"
        firsts[where[start]] = start
    return None
