"""MPI program behind tests/mpi/test_gps_mpi.py: `mpirun -n W python gps_worker.py SCENARIO…`.

Every check compares bytes against slices of deterministic full tensors; any failure
raises, which aborts the whole world (non-zero exit). Rank 0 prints "GPS-OK <scenario>"
at the end of each scenario that passed.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
import zlib

import numpy as np
from mpi4py import MPI

from pivot_hpc.gps import (
    GlobalParameterStorage,
    GPSConfig,
    GPSError,
    ModelSpec,
    Parallelism,
    transport,
)
from pivot_hpc.gps.catalog import NUMPY_DTYPE

MODELS = {
    # writable policy: Qwen2-style (q/k/v biases), bf16, untied, vocab not divisible by tp
    "policy": ModelSpec(
        name="policy", hidden_size=64, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, intermediate_size=96, vocab_size=103, dtype="bfloat16",
    ),
    # read-only GenRM: Llama-style, float32, tied embeddings
    "genrm": ModelSpec(
        name="genrm", hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, intermediate_size=64, vocab_size=50, dtype="float32",
        tie_word_embeddings=True, attention_bias=False,
    ),
}  # fmt: skip
BIG = ModelSpec(  # a few MB, so that reads and writes overlap in the concurrency test
    name="big", hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=2, intermediate_size=512, vocab_size=1000, dtype="float32",
)  # fmt: skip

_BASE: dict[tuple[str, str], np.ndarray] = {}


def full(spec: ModelSpec, name: str, version: int = 0) -> np.ndarray:
    """Deterministic content of a full tensor at a version, as raw bit patterns."""
    t = spec.tensors[spec.index[name]]
    key = (spec.name, name)
    if key not in _BASE:
        rng = np.random.default_rng(zlib.crc32(f"{spec.name}/{name}".encode()))
        dt = NUMPY_DTYPE[t.dtype]
        bits = np.uint16 if np.dtype(dt).itemsize == 2 else np.uint32
        _BASE[key] = rng.integers(0, np.iinfo(bits).max, t.shape, dtype=bits)
    base = _BASE[key]
    return (base + base.dtype.type(version)).view(NUMPY_DTYPE[t.dtype])


def expected(spec: ModelSpec, par: Parallelism, index: int, version: int = 0) -> dict:
    _, pp, tp = par.coords(index)
    out = {}
    for ti in spec.stage_tensors(par.pp, pp):
        t = spec.tensors[ti]
        r0, r1, c0, c1 = spec.shard_box(t, par.tp, tp)
        f = full(spec, t.name, version).reshape(t.rows, t.cols)[r0:r1, c0:c1]
        out[t.name] = np.ascontiguousarray(f).reshape(spec.shard_shape(t, par.tp, tp))
    return out


def same_bytes(got: dict, exp: dict, what: str) -> None:
    if sorted(got) != sorted(exp):
        raise AssertionError(f"{what}: tensor names differ: {sorted(set(got) ^ set(exp))[:5]}")
    for n, e in exp.items():
        g = got[n]
        if g.shape != e.shape or g.tobytes() != e.tobytes():
            raise AssertionError(f"{what}: {n} differs (shape {g.shape} vs {e.shape})")


def combos(world: int):
    for tp in (1, 2, 4):
        for pp in (1, 2):
            for dp in (1, 2):
                if tp * pp * dp <= world:
                    yield Parallelism(tp=tp, pp=pp, dp=dp)


CREATED: list[GlobalParameterStorage] = []  # of the running scenario (lane counts)


def make_gps(args, models=MODELS, **kw) -> GlobalParameterStorage:
    cfg = GPSConfig(
        transport=args.transport,
        pseudo_node_size=args.pseudo,
        group_size=args.group,
        host_budget_gib=args.budget_gib,
        remote_lanes=args.lanes,
        **kw,
    )
    ro = [m for m in models if m == "genrm"]
    gps = GlobalParameterStorage(MPI.COMM_WORLD, cfg, models=models, read_only=ro)
    CREATED.append(gps)
    return gps


def load_all(gps, models=MODELS) -> None:
    for name, spec in models.items():
        gps.load(name, lambda n, spec=spec: full(spec, n, 0), version=0)


def sc_read_matrix(args, world) -> None:
    """Read under every (tp, pp, dp) that fits, G rotated over the nodes; cache on re-read."""
    gps = make_gps(args)
    load_all(gps)
    W, me = world.size, world.rank
    for c, par in enumerate(combos(W)):
        g = [(c + j) % W for j in range(par.size)]
        if me not in g:
            continue
        for name, spec in MODELS.items():
            exp = expected(spec, par, g.index(me))
            hits = gps.plans.hits
            got, v = gps.read(name, g, par)
            same_bytes(got, exp, f"read {name} {par} G={g}")
            assert v == 0, v
            again, _ = gps.read(name, g, par)
            assert gps.plans.hits == hits + 1, "second identical Read must hit the plan cache"
            same_bytes(again, exp, f"re-read {name} {par}")
    if me == 0:
        print(f"layout k={gps.layout.k} nodes={gps.nodes.num_nodes} via {gps.transport_name}")
        print(f"layouts read: {len(list(combos(W)))}")
    gps.close()


def sc_roundtrip(args, world) -> None:
    """Write from TP=2/PP=2, Read back at TP=1 elsewhere; every replica holds the new bytes."""
    gps = make_gps(args)
    load_all(gps)
    W, me = world.size, world.rank
    spec = MODELS["policy"]
    wpar = Parallelism(tp=2, pp=2, dp=1)
    writers = list(range(W - 4, W))  # the last four ranks write
    if me in writers:
        v = gps.write("policy", writers, wpar, expected(spec, wpar, writers.index(me), 1))
        assert v == 1, v
    world.Barrier()
    assert gps.version("policy") == 1, f"rank {me}: version {gps.version('policy')}, expected 1"
    if me == 0:  # reader outside the writers' layout
        got, v = gps.read("policy", [0], Parallelism())
        assert v == 1, f"TP=1 read returned version {v}, expected 1"
        same_bytes(got, expected(spec, Parallelism(), 0, 1), "TP=1 read after TP2/PP2 write")
    if gps.nodes.is_host:  # every replica (or group member) holds its block of version 1
        lay, m = gps.layout, gps.member
        for ti, t in enumerate(spec.tensors):
            b = lay.bounds["policy"][ti]
            blk = full(spec, t.name, 1)[b[m] : b[m + 1]]
            if gps.host_shard("policy", t.name).tobytes() != np.ascontiguousarray(blk).tobytes():
                raise AssertionError(f"node {gps.nodes.node}: {t.name} missing version 1")
    # a barrier only stops ranks leaving before all have entered: without this one a
    # rank descheduled after the barrier above could already see Write 2's version
    world.Barrier()
    # a second write, from a DP=2 x TP=2 layout (replicas share the load), then TP=4 read
    wpar2 = Parallelism(tp=2, pp=1, dp=2)
    if me in writers:
        v = gps.write("policy", writers, wpar2, expected(spec, wpar2, writers.index(me), 2))
        assert v == 2, f"second write returned version {v}, expected 2"
    world.Barrier()
    readers = [(j + 1) % W for j in range(4)]
    if me in readers:
        par = Parallelism(tp=4)
        got, v = gps.read("policy", readers, par)
        assert v == 2, f"rank {me}: TP=4 read returned version {v}, expected 2"
        same_bytes(got, expected(spec, par, readers.index(me), 2), "TP=4 read of version 2")
    # bad input: every writer fails cleanly, nothing is published
    if me in writers:
        bad = expected(spec, wpar, writers.index(me), 3)
        if writers.index(me) == 1:
            bad.pop(next(iter(bad)))
        try:
            gps.write("policy", writers, wpar, bad)
        except GPSError as exc:
            assert "aborted before any transfer" in str(exc), exc
        else:
            raise AssertionError("a write with a missing shard must fail on every writer")
    world.Barrier()
    assert gps.version("policy") == 2, (
        f"rank {me}: version {gps.version('policy')} after a failed write, expected 2"
    )
    gps.close()


def sc_concurrent(args, world) -> None:
    """Reads racing writes always return one whole version."""
    models = {"big": BIG}
    gps = make_gps(args, models=models)
    gps.load("big", lambda n: full(BIG, n, 0), 0)
    me = world.rank
    writers, par_w = [0, 1], Parallelism(tp=2)
    final = args.versions
    seen: set[int] = set()
    if me in writers:
        for v in range(1, final + 1):
            got = gps.write("big", writers, par_w, expected(BIG, par_w, writers.index(me), v))
            assert got == v, f"write of version {v} returned {got}"
    else:
        par = Parallelism(tp=1)
        cache: dict[int, dict] = {}
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            got, v = gps.read("big", [me], par)
            if v not in cache:
                cache = {v: expected(BIG, par, 0, v)}  # keep one version's expectation
            same_bytes(got, cache[v], f"concurrent read (version {v})")
            seen.add(v)
            if v == final:
                break
        assert final in seen, f"never saw the final version; saw {sorted(seen)}"
    allseen = world.gather((sorted(seen), gps.read_retries), root=0)
    if me == 0:
        print("versions seen / retries of readers:", allseen[2:])
    gps.close()


def sc_recycle(args, world) -> None:
    """Deterministic seqlock check: two Writes land while a Read is copying; it retries.

    Rank 3 reads; inside its first copy (node-local, full replication) it lets writers
    0 and 1 publish versions 1 and 2 (the second recycles the slot being copied) before
    the copy returns. The Read must notice, retry, and return version 2 whole.
    """
    models = {"big": BIG}
    gps = make_gps(args, models=models)
    gps.load("big", lambda n: full(BIG, n, 0), 0)
    me, writers, par_w, reader = world.rank, [0, 1], Parallelism(tp=2), 3
    if me in writers:
        world.recv(source=reader, tag=11)
        for v in (1, 2):
            gps.write("big", writers, par_w, expected(BIG, par_w, writers.index(me), v))
        world.send("done", dest=reader, tag=12)
    elif me == reader:
        copy = gps.local.get
        calls = []

        def slow_copy(node, arena, batch):
            copy(node, arena, batch)
            if not calls:
                calls.append(1)
                for w in writers:
                    world.send("go", dest=w, tag=11)
                for w in writers:
                    world.recv(source=w, tag=12)

        gps.local.get = slow_copy
        got, v = gps.read("big", [me], Parallelism())
        assert gps.read_retries == 1, gps.read_retries
        assert v == 2, v
        same_bytes(got, expected(BIG, Parallelism(), 0, 2), "read retried after slot recycle")
    gps.close()


def sc_parity(args, world) -> None:
    """Writes whose explicit version keeps the published version's parity (as elastic
    training publishes optimizer state) must not touch the slot readers are using.

    1. Deterministic: rank 3's first copy of version 0 lets writers 0 and 1 publish
       version 2 (same parity) before the copy returns. The Read must return version 0
       whole without a retry: Write 2 went to the other slot.
    2. Stress: the writers publish 4, 6, 8, ... back to back while every other rank
       reads in a loop. No Read may fail (GPSError after gps.read_retries) and every
       Read's bytes must be exactly the version it reports (a torn or mislabelled read
       differs from `expected(..., v)`).
    """
    models = {"big": BIG}
    gps = make_gps(args, models=models)
    gps.load("big", lambda n: full(BIG, n, 0), 0)
    me, writers, par_w, reader = world.rank, [0, 1], Parallelism(tp=2), 3
    mine = writers.index(me) if me in writers else -1

    # ---- 1. one same-parity Write lands inside a Read's copy
    if me in writers:
        world.recv(source=reader, tag=21)
        got = gps.write("big", writers, par_w, expected(BIG, par_w, mine, 2), version=2)
        assert got == 2, f"write at version=2 returned {got}"
        world.send("done", dest=reader, tag=22)
    elif me == reader:
        copy = gps.local.get
        calls: list[int] = []

        def slow_copy(node, arena, batch):
            copy(node, arena, batch)
            if not calls:
                calls.append(1)
                for w in writers:
                    world.send("go", dest=w, tag=21)
                for w in writers:
                    world.recv(source=w, tag=22)

        gps.local.get = slow_copy
        try:
            got, v = gps.read("big", [me], Parallelism())
        finally:
            gps.local.get = copy
        assert calls, "the read never copied node-local bytes"
        assert (v, gps.read_retries) == (0, 0), (
            f"read during a same-parity write returned version {v} after "
            f"{gps.read_retries} retries; expected version 0 with no retry"
        )
        same_bytes(got, expected(BIG, Parallelism(), 0, 0), "read of v0 during write of v2")
    world.Barrier()
    assert gps.version("big") == 2, f"rank {me}: version {gps.version('big')}, expected 2"

    # ---- 2. same-parity Writes back to back while everyone else reads
    final = 2 + 2 * args.versions
    failed: list[str] = []
    torn: list[int] = []
    seen: set[int] = set()
    reads = 0
    if me in writers:
        for v in range(4, final + 1, 2):
            got = gps.write("big", writers, par_w, expected(BIG, par_w, mine, v), version=v)
            assert got == v, f"write at version={v} returned {got}"
    else:
        par = Parallelism(tp=1)
        arena = gps.make_arena("big", [me], par)  # reused: reads overlap writes more often
        cache: dict[int, dict] = {}
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                got, v = gps.read("big", [me], par, arena=arena)
            except GPSError as exc:
                failed.append(str(exc))
                break
            reads += 1
            if v not in cache:
                cache = {v: expected(BIG, par, 0, v)}  # keep one version's expectation
            try:
                same_bytes(got, cache[v], f"read reporting version {v}")
            except AssertionError:
                torn.append(v)
            seen.add(v)
            if v == final:
                break
    res = world.gather((me, reads, sorted(seen), gps.read_retries, failed, torn), root=0)
    if me == 0:
        readers = [r for r in res if r[0] not in writers]
        print("parity readers (rank, reads, versions seen, retries, failed, torn):", readers)
        bad = [r for r in readers if r[4] or r[5] or final not in r[2]]
        assert not bad, f"failed/torn reads or final version {final} never seen: {bad}"
    world.Barrier()
    gps.close()


def sc_errors(args, world) -> None:
    """Bad requests fail with clear errors before any transfer; over-budget layouts too."""
    gps = make_gps(args)
    load_all(gps)
    W = world.size
    checks = [
        (lambda: gps.read("policy", [0, 1, 2], Parallelism(tp=3)), "num_attention_heads=8"),
        (lambda: gps.read("policy", [0, W + 5], Parallelism(tp=2)), "not in the world"),
        (lambda: gps.read("policy", [0, 1], Parallelism(tp=1)), "tp*pp*dp = 1"),
        (lambda: gps.read("nope", [0], Parallelism()), "unknown model"),
        (lambda: gps.read("policy", [0], Parallelism(pp=5)), "exceeds num_hidden_layers"),
        (lambda: gps.write("genrm", [0], Parallelism(), {}), "read-only"),
    ]
    try:  # collective: the hosts see a wrong shape, every rank gets the error
        gps.load("policy", lambda n: np.zeros(3, np.uint16), version=0)
    except GPSError as exc:
        assert "load of 'policy' failed" in str(exc) and "expected" in str(exc), exc
    else:
        raise AssertionError("load with wrong shapes must fail on every rank")
    for fn, text in checks:
        try:
            fn()
        except GPSError as exc:
            assert text in str(exc), (text, str(exc))
        else:
            raise AssertionError(f"expected a GPSError mentioning {text!r}")
    gps.close()
    try:
        make_gps(argparse.Namespace(**{**vars(args), "budget_gib": 1e-6, "group": 0}))
    except GPSError as exc:
        assert "does not fit" in str(exc) and "host_budget_gib" in str(exc), exc
    else:
        raise AssertionError("an over-budget layout must fail")


def sc_torch(args, world) -> None:
    """Torch in and out: bf16 shards written as torch tensors, read back on device='cpu'."""
    gps = make_gps(args)
    load_all(gps)
    me, spec = world.rank, MODELS["policy"]
    writers, par = [0, 1], Parallelism(tp=2)
    if me in writers:
        import torch

        mine = expected(spec, par, writers.index(me), 5)
        as_torch = {n: torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) for n, a in mine.items()}  # fmt: skip
        assert gps.write("policy", writers, par, as_torch) == 1
        got, v = gps.read("policy", writers, par, device="cpu")
        assert v == 1 and all(t.dtype == torch.bfloat16 for t in got.values())
        back = {n: t.view(torch.int16).numpy().view(np.uint16) for n, t in got.items()}
        same_bytes(back, mine, "torch bf16 round trip")
    gps.close()


SCENARIOS = {
    "read_matrix": sc_read_matrix,
    "roundtrip": sc_roundtrip,
    "concurrent": sc_concurrent,
    "errors": sc_errors,
    "recycle": sc_recycle,
    "parity": sc_parity,
    "torch": sc_torch,
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("scenarios", nargs="+", choices=sorted(SCENARIOS))
    p.add_argument("--pseudo", type=int, default=0)
    p.add_argument("--group", type=int, default=0)
    p.add_argument("--budget-gib", type=float, default=0.0)
    p.add_argument("--transport", default="rma")
    p.add_argument("--versions", type=int, default=6)
    p.add_argument("--lanes", type=int, default=GPSConfig.remote_lanes)
    # below this many bytes per lane a transfer keeps one lane; tiny test models need 1
    p.add_argument("--min-lane-bytes", type=int, default=transport.MIN_LANE_BYTES)
    args = p.parse_args()
    transport.MIN_LANE_BYTES = args.min_lane_bytes
    world = MPI.COMM_WORLD
    for name in args.scenarios:
        CREATED.clear()
        try:
            SCENARIOS[name](args, world)
            splits = world.allreduce(sum(g.remote.lanes.split_runs for g in CREATED))
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            world.Abort(1)
        world.Barrier()
        if world.rank == 0:
            print(f"GPS-OK {name} (remote transfers split over lanes: {splits})", flush=True)


if __name__ == "__main__":
    main()
