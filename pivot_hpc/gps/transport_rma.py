"""Remote transfers with MPI one-sided communication, passive target.

Every host rank exposes its node's GPS buffer in one window over COMM_WORLD (`Win.Create`
over the shared-window memory, so it is the same bytes the node's ranks map). A reader
locks the holder's host rank shared, issues one Get per atomic slice (a strided slice is
one vector datatype, not one call per row) and unlocks, which completes them; a writer
does the same with Put. The host rank makes no call: with OpenMPI's osc/rdma over
shared-memory or RDMA-capable BTLs the transfer needs no target progress.

MPI counts are C ints, so a call moves at most `max_bytes` (gps.max_transfer_mib).

OpenMPI 4: run with OMPI_MCA_osc=^ucx (the tests and the bench do). Its osc/ucx
component read at ~1 GB/s here where osc/rdma (over vader's CMA) reads at memcpy speed
from private memory; from the shared-window pages (4 KiB tmpfs pages, no THP) it reaches
about half of memcpy on this VM. Real multi-node jobs go over osc/rdma or osc/ucx on the
fabric, where the same calls apply.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from pivot_hpc.gps.transport import Arena, Batch


class RmaTransport:
    name = "rma"

    def __init__(self, win: MPI.Win, host_of: np.ndarray, max_bytes: int) -> None:
        self.win = win
        self.host_of = host_of
        self.max_bytes = max_bytes
        self._types: dict[tuple[int, int, int], MPI.Datatype] = {}

    def _vector(self, nrows: int, row_bytes: int, stride: int) -> MPI.Datatype:
        key = (nrows, row_bytes, stride)
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

    def get(self, node: int, arena: Arena, batch: Batch) -> None:
        target = int(self.host_of[node])
        self.win.Lock(target, MPI.LOCK_SHARED)
        try:
            for buf, disp, count, dtype in self._ops(arena, batch):
                self.win.Get([buf, MPI.BYTE], target, (disp, count, dtype))
        finally:
            self.win.Unlock(target)

    def put(self, node: int, arena: Arena, batch: Batch) -> None:
        target = int(self.host_of[node])
        self.win.Lock(target, MPI.LOCK_SHARED)
        try:
            for buf, disp, count, dtype in self._ops(arena, batch):
                self.win.Put([buf, MPI.BYTE], target, (disp, count, dtype))
        finally:
            self.win.Unlock(target)

    def close(self) -> None:
        for t in self._types.values():
            t.Free()
        self._types.clear()
