"""Node-local Reads into GPU memory: straight out of the page-locked shared window.

A Read with `device="cuda..."` lands in a preallocated VRAM arena. For the node-local part
`DirectLocalCopy` makes that one DMA per contiguous run, with no host-side staging:

- Page-locking. The shared window is registered with the CUDA driver (`cudaHostRegister`)
  in each process that reads into VRAM, at its first such Read (or `GlobalParameterStorage
  .pin_host_memory()`), and unregistered before the window is freed. A copy out of pinned
  memory is a DMA at PCIe bandwidth and can run asynchronously; out of pageable memory the
  CUDA runtime first copies through its own bounce buffer (an extra memcpy, synchronous).
  Registration is per process and per mapping, so every GPU rank of a node registers the
  same window; the pages are pinned once.
- Copies. Contiguous runs (whole tensors, row blocks of column-parallel shards) are copied
  with `copy_(non_blocking=True)` from a uint8 view of the window into the arena; runs that
  are adjacent in both buffers are merged first, so a TP=1 Read is a handful of DMAs.
  Strided runs (the column slice of a row-parallel tensor, e.g. o_proj/down_proj under TP)
  are either one DMA per row (long rows, far apart) or, when rows are short, one DMA of the
  whole row span into a device scratch buffer followed by a strided gather on the GPU:
  extra PCIe bytes (the span is tp x the slice) are far cheaper than thousands of
  per-row transfers at a few microseconds each. The rule compares the gap between rows
  with what one extra transfer costs (`DMA_OVERHEAD_BYTES`).
- Completion. All copies of one node batch go on the current stream of the arena's device;
  one synchronize at the end, before the Read re-checks that its version was not recycled
  (a copy still in flight would otherwise race the next Write).

Only torch arenas take this path; numpy arenas (the CPU default) keep `LocalCopy`'s plain
copy. Nothing here imports torch or touches CUDA unless a Read asks for a torch device, so
CPU-only runs and host ranks never create a CUDA context.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import time
from typing import Any

import numpy as np

from pivot_hpc.gps.transport import Arena, Batch, LocalCopy

log = logging.getLogger(__name__)

# cudaHostRegisterPortable: pinned for every CUDA context of the process, not only the
# current one (a process that switches devices still gets DMA copies)
HOST_REGISTER_PORTABLE = 1
ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered
# One DMA costs about as much as moving this many bytes (≈ 4 µs at ≈ 50 GB/s): strided rows
# further apart than this go as one transfer each, closer ones as one span + GPU gather.
DMA_OVERHEAD_BYTES = 256 << 10
# Adjacent contiguous runs separated by at most this much padding (64-B alignment of both
# the node layout and the arena) are merged into one copy; the padding bytes travel along.
MERGE_GAP_BYTES = 4096
SCRATCH_BYTES = 64 << 20  # device buffer for span copies of strided runs

# (contiguous copies [n, 3] of (host_off, arena_off, nbytes), strided runs as
# (host_off, nrows, row_bytes, stride, arena_off))
Runs = tuple[np.ndarray, list[tuple[int, int, int, int, int]]]


class HostRegistration:
    """`cudaHostRegister` of one host buffer for this process; `close()` undoes it.

    The range is widened to whole pages (the pages holding the first and last byte are
    mapped in full, so this never leaves the mapping): older CUDA versions want page-aligned
    ranges. Memory that someone else in the process already registered (e.g. a transport
    library) counts as pinned and is left to its owner on close."""

    def __init__(self, buf: np.ndarray, flags: int = HOST_REGISTER_PORTABLE) -> None:
        page = mmap.PAGESIZE
        start = int(buf.ctypes.data)
        self.ptr = start - start % page
        self.nbytes = -(-(start + int(buf.nbytes) - self.ptr) // page) * page
        self.ok = False
        self.owned = False  # registered by us, so unregistered by us
        self.error: str | None = None
        self.seconds = 0.0
        if buf.nbytes == 0:
            self.error = "empty buffer"
            return
        import torch

        rt = torch.cuda.cudart()
        t0 = time.perf_counter()
        err = rt.cudaHostRegister(self.ptr, self.nbytes, flags)
        self.seconds = time.perf_counter() - t0
        code = int(err)
        if code in (0, ALREADY_REGISTERED):
            self.ok, self.owned = True, code == 0
        else:
            self.error = f"cudaHostRegister failed with cudaError {code}: {_error_string(rt, err)}"
            log.warning("GPS: %s; reads into VRAM use staged (pageable) copies", self.error)
        if code != 0:
            # The failed runtime call left a "last error" behind; the next kernel launch
            # check in torch would report it as its own. One throwaway launch consumes it.
            with contextlib.suppress(Exception):
                torch.empty(1, device="cuda").fill_(0)

    def close(self) -> None:
        if not self.owned:
            self.ok = False
            return
        import torch

        torch.cuda.synchronize()  # no DMA may still read the pages being unpinned
        err = torch.cuda.cudart().cudaHostUnregister(self.ptr)
        self.ok = self.owned = False
        if int(err) != 0:
            log.warning("GPS: cudaHostUnregister failed with cudaError %d", int(err))


def _error_string(rt: Any, err: Any) -> str:
    try:
        return str(rt.cudaGetErrorString(err))
    except Exception:  # the binding may not exist in every torch build
        return str(err)


class DirectLocalCopy(LocalCopy):
    """`LocalCopy` whose Reads into torch arenas (VRAM) copy straight out of the window."""

    name = "local"

    def __init__(self, buf: np.ndarray, scratch_bytes: int = SCRATCH_BYTES) -> None:
        super().__init__(buf)
        self.scratch_bytes = scratch_bytes
        self.registration: HostRegistration | None = None
        self._window = None  # torch uint8 view of buf, made on the first torch Read
        # plan_runs per cached Batch (the store caches a plan's batches; the batch object
        # is kept alongside so a recycled id() can never match)
        self._runs: dict[int, tuple[Batch, Runs]] = {}

    def pin(self) -> HostRegistration:
        """Register the window with CUDA (once per process; a failure is remembered and
        reads fall back to staged copies)."""
        if self.registration is None:
            self.registration = HostRegistration(self.buf)
        return self.registration

    def window(self):
        if self._window is None:
            import torch

            self._window = torch.from_numpy(self.buf)
        return self._window

    def get(self, node: int, arena: Arena, batch: Batch) -> None:
        if arena.torch is None:
            super().get(node, arena, batch)
            return
        dst = arena.torch
        if dst.is_cuda:
            self.pin()
        hit = self._runs.get(id(batch))
        if hit is None or hit[0] is not batch:
            hit = self._runs[id(batch)] = (batch, plan_runs(batch))
        copy_runs(self.window(), dst, batch, scratch_bytes=self.scratch_bytes, runs=hit[1])
        if dst.is_cuda:
            import torch

            torch.cuda.current_stream(dst.device).synchronize()

    def close(self) -> None:
        if self.registration is not None:
            self.registration.close()
            self.registration = None
        self._window = None
        self._runs.clear()


def plan_runs(batch: Batch, merge_gap: int = MERGE_GAP_BYTES) -> Runs:
    """Split a batch into merged contiguous copies and strided runs.

    Returns (contig, strided): contig is an int64 [n, 3] array of (host_off, arena_off,
    nbytes); strided holds (host_off, nrows, row_bytes, stride, arena_off) of the runs whose
    rows are not adjacent in the node buffer.

    A merged copy also writes the (alignment) gap between two runs. No run of this batch
    lands there (checked); a run from another node's batch might, in a grouped layout, and
    is written after this one (the store copies its own node's batch first), so it wins."""
    cols = (batch.host_off, batch.nrows, batch.row_bytes, batch.stride, batch.arena_off)
    h, nr, rb, st, a = (np.asarray(c, dtype=np.int64) for c in cols)
    flat = (nr == 1) | (st == rb)
    strided = list(zip(*(x[~flat].tolist() for x in (h, nr, rb, st, a)), strict=True))
    ch, ca, cn = h[flat], a[flat], (nr * rb)[flat]
    if len(ch) == 0:
        return np.zeros((0, 3), dtype=np.int64), strided
    order = np.argsort(ca, kind="stable")
    ch, ca, cn = ch[order], ca[order], cn[order]
    # merge run j into j-1 when both buffers continue after the same (small) gap
    gap_a = ca[1:] - (ca[:-1] + cn[:-1])
    gap_h = ch[1:] - (ch[:-1] + cn[:-1])
    joins = (gap_a == gap_h) & (gap_a >= 0) & (gap_a <= merge_gap)
    # a strided run's destination inside a gap would be overwritten by the merged copy
    if strided and joins.any():
        s_lo = np.array([r[4] for r in strided], dtype=np.int64)
        s_hi = s_lo + np.array([r[1] * r[2] for r in strided], dtype=np.int64)
        gap_lo, gap_hi = (ca[:-1] + cn[:-1]), ca[1:]
        for j in np.nonzero(joins)[0].tolist():
            if np.any((s_lo < gap_hi[j]) & (s_hi > gap_lo[j])):
                joins[j] = False
    starts = np.concatenate([[0], np.nonzero(~joins)[0] + 1])
    ends = np.concatenate([starts[1:], [len(ch)]])
    last = ends - 1
    nbytes = ca[last] + cn[last] - ca[starts]
    return np.stack([ch[starts], ca[starts], nbytes], axis=1), strided


def copy_runs(
    window, dst, batch: Batch, *, scratch_bytes: int = SCRATCH_BYTES, runs: Runs | None = None
) -> None:
    """Copy `batch` from `window` (torch uint8, host) into `dst` (torch uint8, any device).

    Copies are issued with non_blocking=True; on CUDA the caller synchronizes the stream.
    On CPU tensors the same code runs as plain copies (how the CPU tests exercise it).
    `runs` is `plan_runs(batch)` when the caller caches it."""
    contig, strided = runs if runs is not None else plan_runs(batch)
    for h, a, n in contig.tolist():
        dst[a : a + n].copy_(window[h : h + n], non_blocking=True)
    scratch = None
    for h, nr, rb, st, a in strided:
        rows_per_span = (scratch_bytes - rb) // st + 1 if scratch_bytes >= rb else 1
        if st - rb > DMA_OVERHEAD_BYTES or rows_per_span < 2:
            for r in range(nr):
                src = h + r * st
                dst[a + r * rb : a + (r + 1) * rb].copy_(window[src : src + rb], non_blocking=True)
            continue
        if scratch is None:
            scratch = dst.new_empty(min(scratch_bytes, _max_span(strided, scratch_bytes)))
        for r0 in range(0, nr, rows_per_span):
            k = min(rows_per_span, nr - r0)
            span = (k - 1) * st + rb
            src = h + r0 * st
            sc = scratch[:span]
            sc.copy_(window[src : src + span], non_blocking=True)
            # the stream orders this gather after the DMA above and before the next DMA
            # that reuses the scratch buffer
            out = dst[a + r0 * rb : a + (r0 + k) * rb].view(k, rb)
            out.copy_(sc.as_strided((k, rb), (st, 1)))


def _max_span(strided: list[tuple[int, int, int, int, int]], cap: int) -> int:
    return max(min(cap, (nr - 1) * st + rb) for _, nr, rb, st, _ in strided)
