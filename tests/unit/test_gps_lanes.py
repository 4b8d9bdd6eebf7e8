"""Remote lanes: Batch.split cuts a transfer into stretches of about equal bytes, and
Lanes runs them concurrently (gps/transport.py). Pure Python: the MPI and NIXL paths that
use them are in tests/mpi/test_gps_mpi.py."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivot_hpc.gps import transport
from pivot_hpc.gps.transport import Batch, Lanes


def byte_map(b: Batch) -> dict[int, int]:
    """arena byte -> node-buffer byte, for every byte the batch moves."""
    out: dict[int, int] = {}
    host, arena, length = b.runs(1 << 30)
    for h, a, n in zip(host.tolist(), arena.tolist(), length.tolist(), strict=True):
        for k in range(n):
            assert a + k not in out, "a byte moved twice"
            out[a + k] = h + k
    return out


slices = st.lists(
    st.tuples(
        st.integers(1, 6),  # rows
        st.integers(1, 40),  # row bytes
        st.integers(0, 30),  # gap between rows in the node buffer
    ),
    min_size=1,
    max_size=8,
)


def make_batch(spec: list[tuple[int, int, int]]) -> Batch:
    cols: list[list[int]] = [[], [], [], [], []]
    host = arena = 0
    for nrows, row_bytes, gap in spec:
        stride = row_bytes + gap if nrows > 1 else row_bytes
        for col, v in zip(cols, (host, nrows, row_bytes, stride, arena), strict=True):
            col.append(v)
        host += nrows * stride + 7
        arena += nrows * row_bytes
    return Batch(*(np.array(c, dtype=np.int64) for c in cols))


@settings(max_examples=200, deadline=None)
@given(slices, st.integers(2, 5))
def test_split_moves_every_byte_once_in_about_equal_parts(spec, parts):
    batch = make_batch(spec)
    pieces = batch.split(parts)
    assert 1 <= len(pieces) <= parts
    whole: dict[int, int] = {}
    for p in pieces:
        m = byte_map(p)
        assert not set(m) & set(whole), "two lanes move the same byte"
        whole.update(m)
    assert whole == byte_map(batch)
    # strided slices are cut at whole rows: a part is off by less than a row per cut
    longest_row = int(batch.row_bytes.max())
    for p in pieces:
        assert abs(p.nbytes - batch.nbytes / parts) <= longest_row * parts
    assert batch.split(parts) is pieces  # kept with the (cached) batch


def test_split_of_one_contiguous_slice_is_exact():
    batch = Batch(*(np.array([v], dtype=np.int64) for v in (100, 1, 1000, 1000, 0)))
    pieces = batch.split(3)
    assert [p.nbytes for p in pieces] == [333, 333, 334]
    assert [int(p.host_off[0]) for p in pieces] == [100, 433, 766]
    assert batch.split(1) == [batch]


def test_lanes_run_every_part_first_in_the_caller_and_raise_lane_errors():
    lanes = Lanes(3, "test")
    seen: list[tuple[str, int]] = []
    caller = threading.current_thread().name

    def lane(target, part: Batch) -> None:
        seen.append((threading.current_thread().name, target))

    batch = Batch(*(np.array([v], dtype=np.int64) for v in (0, 1, 3 << 23, 3 << 23, 0)))
    jobs = lanes.plan(batch, ["a", "b", "c", "d"])
    assert [t for t, _ in jobs] == ["a", "b", "c"] and sum(p.nbytes for _, p in jobs) == 3 << 23
    lanes.run(lane, jobs)
    assert sorted(t for _, t in seen) == ["a", "b", "c"]
    assert (caller, "a") in seen and lanes.split_runs == 1

    def failing(target, part: Batch) -> None:
        if target == "c":
            raise RuntimeError("lane c broke")

    with pytest.raises(RuntimeError, match="lane c broke"):
        lanes.run(failing, jobs)
    lanes.close()


def test_small_transfers_and_single_door_nodes_keep_one_lane():
    lanes = Lanes(4, "test")
    small = Batch(*(np.array([v], dtype=np.int64) for v in (0, 1, 1 << 20, 1 << 20, 0)))
    assert len(lanes.plan(small, [1, 2, 3, 4])) == 1  # under MIN_LANE_BYTES per lane
    big = Batch(*(np.array([v], dtype=np.int64) for v in (0, 1, 64 << 20, 64 << 20, 0)))
    assert len(lanes.plan(big, [7])) == 1  # the node has one rank
    assert len(lanes.plan(big, [1, 2, 3, 4, 5])) == 4
    assert transport.MIN_LANE_BYTES * 2 <= 64 << 20
    lanes.close()
