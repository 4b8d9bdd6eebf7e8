"""Remote transfers with MPI one-sided communication, passive target.

Every rank exposes its node's GPS buffer in one window over COMM_WORLD (`Win.Create` over
the shared-window memory: the ranks of a node map the same bytes, so each of them is a
door to the node's buffer). A reader locks a target rank shared, issues one Get per
atomic slice (a strided slice is one vector datatype, not one call per row) and unlocks,
which completes them; a writer does the same with Put. The target makes no call: with
OpenMPI's osc/rdma over shared-memory or RDMA-capable BTLs a transfer needs no target
progress. A large transfer is cut into gps.remote_lanes stretches moved concurrently,
each through a different rank of the holder node (transport.Lanes); lanes need
MPI_THREAD_MULTIPLE, at a lower thread level the transport uses one.

MPI counts are C ints, so a call moves at most `max_bytes` (gps.max_transfer_mib).

OpenMPI 4: run with OMPI_MCA_osc=^ucx (the tests and the bench do). Its osc/ucx
component read at ~1 GB/s here where osc/rdma (over vader's CMA) reads at memcpy speed
from private memory; from the shared-window pages (4 KiB tmpfs pages, no THP) one lane
reaches about 0.4 of memcpy on this VM, two lanes about 0.75. Real multi-node jobs go
over osc/rdma or osc/ucx on the fabric, where the same calls apply.
"""

from __future__ import annotations

import threading

from mpi4py import MPI

from pivot_hpc.gps.transport import Arena, Batch, Lanes


def usable_lanes(requested: int) -> int:
    """`requested`, or 1 when MPI was not initialised with MPI_THREAD_MULTIPLE."""
    return requested if MPI.Query_thread() == MPI.THREAD_MULTIPLE else 1


class RmaTransport:
    name = "rma"

    def __init__(
        self,
        win: MPI.Win,
        node_ranks: list[list[int]],
        max_bytes: int,
        lanes: int = 1,
    ) -> None:
        """`node_ranks[n]`: the world ranks that expose node n's buffer, host rank first."""
        self.win = win
        self.node_ranks = node_ranks
        self.max_bytes = max_bytes
        self.lanes = Lanes(usable_lanes(lanes), "gps-rma")
        self._types: dict[tuple[int, int, int], MPI.Datatype] = {}
        self._types_lock = threading.Lock()

    def _vector(self, nrows: int, row_bytes: int, stride: int) -> MPI.Datatype:
        key = (nrows, row_bytes, stride)
        with self._types_lock:
            t = self._types.get(key)
            if t is None:
                t = self._types[key] = MPI.BYTE.Create_vector(nrows, row_bytes, stride).Commit()
        return t

    def _ops(self, arena: Arena, batch: Batch):
        """(local buffer, target displacement, count, datatype) per MPI call."""
        host = arena.require_host(self.name)
        cap = self.max_bytes
        for h, nr, rb, st, a in zip(
            batch.host_off.tolist(),
            batch.nrows.tolist(),
            batch.row_bytes.tolist(),
            batch.stride.tolist(),
            batch.arena_off.tolist(),
            strict=True,
        ):
            if nr == 1:
                for c in range(0, rb, cap):
                    n = min(cap, rb - c)
                    yield host[a + c : a + c + n], h + c, n, MPI.BYTE
            else:
                step = max(1, cap // rb)
                for r in range(0, nr, step):
                    k = min(step, nr - r)
                    buf = host[a + r * rb : a + (r + k) * rb]
                    yield buf, h + r * st, 1, self._vector(k, rb, st)

    def _move(self, put: bool, node: int, arena: Arena, batch: Batch) -> None:
        arena.require_host(self.name)
        call = self.win.Put if put else self.win.Get

        def lane(target, part: Batch) -> None:
            self.win.Lock(target, MPI.LOCK_SHARED)
            try:
                for buf, disp, count, dtype in self._ops(arena, part):
                    call([buf, MPI.BYTE], target, (disp, count, dtype))
            finally:
                self.win.Unlock(target)

        self.lanes.run(lane, self.lanes.plan(batch, self.node_ranks[node]))

    def get(self, node: int, arena: Arena, batch: Batch) -> None:
        self._move(False, node, arena, batch)

    def put(self, node: int, arena: Arena, batch: Batch) -> None:
        self._move(True, node, arena, batch)

    def close(self) -> None:
        self.lanes.close()
        for t in self._types.values():
            t.Free()
        self._types.clear()
