"""Global Parameter Storage (GPS, paper §5.1 and App. B; docs/design.md §4).

Every node's host rank (local rank 0) keeps the parameters of every model in an MPI shared
window that all ranks of the node map; a rank that takes on a role Reads the model laid
out for its parallelism, and training Writes each new policy version.

Public API::

    from pivot_hpc.gps import GlobalParameterStorage, Parallelism, ModelSpec, PAPER_MODELS

    gps = GlobalParameterStorage(MPI.COMM_WORLD, cfg.gps, models={"policy": spec, "genrm": s2},
                                 read_only=["genrm"])          # collective: every world rank
    gps.load("policy", full_tensors_or_callable, version=0)    # collective: every world rank
    shards, version = gps.read("policy", ranks, Parallelism(tp=2, pp=1, dp=1))
    new_version = gps.write("policy", ranks, Parallelism(tp=2, pp=2), my_shards)
    gps.close()                                                # collective: every world rank

Who calls what:
- constructor, `load`, `close`: every rank of the communicator (hosts and workers).
- `read(M, G, P)`: each rank of G, independently — no collective, no message before the
  transfers (every rank computes the same plan), and host ranks do nothing: node-local
  bytes are copied out of the shared window, remote ones are pulled with MPI RMA (passive
  target) or NIXL READ. Host ranks need no serve loop.
- `write(M, G, P, shards)`: every rank of G together (collective over G only); each
  pushes the slices the plan assigns it to every replica (or group member) that holds
  them; returns the new version once it is published everywhere.
- G is a list of world ranks; rank G[i] has coordinates `Parallelism.coords(i)` =
  (dp, pp, tp), tp fastest, then dp, then pp (Megatron's order).

Planning: Read/Write re-partition host slices into the caller's slices (common refinement
into atomic slices), and each (atomic slice, receiver) demand goes to the holder that
would finish it earliest under the link cost model (gps.cost_model, greedy.py); plans are
cached by (op, M, G, P). Versions: writable models are double-buffered on every node (2x
their bytes), a Read returns one whole version (seqlock retry, store.py), GenRM
(read_only) takes 1x. Transports: node-local copies straight out of the shared window;
remote via MPI RMA (OpenMPI 4: run with OMPI_MCA_osc=^ucx) or NIXL (gps.transport).

Shards are keyed by HuggingFace names (global layer indices) with shard shapes; numpy
arrays by default (bfloat16 as uint16 bit patterns), torch tensors with `device=`.

Modules: catalog (tensors, TP/PP rules, the paper's models), fused (fused QKV / gate-up
converters), layout (replication groups), slices (common refinement), greedy + plan
(load-balanced plans and their cache), links (cost model), nodes (node / pseudo-node
communicators), transport* (shared window, MPI RMA, NIXL), store (the object), config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pivot_hpc.gps.catalog import PAPER_MODELS, GPSError, ModelSpec, Parallelism, TensorSpec
from pivot_hpc.gps.config import GPSConfig

if TYPE_CHECKING:
    from pivot_hpc.gps.store import GlobalParameterStorage


def __getattr__(name: str):
    # mpi4py is imported only when the storage itself is used (config loading needs none)
    if name == "GlobalParameterStorage":
        from pivot_hpc.gps.store import GlobalParameterStorage

        return GlobalParameterStorage
    raise AttributeError(f"module 'pivot_hpc.gps' has no attribute {name!r}")


__all__ = [
    "PAPER_MODELS",
    "GPSConfig",
    "GPSError",
    "GlobalParameterStorage",
    "ModelSpec",
    "Parallelism",
    "TensorSpec",
]
