"""Remote transfers with NIXL READ/WRITE over UCX (paper App. B.2), DRAM or VRAM arenas.

Every rank runs one NIXL agent; the first gps.remote_lanes ranks of each node (host rank
first) register their mapping of the node's whole GPS buffer (DRAM) once, at start-up, and
the agents' metadata and buffer addresses are exchanged with one allgather. A Read
registers the caller's arena, builds one descriptor per contiguous run (strided slices
become one run per row) and posts one READ per lane: the batch is cut into stretches of
about equal bytes, each read from a different rank of the holder node by its own thread
and UCX worker (transport.Lanes; two lanes: 6.5 → 10.4 GB/s here). The holder side does
nothing (UCX moves the data; on one machine through CMA, zero-copy).

Passive target, like the RMA transport (gps.nixl_progress_thread=false, the default):
agents run no progress thread and UCX endpoints use error-handling mode "none", so a READ
or WRITE is driven by the initiator alone (CMA on one host, RDMA READ/WRITE on a fabric)
and the holder spends no CPU. NIXL's own progress thread polls without pause
(`pthrDelay=0` in its Python API): with one per rank on this 2-core machine a 311 MiB
READ ran at 2.6 GB/s; passive, at 6.5 GB/s. A fabric without one-sided RDMA (TCP only)
needs the target to progress: set gps.nixl_progress_thread=true there. A transfer that
does not finish within gps.transfer_timeout_s fails with an error that says so.

UCX_MODULES is left to the site: on a cluster it must keep InfiniBand (`^ib` there turns
RDMA off and passive NIXL reads over TCP stall). Where NIXL's bundled libnl and Debian's
libibverbs providers crash every process at exit (CPU machines like CI's, docs/platform.md),
the launchers of local and CPU-only worlds set `UCX_MODULES=^ib` themselves
(cli/local_world.py, slurm/pivot.sbatch, `pivot-hpc submit`). The first transfer to a
peer pays UCX wire-up (~1 s here); later ones do not.
"""

from __future__ import annotations

import os
import time

import numpy as np

from pivot_hpc.gps.catalog import GPSError
from pivot_hpc.gps.transport import Arena, Batch, Lanes

# Before nixl is first imported, whoever imports it (its log level is read at import).
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # one INFO line per agent and rank otherwise
# UCX's single-copy (CMA) transport moves one segment per progress call; with its 512 KiB
# default a 256 MiB READ ran at ~2 GB/s here, with 8 MiB segments at ~6.6 GB/s.
os.environ.setdefault("UCX_CMA_SEG_SIZE", "8M")


def nixl_available() -> bool:
    try:
        import nixl  # noqa: F401
    except Exception:
        return False
    return True


def _agent_api():
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except Exception as exc:  # ImportError, or a broken native library
        raise GPSError(
            f"gps.transport=nixl but nixl cannot be imported ({exc}); "
            "`pip install nixl` (or pivot_hpc[nixl]) or set gps.transport=rma"
        ) from exc
    return nixl_agent, nixl_agent_config


