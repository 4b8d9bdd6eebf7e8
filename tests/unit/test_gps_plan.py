"""GPS planning without MPI: layout, common refinement, greedy assignment, plan cache.

An in-process executor plays the plan's transfers between numpy "node buffers" and
per-rank arenas, so the byte-exactness of Read and the coverage of Write are checked on
every (tp, pp, dp) and group size without starting ranks (tests/mpi does the real thing).
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

from pivot_hpc.gps import PAPER_MODELS, GPSConfig, GPSError, ModelSpec, Parallelism
from pivot_hpc.gps.greedy import _assign_loop, _assign_numba, assign
from pivot_hpc.gps.layout import HostLayout, choose_group_size, max_node_bytes
from pivot_hpc.gps.links import LinkModel
from pivot_hpc.gps.plan import PlanCache, build_read_plan, build_write_plan, check_request
from pivot_hpc.gps.transport import Batch

SPEC = ModelSpec(
    name="t", hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
    intermediate_size=96, vocab_size=103, dtype="float32", tie_word_embeddings=True,
)  # fmt: skip


def full(t) -> np.ndarray:
    rng = np.random.default_rng(zlib.crc32(t.name.encode()))
    return rng.integers(0, 2**32 - 1, t.shape, dtype=np.uint32).view(np.float32)


def host_buffers(layout: HostLayout) -> list[np.ndarray]:
    bufs = []
    for n in range(layout.num_nodes):
        m = layout.member_of(n)
        buf = np.zeros(int(layout.node_bytes[m]), np.uint8)
        for ti, t in enumerate(SPEC.tensors):
            b = layout.bounds["t"][ti]
            blk = np.ascontiguousarray(full(t)[b[m] : b[m + 1]]).view(np.uint8).reshape(-1)
            off = layout.offsets["t"][m, 0, ti]
            buf[off : off + blk.size] = blk
        bufs.append(buf)
    return bufs


def play_read(plan, layout, bufs, i) -> np.ndarray:
    sh = plan.shards[i]
    arena = np.zeros(sh.arena_bytes, np.uint8)
    for j in range(plan.ops(i).start, plan.ops(i).stop):
        t, m, n = plan.op_tensor[j], plan.op_member[j], plan.op_node[j]
        nr, rb, st = plan.op_nrows[j], plan.op_row_bytes[j], plan.op_stride[j]
        src = as_strided(bufs[n][layout.offsets["t"][m, 0, t] + plan.op_host_off[j] :],
                         shape=(nr, rb), strides=(st, 1))  # fmt: skip
        dst = sh.offsets[sh.pos[t]] + plan.op_shard_off[j]
        arena[dst : dst + nr * rb].reshape(nr, rb)[:] = src
    return arena


CASES = [(tp, pp, dp) for tp in (1, 2, 4) for pp in (1, 2) for dp in (1, 2)]


@pytest.mark.parametrize(("nodes", "k"), [(4, 1), (4, 2), (3, 3), (4, 4)])
def test_read_plans_give_exactly_the_sliced_shards(nodes, k):
    layout = HostLayout({"t": SPEC}, {"t"}, nodes, k)
    bufs = host_buffers(layout)
    node_of = np.arange(24) * nodes // 24  # 24 ranks, consecutive ones share a node
    links = LinkModel.from_config(GPSConfig(), nodes)
    for tp, pp, dp in CASES:
        par = Parallelism(tp, pp, dp)
        ranks = tuple(range(1, 1 + par.size))
        plan = build_read_plan("t", SPEC, layout, node_of, ranks, par, links)
        for i in range(par.size):
            arena = play_read(plan, layout, bufs, i)
            sh, (_, _, tpi) = plan.shards[i], par.coords(i)
            for p, ti in enumerate(sh.tensors):
                t = SPEC.tensors[ti]
                r0, r1, c0, c1 = SPEC.shard_box(t, tp, tpi)
                exp = full(t).reshape(t.rows, t.cols)[r0:r1, c0:c1]
                got = arena[sh.offsets[p] : sh.offsets[p] + sh.nbytes[p]]
                assert got.tobytes() == np.ascontiguousarray(exp).tobytes(), (par, i, t.name)


@pytest.mark.parametrize(("nodes", "k"), [(4, 1), (4, 2), (2, 2)])
def test_write_plans_cover_every_replica_byte_exactly_once(nodes, k):
    layout = HostLayout({"t": SPEC}, {"t"}, nodes, k)
    node_of = np.arange(24) * nodes // 24
    links = LinkModel.from_config(GPSConfig(), nodes)
    for tp, pp, dp in CASES:
        par = Parallelism(tp, pp, dp)
        plan = build_write_plan("t", SPEC, layout, node_of, tuple(range(par.size)), par, links)
        cover = [np.zeros(int(layout.node_bytes[layout.member_of(n)]), np.int32) for n in range(nodes)]  # fmt: skip
        for j in range(len(plan.op_node)):
            n, m, t = plan.op_node[j], plan.op_member[j], plan.op_tensor[j]
            off = layout.offsets["t"][m, 0, t] + plan.op_host_off[j]
            for r in range(plan.op_nrows[j]):
                a = off + r * plan.op_stride[j]
                cover[n][a : a + plan.op_row_bytes[j]] += 1
        assert max(int(c.max()) for c in cover) == 1, par
        assert sum(int(c.sum()) for c in cover) == SPEC.nbytes * (nodes // k), par


def test_group_size_is_the_smallest_divisor_that_fits():
    models, w = {"t": SPEC}, {"t"}
    full_copy = max_node_bytes(models, w, 1)
    assert choose_group_size(models, w, 6, full_copy) == 1
    assert choose_group_size(models, w, 6, full_copy - 1) == 2
    assert choose_group_size(models, w, 6, max_node_bytes(models, w, 2) - 1) == 3
    assert choose_group_size(models, w, 5, full_copy - 1) == 5  # only divisors of 5
    with pytest.raises(GPSError, match="does not fit.*host_budget_gib"):
        choose_group_size(models, w, 4, 1000)
    with pytest.raises(GPSError, match="must divide the number of nodes"):
        choose_group_size(models, w, 4, full_copy, forced=3)
    # read-only models take one buffer instead of two
    assert max_node_bytes(models, set(), 1) < full_copy


def test_replication_reads_node_locally_and_sharding_spreads_over_the_group():
    node_of = np.repeat(np.arange(4), 4)
    par, ranks = Parallelism(tp=2, dp=4), tuple(range(16))[::2]
    links = LinkModel.from_config(GPSConfig(), 4)
    rep = build_read_plan("t", SPEC, HostLayout({"t": SPEC}, {"t"}, 4, 1), node_of, ranks, par, links)  # fmt: skip
    recv_node = np.repeat(node_of[list(ranks)], np.diff(rep.actor_ptr))
    assert np.array_equal(rep.op_node, recv_node)
    shard = build_read_plan("t", SPEC, HostLayout({"t": SPEC}, {"t"}, 4, 2), node_of, ranks, par, links)  # fmt: skip
    assert (shard.sender_bytes > 0).all()


def _skew(model: str) -> np.ndarray:
    # one receiver on node 0 reads 3 replicas; node 0's own link is useless, 1 -> 0 is 4x 2 -> 0
    cfg = GPSConfig(cost_model=model, link_bandwidth_gbps={"0->0": 1e-6, "1->0": 8.0, "2->0": 2.0})
    layout = HostLayout({"t": SPEC}, {"t"}, 3, 1)
    plan = build_read_plan(
        "t", SPEC, layout, np.array([0, 1, 2]), (0,), Parallelism(), LinkModel.from_config(cfg, 3)
    )
    return plan.sender_bytes


def test_greedy_gives_the_fast_holder_more_bytes():
    paper = _skew("sender")  # one latency per sender: bytes split ~ bandwidth (4:1)
    assert paper[0] == 0 and paper[1] > 2 * paper[2] > 0
    endpoints = _skew("endpoints")  # both share the receiver's NIC: the fast one wins
    assert endpoints[0] == 0 and endpoints[1] > endpoints[2]


def test_greedy_balances_equal_senders_and_compiled_matches_python():
    rng = np.random.default_rng(1)
    n, nodes = 3000, 4
    args = dict(
        nbytes=rng.integers(1, 1 << 20, n).astype(np.float64),
        dem_node=rng.integers(0, nodes, n),
        dem_gpu=rng.integers(0, 8, n),
        cset=rng.integers(0, 2, n),
        cand_ptr=np.array([0, 2, 4]),
        cand_id=np.array([0, 2, 1, 3]),
        cand_node=np.array([0, 2, 1, 3]),
        bandwidth=np.full((nodes, nodes), 1e10),
        overhead=np.full((nodes, nodes), 1e-5),
        num_senders=nodes,
        num_gpus=8,
        read=True,
        model="sender",
    )
    _, busy = assign(**args)
    assert busy.max() / busy.min() < 1.05  # equal links: equal load
    for model in (0, 1):
        a = [np.asarray(v) for v in list(args.values())[:7]]
        tail = [args["bandwidth"], args["overhead"]]
        py = _assign_loop(*a, True, model, *tail, *(np.zeros(k) for k in (4, 4, 8, 4, 4)))
        nb = _assign_numba(*a, True, model, *tail, *(np.zeros(k) for k in (4, 4, 8, 4, 4)))
        assert np.array_equal(py, nb)


def test_plan_cache_hits_on_the_same_signature():
    cache, calls = PlanCache(), []

    def build():
        calls.append(1)
        return object()

    key = ("read", "t", (0, 1), Parallelism(tp=2))
    first = cache.get(key, build)
    assert cache.get(("read", "t", (0, 1), Parallelism(tp=2)), build) is first
    assert (cache.hits, cache.misses, len(calls)) == (1, 1, 1)


def test_requests_are_validated_before_planning():
    spec = PAPER_MODELS["tiny-qwen2"]
    with pytest.raises(GPSError, match="not in the world"):
        check_request("m", spec, [0, 9], Parallelism(tp=2), 8)
    with pytest.raises(GPSError, match="lists a rank twice"):
        check_request("m", spec, [1, 1], Parallelism(tp=2), 8)
    with pytest.raises(GPSError, match="tp\\*pp\\*dp = 4"):
        check_request("m", spec, [0, 1], Parallelism(tp=2, dp=2), 8)
    with pytest.raises(GPSError, match="num_attention_heads=4 is not divisible by tp=8"):
        check_request("m", spec, range(8), Parallelism(tp=8), 8)


def test_batch_runs_flatten_strided_slices_and_cap_their_size():
    b = Batch(*(np.array(v) for v in ([100, 0], [3, 1], [4, 10], [16, 10], [0, 12])))
    host, arena, length = b.runs(max_bytes=6)
    assert host.tolist() == [100, 116, 132, 0, 6]
    assert arena.tolist() == [0, 4, 8, 12, 18]
    assert length.tolist() == [4, 4, 4, 6, 4]


def test_72b_plan_on_128_gpus_is_fast_enough_to_build():
    m = PAPER_MODELS["qwen2.5-72b"]
    node_of = np.repeat(np.arange(16), 9)
    ranks = tuple(r for r in range(144) if r % 9)
    layout = HostLayout({"p": m}, {"p"}, 16, 1)
    plan = build_read_plan("p", m, layout, node_of, ranks, Parallelism(tp=8, dp=16),
                           LinkModel.from_config(GPSConfig(), 16))  # fmt: skip
    per_replica = sum(sum(s.nbytes) for s in plan.shards[:8])  # one DP replica's 8 ranks
    assert per_replica >= m.nbytes and plan.nbytes == 16 * per_replica
    assert plan.planning_s < 30
