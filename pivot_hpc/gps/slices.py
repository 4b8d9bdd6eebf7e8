"""Common refinement of host slices and target slices into atomic slices (App. B.2, step 1).

Both sides cut a tensor into axis-aligned boxes of its 2-D canonical form: the host side
into member row blocks [b_m, b_m+1) x all columns (layout.py), the target side into its
TP box (r0, r1, c0, c1) (column/vocab rules cut rows, row rules cut columns; a fused
tensor's shard is one box per part, back to back, each at its `base` in the shard). Their
intersections are the atomic slices: each lies inside exactly one host block and one
target shard, so a transfer always moves a whole atomic slice and nothing is split or
concatenated in flight.

An atomic slice, seen as bytes, is `nrows` runs of `row_bytes`, `stride` apart inside the
host member block (strided when a row rule cuts columns) and packed back to back inside
the target shard (target shards are row-major and own whole rows of the slice). A slice
whose rows are contiguous on both sides is collapsed to a single run.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FIELDS = ("tensor", "member", "host_off", "nrows", "row_bytes", "stride", "shard_off", "box")


@dataclass
class Pieces:
    """Struct of arrays, one entry per atomic slice (all int64).

    tensor: catalog index; member: host member block holding it; host_off: byte offset
    inside that member block; nrows/row_bytes/stride: the run shape on the host side;
    shard_off: byte offset inside the target shard (contiguous there); box: which of the
    refined target boxes it came from.
    """

    tensor: np.ndarray
    member: np.ndarray
    host_off: np.ndarray
    nrows: np.ndarray
    row_bytes: np.ndarray
    stride: np.ndarray
    shard_off: np.ndarray
    box: np.ndarray

    def __len__(self) -> int:
        return len(self.tensor)

    @property
    def nbytes(self) -> np.ndarray:
        return self.nrows * self.row_bytes

    def take(self, idx: np.ndarray) -> Pieces:
        return Pieces(*(getattr(self, f)[idx] for f in FIELDS))

    @staticmethod
    def concat(parts: list[Pieces]) -> Pieces:
        if not parts:
            return Pieces(*(np.zeros(0, np.int64) for _ in FIELDS))
        return Pieces(*(np.concatenate([getattr(p, f) for p in parts]) for f in FIELDS))


def refine(
    tensor: np.ndarray,
    cols_bytes: np.ndarray,
    itemsize: np.ndarray,
    bounds: np.ndarray,
    boxes: np.ndarray,
    base: np.ndarray | None = None,
) -> Pieces:
    """Atomic slices of a set of target boxes against the host member blocks.

    tensor[i]: catalog index of box i; cols_bytes[i]: bytes of one full row of that
    tensor; itemsize[i]: element bytes; bounds[i]: its k+1 member row bounds; boxes[i]:
    its target box (r0, r1, c0, c1) in elements; base[i]: its byte offset inside the
    tensor's target shard (a fused tensor's shard is several boxes back to back; 0 when
    omitted).
    """
    r0, r1, c0, c1 = (boxes[:, j][:, None] for j in range(4))
    lo, hi = bounds[:, :-1], bounds[:, 1:]  # [n, k]
    a = np.maximum(r0, lo)
    e = np.minimum(r1, hi)
    box_i, member = np.nonzero(e > a)
    a, e, lo = a[box_i, member], e[box_i, member], lo[box_i, member]
    es, full = itemsize[box_i], cols_bytes[box_i]
    bc0, bc1, br0 = c0[box_i, 0], c1[box_i, 0], r0[box_i, 0]
    row_bytes = (bc1 - bc0) * es
    nrows = e - a
    host_off = (a - lo) * full + bc0 * es
    shard_off = (a - br0) * row_bytes
    if base is not None:
        shard_off = shard_off + base[box_i]
    stride = full.copy()
    whole = row_bytes == full  # full rows: one contiguous run on both sides
    row_bytes = np.where(whole, nrows * row_bytes, row_bytes)
    stride = np.where(whole, row_bytes, stride)
    nrows = np.where(whole, 1, nrows)
    return Pieces(
        tensor[box_i].astype(np.int64),
        member.astype(np.int64),
        host_off.astype(np.int64),
        nrows.astype(np.int64),
        row_bytes.astype(np.int64),
        stride.astype(np.int64),
        shard_off.astype(np.int64),
        box_i.astype(np.int64),
    )