class NixlTransport:
    name = "nixl"

    def __init__(
        self,
        nodes,
        buf: np.ndarray,
        max_bytes: int,
        *,
        lanes: int = 1,
        progress_thread: bool = False,
        timeout_s: float = 300.0,
    ) -> None:
        """Collective over nodes.world. `buf`: this rank's mapping of its node's buffer."""
        nixl_agent, nixl_agent_config = _agent_api()
        from nixl._api import nixl_thread_sync_t

        world = nodes.world
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.progress_thread = progress_thread
        self.lanes = Lanes(lanes, "gps-nixl")
        # lanes post and poll from several threads: NIXL's reader-writer locking, and one
        # UCX worker per lane (one worker progresses its transfers one after another)
        sync = nixl_thread_sync_t.NIXL_THREAD_SYNC_RW if lanes > 1 else None
        config = nixl_agent_config(enable_prog_thread=progress_thread, backends=[], sync_mode=sync)
        self.agent = nixl_agent(f"gps-{world.rank}", config)
        # "peer" error handling wires endpoints up with messages the target must answer
        mode = "peer" if progress_thread else "none"
        self.agent.create_backend(
            "UCX", {"ucx_error_handling_mode": mode, "num_workers": str(self.lanes.count)}
        )
        # the first `lanes` ranks of every node expose their mapping of the node's buffer
        self._host_reg = None
        base, meta = 0, None
        if nodes.local.rank < self.lanes.count and buf.nbytes:
            self._host_reg = self.agent.register_memory(
                [(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM"
            )
            base, meta = buf.ctypes.data, self.agent.get_agent_metadata()
        info = world.allgather((base, meta))
        # node -> [(agent name, buffer address)], host rank first
        self.peers: dict[int, list[tuple[str, int]]] = {}
        for node, ranks in enumerate(nodes.ranks_of()):
            if node == nodes.node:
                continue
            doors = [info[r] for r in ranks if info[r][1] is not None]
            if doors:
                self.peers[node] = [(self.agent.add_remote_agent(m), b) for b, m in doors]

    def _register(self, arena: Arena) -> None:
        if arena.registration is None and arena.nbytes:
            arena.registration = (
                self.agent.register_memory(
                    [(arena.addr, arena.nbytes, arena.dev_id, "")], arena.mem_type
                ),
                self,
            )

    def release(self, arena: Arena) -> None:
        if arena.registration is not None:
            self.agent.deregister_memory(arena.registration[0])
            arena.registration = None

    def _xfer(self, op: str, node: int, arena: Arena, batch: Batch) -> None:
        if not len(batch):
            return
        if node not in self.peers:
            raise GPSError(f"NIXL has no agent for node {node}'s host rank")
        self._register(arena)  # in this thread, before the lanes use it

        def lane(peer, part: Batch) -> None:
            name, base = peer
            host, loc, length = part.runs(self.max_bytes)
            local = np.stack([arena.addr + loc, length, np.full_like(length, arena.dev_id)], 1)
            remote = np.stack([base + host, length, np.zeros_like(length)], 1)
            ld = self.agent.get_xfer_descs(local.astype(np.uint64), arena.mem_type)
            rd = self.agent.get_xfer_descs(remote.astype(np.uint64), "DRAM")
            handle = self.agent.initialize_xfer(op, ld, rd, name)
            try:
                state = self.agent.transfer(handle)
                start, delay = time.monotonic(), 1e-5
                while state == "PROC":
                    if time.monotonic() - start > self.timeout_s:
                        raise GPSError(self._stuck(op, node, part.nbytes))
                    time.sleep(delay)  # two cores: do not spin against the ranks we wait for
                    delay = min(delay * 2, 1e-3)
                    state = self.agent.check_xfer_state(handle)
                if state != "DONE":
                    raise GPSError(f"NIXL {op} from node {node} failed (state {state!r})")
            finally:
                try:
                    self.agent.release_xfer_handle(handle)
                except Exception:
                    if state != "PROC":  # a stuck transfer may refuse; keep its timeout error
                        raise

        self.lanes.run(lane, self.lanes.plan(batch, self.peers[node]))

    def _stuck(self, op: str, node: int, nbytes: int) -> str:
        why = (
            "the holder's NIXL progress thread is running, so the fabric or the peer is stuck"
            if self.progress_thread
            else "agents run passive (gps.nixl_progress_thread=false), which needs one-sided "
            "RDMA or CMA; on a TCP-only fabric set gps.nixl_progress_thread=true"
        )
        return (
            f"NIXL {op} of {nbytes} B from node {node} did not finish within "
            f"{self.timeout_s:g} s (gps.transfer_timeout_s): {why}"
        )

    def get(self, node: int, arena: Arena, batch: Batch) -> None:
        self._xfer("READ", node, arena, batch)

    def put(self, node: int, arena: Arena, batch: Batch) -> None:
        self._xfer("WRITE", node, arena, batch)

    def close(self) -> None:
        self.lanes.close()
        for doors in self.peers.values():
            for name, _ in doors:
                self.agent.remove_remote_agent(name)
        self.peers.clear()
        if self._host_reg is not None:
            self.agent.deregister_memory(self._host_reg)
            self._host_reg = None
