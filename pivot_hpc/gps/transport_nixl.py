"""Remote transfers with NIXL READ/WRITE over UCX (paper App. B.2), DRAM or VRAM arenas.

Every rank runs one NIXL agent; each host rank registers its node's whole GPS buffer
(DRAM) once, at start-up, and the agents' metadata and buffer addresses are exchanged with
one allgather. A Read registers the caller's arena, builds one descriptor per contiguous
run (strided slices become one run per row) and posts a single READ per holder node; the
host side does nothing (UCX moves the data; on one machine through CMA, zero-copy).

UCX_MODULES=^ib is set before the first agent: NIXL's bundled libnl and Debian's
libibverbs providers otherwise crash every process at exit (PLATFORM.md). The first
transfer to a peer pays UCX wire-up (~1 s here); later ones do not.
"""

from __future__ import annotations

import os
import time

import numpy as np

from pivot_hpc.gps.catalog import GPSError
from pivot_hpc.gps.transport import Arena, Batch

# Before nixl is first imported, whoever imports it (its log level is read at import).
os.environ.setdefault("UCX_MODULES", "^ib")
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

    def __init__(self, nodes, buf: np.ndarray | None, max_bytes: int) -> None:
        """Collective over nodes.world. `buf`: this host rank's node buffer, else None."""
        nixl_agent, nixl_agent_config = _agent_api()
        world = nodes.world
        self.max_bytes = max_bytes
        self.agent = nixl_agent(f"gps-{world.rank}", nixl_agent_config(backends=["UCX"]))
        self._host_reg = None
        base, meta = 0, None
        if buf is not None and buf.nbytes:
            self._host_reg = self.agent.register_memory(
                [(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM"
            )
            base, meta = buf.ctypes.data, self.agent.get_agent_metadata()
        info = world.allgather((base, meta))
        self.peers: dict[int, tuple[str, int]] = {}  # node -> (agent name, buffer address)
        for node, host in enumerate(nodes.host_of.tolist()):
            b, m = info[host]
            if host != world.rank and m is not None:
                self.peers[node] = (self.agent.add_remote_agent(m), b)

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
        name, base = self.peers[node]
        self._register(arena)
        host, loc, length = batch.runs(self.max_bytes)
        local = np.stack([arena.addr + loc, length, np.full_like(length, arena.dev_id)], 1)
        remote = np.stack([base + host, length, np.zeros_like(length)], 1)
        ld = self.agent.get_xfer_descs(local.astype(np.uint64), arena.mem_type)
        rd = self.agent.get_xfer_descs(remote.astype(np.uint64), "DRAM")
        handle = self.agent.initialize_xfer(op, ld, rd, name)
        try:
            state = self.agent.transfer(handle)
            delay = 1e-5
            while state == "PROC":
                time.sleep(delay)  # two cores: do not spin against the ranks we wait for
                delay = min(delay * 2, 1e-3)
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise GPSError(f"NIXL {op} from node {node} failed (state {state!r})")
        finally:
            self.agent.release_xfer_handle(handle)

    def get(self, node: int, arena: Arena, batch: Batch) -> None:
        self._xfer("READ", node, arena, batch)

    def put(self, node: int, arena: Arena, batch: Batch) -> None:
        self._xfer("WRITE", node, arena, batch)

    def close(self) -> None:
        for name, _ in self.peers.values():
            self.agent.remove_remote_agent(name)
        self.peers.clear()
        if self._host_reg is not None:
            self.agent.deregister_memory(self._host_reg)
            self._host_reg = None
