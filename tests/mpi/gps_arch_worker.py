"""MPI program behind tests/mpi/test_gps_architectures_mpi.py:
`mpirun -n 4 python gps_arch_worker.py --group K DIR...`.

Every directory (a tiny random-init model of a real architecture) is registered from its
description (`ModelSpec.from_dir`), loaded from its safetensors tensor by tensor
(`TensorReader`, as runtime/main.py does), read at tp 1, 2 and 4, written from tp 2 and
read again; every shard is compared with the checkpoint's bytes cut by tests/gps_oracle.py.
Any failure raises, which aborts the world. Rank 0 prints "GPS-ARCH-OK" at the end.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

import numpy as np
from mpi4py import MPI

from pivot_hpc.gps import GlobalParameterStorage, GPSConfig, ModelSpec, Parallelism
from pivot_hpc.models.weights import TensorReader
from tests.gps_oracle import checkpoint, expected


def same(got: dict, exp: dict, what: str) -> None:
    if sorted(got) != sorted(exp):
        raise AssertionError(f"{what}: tensor names differ: {sorted(set(got) ^ set(exp))[:5]}")
    for n, e in exp.items():
        if got[n].shape != e.shape or got[n].tobytes() != np.ascontiguousarray(e).tobytes():
            raise AssertionError(f"{what}: {n} differs (shape {got[n].shape} vs {e.shape})")


def run(dirs: list[Path], group: int, world) -> None:
    models = {d.name: ModelSpec.from_dir(d, name=d.name) for d in dirs}
    cfg = GPSConfig(transport="rma", pseudo_node_size=2, group_size=group)
    gps = GlobalParameterStorage(world, cfg, models=models)
    for d in dirs:
        with TensorReader(d) as get:
            gps.load(d.name, get, version=0)
    me, W = world.rank, world.size
    for d in dirs:
        spec, ckpt = models[d.name], checkpoint(d)
        for tp in (1, 2, 4):
            par = Parallelism(tp=tp)
            g = [(tp + j) % W for j in range(tp)]  # rotated over the two pseudo-nodes
            if me in g:
                got, v = gps.read(d.name, g, par)
                assert v == 0, v
                same(got, expected(spec, ckpt, par, g.index(me)), f"{d.name} read tp={tp}")
        world.Barrier()
        wpar, writers = Parallelism(tp=2), [1, 2]
        if me in writers:
            v = gps.write(d.name, writers, wpar, expected(spec, ckpt, wpar, writers.index(me)))
            assert v == 1, v
        world.Barrier()
        par = Parallelism(tp=4)
        got, v = gps.read(d.name, list(range(4)), par)
        assert v == 1, v
        same(got, expected(spec, ckpt, par, me), f"{d.name} read tp=4 after a tp=2 write")
        world.Barrier()
    gps.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("dirs", nargs="+", type=Path)
    p.add_argument("--group", type=int, default=0)
    args = p.parse_args()
    world = MPI.COMM_WORLD
    try:
        run(args.dirs, args.group, world)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        world.Abort(1)
    world.Barrier()
    if world.rank == 0:
        print("GPS-ARCH-OK", flush=True)


if __name__ == "__main__":
    main()
