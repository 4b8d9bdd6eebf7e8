"""Transports behind one interface, and the local memory they move into or out of.

A Read or Write moves, between the caller's *arena* (one contiguous block holding all of
its shards, host DRAM or GPU VRAM) and one node's GPS buffer, a batch of atomic slices:
`nrows` runs of `row_bytes`, `stride` apart in the node buffer, packed in the arena.

- `LocalCopy`: the caller's own node — a plain copy out of / into the shared window,
  which every rank of the node maps (zero-copy: no MPI call, no staging).
- `RmaTransport` (transport_rma.py): another node via MPI one-sided Get/Put, passive
  target, so the host rank does nothing.
- `NixlTransport` (transport_nixl.py): another node via NIXL READ/WRITE over UCX; the
  arena may be VRAM.

Which remote transport is used is `gps.transport`; the node-local path is always the
shared window.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from numpy.lib.stride_tricks import as_strided

from pivot_hpc.gps.catalog import GPSError


@dataclass
class Batch:
    """Slices between one node buffer and one arena (int64 arrays, one entry per slice)."""

    host_off: np.ndarray  # byte offset in the node's GPS buffer
    nrows: np.ndarray
    row_bytes: np.ndarray
    stride: np.ndarray  # distance between runs in the node buffer
    arena_off: np.ndarray  # byte offset of the packed runs in the arena
    # split(parts) results, kept with the batch (batches are cached with their plan)
    _parts: dict[int, list[Batch]] = field(default_factory=dict, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.host_off)

    @property
    def nbytes(self) -> int:
        return int((self.nrows * self.row_bytes).sum())

    def runs(self, max_bytes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Flatten to contiguous runs (host_off, arena_off, length), none over max_bytes."""
        rows = self.nrows
        idx = np.repeat(np.arange(len(rows)), rows)
        first = np.cumsum(rows) - rows
        r = np.arange(int(rows.sum())) - first[idx]
        host = self.host_off[idx] + r * self.stride[idx]
        arena = self.arena_off[idx] + r * self.row_bytes[idx]
        length = self.row_bytes[idx]
        if len(length) and length.max() > max_bytes:
            pieces = -(-length // max_bytes)
            j = np.repeat(np.arange(len(length)), pieces)
            first = np.cumsum(pieces) - pieces
            c = (np.arange(int(pieces.sum())) - first[j]) * max_bytes
            host, arena = host[j] + c, arena[j] + c
            length = np.minimum(length[j] - c, max_bytes)
        return host, arena, length

    def split(self, parts: int) -> list[Batch]:
        """Cut into at most `parts` batches of about equal bytes, for concurrent lanes.

        The slices are laid end to end and cut at every nbytes/parts: a contiguous slice
        is cut at that byte, a strided one at the nearest row, so each lane reads one
        stretch of the node buffer in order. Empty parts are dropped.
        """
        if parts <= 1 or len(self) == 0:
            return [self]
        done = self._parts.get(parts)
        if done is not None:
            return done
        cuts = [self.nbytes * k // parts for k in range(1, parts)]
        lanes: list[list[tuple[int, int, int, int, int]]] = [[] for _ in range(parts)]
        lane, pos = 0, 0  # pos: bytes before the current piece in the end-to-end order
        for h, nr, rb, st, a in zip(*_cols(self), strict=True):
            size = nr * rb
            while size:
                while lane < parts - 1 and cuts[lane] <= pos:
                    lane += 1
                room = cuts[lane] - pos if lane < parts - 1 else size
                if nr == 1:  # contiguous: cut at any byte
                    take = min(size, room)
                    lanes[lane].append((h, 1, take, take, a))
                    h, a = h + take, a + take
                else:  # strided: whole rows, up to the nearest row to the cut
                    rows = min(nr, max(1, round(room / rb)))
                    take = rows * rb
                    lanes[lane].append((h, rows, rb, st, a))
                    h, a, nr = h + rows * st, a + take, nr - rows
                size, pos = size - take, pos + take
        out = [
            Batch(*(np.array(col, dtype=np.int64) for col in zip(*part, strict=True)))
            for part in lanes
            if part
        ]
        self._parts[parts] = out
        return out


class Arena:
    """One contiguous block for all shards of a Read or Write: host DRAM, or VRAM on GPU."""

    def __init__(self, nbytes: int, device: str | None = None) -> None:
        self.nbytes = nbytes
        self.device = device
        self.torch = None
        if device is None or device == "cpu":
            # 64-byte aligned, so every shard view is aligned like the node buffer
            raw = np.empty(nbytes + 64, dtype=np.uint8)
            start = (-raw.ctypes.data) % 64
            self.host: np.ndarray | None = raw[start : start + nbytes]
            self.addr = self.host.ctypes.data
            self.mem_type, self.dev_id = "DRAM", 0
        else:
            import torch

            self.torch = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
            self.host = None
            self.addr = self.torch.data_ptr()
            self.mem_type = "VRAM" if self.torch.is_cuda else "DRAM"
            self.dev_id = max(self.torch.get_device(), 0)
        self.registration = None  # a transport's handle for this memory (NIXL)

    def copy_in(self, off: int, src: np.ndarray) -> None:
        """Copy a 2-D (possibly strided) uint8 host array into the arena at `off`."""
        n = src.size
        if self.host is not None:
            np.copyto(self.host[off : off + n].reshape(src.shape), src)
        else:
            import torch

            self.torch[off : off + n].view(src.shape).copy_(torch.from_numpy(src))

    def copy_out(self, off: int, dst: np.ndarray) -> None:
        """Copy arena bytes at `off` into a 2-D (possibly strided) uint8 host array."""
        n = dst.size
        if self.host is not None:
            np.copyto(dst, self.host[off : off + n].reshape(dst.shape))
        else:
            import torch

            torch.from_numpy(dst).copy_(self.torch[off : off + n].view(dst.shape))

    def require_host(self, transport: str) -> np.ndarray:
        if self.host is None:
            raise GPSError(
                f"transport {transport!r} moves host memory only and this arena is on "
                f"{self.device}; set gps.transport=nixl to read into GPU memory"
            )
        return self.host


# Below this many bytes per lane a thread hand-off costs more than it saves.
MIN_LANE_BYTES = 4 << 20


class Lanes:
    """Concurrent lanes of one remote transfer (gps.remote_lanes), part 0 in the caller.

    Each lane moves one stretch of a batch (`Batch.split`) through a different rank of
    the holder node: over CMA the kernel serialises copies out of one target process
    (two threads reading one process: 4.6 GB/s here; two processes mapping the same
    pages: 8.4 GB/s). On an RDMA fabric one lane already keeps many transfers in flight;
    each extra lane costs one thread.
    """

    def __init__(self, lanes: int, name: str) -> None:
        self.count = max(1, lanes)
        self.split_runs = 0  # transfers that ran on more than one lane
        self._pool = ThreadPoolExecutor(self.count - 1, name) if self.count > 1 else None

    def plan(self, batch: Batch, targets: Sequence) -> list[tuple[object, Batch]]:
        """(target, part) pairs: as many lanes as targets, lanes and bytes allow."""
        n = min(self.count, len(targets), max(1, batch.nbytes // MIN_LANE_BYTES))
        return list(zip(targets, batch.split(n), strict=False))

    def run(self, lane: Callable[[object, Batch], None], jobs: list[tuple[object, Batch]]) -> None:
        """lane(target, part) for every job; returns when all are done, raising the first
        error of the caller's lane, else of the others."""
        if len(jobs) == 1 or self._pool is None:
            for target, part in jobs:
                lane(target, part)
            return
        self.split_runs += 1
        others = [self._pool.submit(lane, t, p) for t, p in jobs[1:]]
        try:
            lane(*jobs[0])
        finally:
            for f in others:
                f.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


def host_runs(buf: np.ndarray, off: int, nrows: int, row_bytes: int, stride: int) -> np.ndarray:
    """A (nrows, row_bytes) strided uint8 view of a node buffer."""
    return as_strided(buf[off:], shape=(nrows, row_bytes), strides=(stride, 1), writeable=True)


class Transport(Protocol):
    name: str

    def get(self, node: int, arena: Arena, batch: Batch) -> None:
        """Node buffer -> arena; returns once the bytes have landed."""

    def put(self, node: int, arena: Arena, batch: Batch) -> None:
        """Arena -> node buffer; returns once the bytes are visible at the node."""

    def close(self) -> None: ...


class LocalCopy:
    """The caller's own node: copy straight out of / into the mapped shared window."""

    name = "local"

    def __init__(self, buf: np.ndarray) -> None:
        self.buf = buf

    def get(self, node: int, arena: Arena, batch: Batch) -> None:
        for h, nr, rb, st, a in zip(*_cols(batch), strict=True):
            arena.copy_in(a, host_runs(self.buf, h, nr, rb, st))

    def put(self, node: int, arena: Arena, batch: Batch) -> None:
        for h, nr, rb, st, a in zip(*_cols(batch), strict=True):
            arena.copy_out(a, host_runs(self.buf, h, nr, rb, st))

    def close(self) -> None:
        pass


def _cols(b: Batch):
    return (
        b.host_off.tolist(),
        b.nrows.tolist(),
        b.row_bytes.tolist(),
        b.stride.tolist(),
        b.arena_off.tolist(),
    )
