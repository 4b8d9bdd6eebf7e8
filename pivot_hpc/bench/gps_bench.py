"""`pivot-hpc bench gps`: GPS Read throughput against memcpy, and planning time.

From a plain shell it starts `mpirun -n RANKS` on itself (pseudo-nodes of 2 ranks: node 0 =
ranks 0-1, node 1 = ranks 2-3). Rank 1 (a worker of node 0) then times, for a model of at
least `--mib` MiB, best of `--repeat`:
- memcpy: numpy copy of the same bytes from the node's shared window into the same
  destination buffer (the baseline, same run, same process);
- local: Read(M, [1], TP=1) served by its own node (copy out of the shared window);
- remote: the same Read with the planner's node 0 -> node 0 link made slow, so every
  slice comes from node 1: MPI RMA, and NIXL when installed, each with the default
  gps.remote_lanes (two threads, each reading through a different rank of node 1) and
  with one lane.
Ratios are Read throughput / memcpy throughput (one thread). `remote_ratio` is the
default remote transport on this machine (gps.transport=auto: rma without a GPU). Planning time is measured in the launching
process (no MPI): the Read plan of a 72B model on 128 GPUs (16 nodes x 8 GPUs, TP=8,
DP=16), first build and cached lookup. `--profile-links` measures the bandwidth and
per-transfer overhead the planner's cost model uses and prints them as a `gps:` YAML
snippet (also written to `--profile-out`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time

import numpy as np

from pivot_hpc import interpreter
from pivot_hpc.bench.stats import table

MARK = "GPS-BENCH "


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mib", type=int, default=256, help="model size to read, MiB (>= 256)")
    p.add_argument("--repeat", type=int, default=5, help="timed reads per case (best counts)")
    p.add_argument("--ranks", type=int, default=4, help="MPI ranks when launching mpirun")
    p.add_argument("--no-nixl", action="store_true", help="skip the NIXL case")
    p.add_argument("--plan-model", default="qwen2.5-72b", help="catalog model for planning")
    p.add_argument("--plan-gpus", type=int, default=128, help="GPUs for the planning time")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--plan-tp", type=int, default=8)
    p.add_argument("--profile-links", action="store_true", help="measure link bandwidths")
    p.add_argument("--profile-out", default=None, help="write the profiled gps: YAML here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)


def bench_model(mib: int):
    from pivot_hpc.gps.catalog import ModelSpec

    base = dict(
        hidden_size=2048, num_attention_heads=16, num_key_value_heads=4,
        intermediate_size=5632, vocab_size=32000, tie_word_embeddings=True, name="bench",
    )  # fmt: skip
    one = ModelSpec(num_hidden_layers=1, **base)
    two = ModelSpec(num_hidden_layers=2, **base)
    per_layer = two.nbytes - one.nbytes
    layers = max(1, math.ceil((mib * 2**20 - (one.nbytes - per_layer)) / per_layer))
    return ModelSpec(num_hidden_layers=layers, **base)


def run(args: argparse.Namespace) -> dict:
    if args.worker or "OMPI_COMM_WORLD_SIZE" in os.environ or "PMI_SIZE" in os.environ:
        return _worker(args)
    out = _launch(args)
    out.update(_planning(args))
    if not args.json:
        _print(out)
    return out


# ---- launcher ---------------------------------------------------------------------------
def _launch(args: argparse.Namespace) -> dict:
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise SystemExit("pivot-hpc bench gps: mpirun not found (apt-get install openmpi-bin)")
    if args.ranks < 4:
        raise SystemExit("pivot-hpc bench gps: --ranks must be >= 4 (two pseudo-nodes of 2)")
    cmd = [mpirun, "-n", str(args.ranks)]
    if "Open MPI" in subprocess.run([mpirun, "--version"], capture_output=True, text=True).stdout:
        cmd += ["--oversubscribe"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])
    cmd += interpreter.python("-m", "pivot_hpc.bench.gps_bench", "--worker")
    cmd += ["--mib", str(args.mib), "--repeat", str(args.repeat)]
    cmd += ["--no-nixl"] * args.no_nixl + ["--profile-links"] * args.profile_links
    env = interpreter.environ()
    env.setdefault("OMPI_MCA_osc", "^ucx")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith(MARK)]
    if p.returncode != 0 or not lines:
        raise SystemExit(f"gps bench failed (rc={p.returncode}):\n{(p.stdout + p.stderr)[-4000:]}")
    out = json.loads(lines[-1][len(MARK) :])
    if args.profile_links and args.profile_out:
        with open(args.profile_out, "w") as f:
            f.write(out["profile_yaml"])
    return out


def _planning(args: argparse.Namespace) -> dict:
    from pivot_hpc.gps.catalog import PAPER_MODELS, Parallelism
    from pivot_hpc.gps.config import GPSConfig
    from pivot_hpc.gps.layout import HostLayout
    from pivot_hpc.gps.links import LinkModel
    from pivot_hpc.gps.plan import PlanCache, build_read_plan

    spec = PAPER_MODELS[args.plan_model]
    per = args.gpus_per_node
    nodes = args.plan_gpus // per
    # world = per node one host rank + `per` workers; G = all workers
    node_of = np.repeat(np.arange(nodes), per + 1)
    ranks = tuple(r for r in range(nodes * (per + 1)) if r % (per + 1))
    par = Parallelism(tp=args.plan_tp, dp=len(ranks) // args.plan_tp)
    layout = HostLayout({"policy": spec}, {"policy"}, nodes, 1)
    links = LinkModel.from_config(GPSConfig(), nodes)
    small = Parallelism(tp=args.plan_tp, dp=per // args.plan_tp)  # warm-up: loads numba
    build_read_plan("policy", spec, layout, node_of, ranks[:per], small, links)
    cache = PlanCache()
    key = ("read", "policy", ranks, par)
    t0 = time.perf_counter()
    plan = cache.get(key, lambda: build_read_plan("policy", spec, layout, node_of, ranks, par, links))  # fmt: skip
    first = time.perf_counter() - t0
    hits = []
    for _ in range(1000):
        t0 = time.perf_counter()
        cache.get(key, lambda: None)
        hits.append(time.perf_counter() - t0)
    return {
        "plan_model": args.plan_model,
        "plan_gpus": len(ranks),
        "plan_parallelism": [par.tp, par.pp, par.dp],
        "plan_demands": plan.demands,
        "plan_s": round(first, 4),
        "plan_cached_us": round(float(np.median(hits)) * 1e6, 3),
        "plan_local_fraction": round(float(_local_fraction(plan, node_of)), 4),
    }


def _local_fraction(plan, node_of) -> float:
    recv_node = np.repeat(node_of[np.array(plan.ranks)], np.diff(plan.actor_ptr))
    nbytes = plan.op_nrows * plan.op_row_bytes
    return nbytes[plan.op_node == recv_node].sum() / max(1, nbytes.sum())


def _print(out: dict) -> None:
    gb = out["bytes"] / 1e9
    rows = [["case", "GB/s", "ratio to memcpy"]]
    rows.append(["memcpy", f"{out['memcpy_gbps']:.2f}", "1.00"])
    rows.append(["local read", f"{out['local_gbps']:.2f}", f"{out['local_ratio']:.2f}"])
    for t, label in (
        ("rma", f"remote rma ({out['remote_lanes']} lanes)"),
        ("rma_1lane", "remote rma (1 lane)"),
        ("nixl", f"remote nixl ({out['remote_lanes']} lanes)"),
        ("nixl_1lane", "remote nixl (1 lane)"),
    ):
        if f"remote_{t}_gbps" in out:
            rows.append(
                [label, f"{out[f'remote_{t}_gbps']:.2f}", f"{out[f'remote_ratio_{t}']:.2f}"]
            )
    print(f"GPS Read of {gb:.3f} GB ({out['tensors']} tensors), best of {out['repeat']}")
    print(table(rows))
    print(
        f"planning {out['plan_model']} on {out['plan_gpus']} GPUs (tp,pp,dp="
        f"{out['plan_parallelism']}): {out['plan_s'] * 1e3:.1f} ms first, "
        f"{out['plan_cached_us']:.2f} us cached; {out['plan_demands']} demands, "
        f"{out['plan_local_fraction']:.0%} of bytes node-local"
    )
    if "profile_yaml" in out:
        print(out["profile_yaml"], end="")


# ---- MPI worker --------------------------------------------------------------------------
def _quiet_barrier(comm) -> None:
    """A barrier that sleeps instead of spinning (idle ranks must not steal the 2 cores)."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.002)


def _worker(args: argparse.Namespace) -> dict:
    from mpi4py import MPI

    try:
        return _measure(args, MPI.COMM_WORLD)
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)  # never leave the other ranks waiting
        raise


def _measure(args: argparse.Namespace, world) -> dict:

    from pivot_hpc.gps import GlobalParameterStorage, GPSConfig, Parallelism
    from pivot_hpc.gps.transport_nixl import nixl_available

    spec = bench_model(args.mib)
    reader, par = 1, Parallelism()
    out: dict = {"bytes": spec.nbytes, "tensors": len(spec.tensors), "repeat": args.repeat}

    def fill(name: str) -> np.ndarray:
        t = spec.tensors[spec.index[name]]
        return np.full(t.shape, spec.index[name], dtype=np.uint16)

    def session(transport: str, remote: bool, lanes: int = GPSConfig.remote_lanes) -> dict:
        # pin the planner: the local case reads only node 0, the remote one only node 1
        nodes = world.size // 2
        keep = 1 if remote else 0
        links = {f"{n}->0": 1e-9 for n in range(nodes) if n != keep}
        cfg = GPSConfig(
            transport=transport, pseudo_node_size=2, link_bandwidth_gbps=links, remote_lanes=lanes
        )
        gps = GlobalParameterStorage(world, cfg, models={"m": spec}, read_only=["m"])
        gps.load("m", fill)
        res: dict = {}
        if world.rank == reader:
            arena = gps.make_arena("m", [reader], par)
            gps.read("m", [reader], par, arena=arena)  # warm-up: touches the arena pages
            times = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                gps.read("m", [reader], par, arena=arena)
                times.append(time.perf_counter() - t0)
            plan = gps.plans.get(("read", "m", (reader,), par), lambda: None)
            res["read_s"] = min(times)
            res["from_nodes"] = sorted({int(n) for n in plan.op_node})
            res["lanes"] = gps.remote.lanes.count
            if not remote:  # memcpy baseline: the same bytes, same source, same destination
                lay = gps.layout
                start = int(lay.offsets["m"][0, 0, 0])
                src = gps.buf[start : start + spec.nbytes]
                dst = arena.host[: spec.nbytes]
                copies = []
                for _ in range(args.repeat + 1):
                    t0 = time.perf_counter()
                    np.copyto(dst, src)
                    copies.append(time.perf_counter() - t0)
                res["memcpy_s"] = min(copies[1:])
            if args.profile_links:
                res["profile"] = _profile(gps, remote)
        _quiet_barrier(world)
        gps.close()
        return res

    local = session("rma", remote=False)
    rma = session("rma", remote=True)
    rma1 = session("rma", remote=True, lanes=1)
    nixl = nixl1 = None
    if nixl_available() and not args.no_nixl:
        nixl = session("nixl", remote=True)
        nixl1 = session("nixl", remote=True, lanes=1)
    if world.rank == reader:
        b = spec.nbytes
        gbps = {k: b / v / 1e9 for k, v in (("memcpy", local["memcpy_s"]), ("local", local["read_s"]), ("remote_rma", rma["read_s"]), ("remote_rma_1lane", rma1["read_s"]))}  # fmt: skip
        if nixl and nixl1:
            gbps["remote_nixl"] = b / nixl["read_s"] / 1e9
            gbps["remote_nixl_1lane"] = b / nixl1["read_s"] / 1e9
        assert local["from_nodes"] == [0] and rma["from_nodes"] == [1], (local, rma)
        out.update({f"{k}_gbps": round(v, 3) for k, v in gbps.items()})
        out["local_ratio"] = round(gbps["local"] / gbps["memcpy"], 3)
        out["remote_ratio_rma"] = round(gbps["remote_rma"] / gbps["memcpy"], 3)
        out["remote_ratio_rma_1lane"] = round(gbps["remote_rma_1lane"] / gbps["memcpy"], 3)
        out["remote_lanes"] = rma["lanes"]
        if nixl:
            out["remote_ratio_nixl"] = round(gbps["remote_nixl"] / gbps["memcpy"], 3)
            out["remote_ratio_nixl_1lane"] = round(gbps["remote_nixl_1lane"] / gbps["memcpy"], 3)
        # the default transport on this machine (gps.transport=auto: rma without a GPU)
        out["remote_ratio"] = out["remote_ratio_rma"]
        out["remote_transport"] = "rma"
        if args.profile_links:
            prof = {**local["profile"], **rma["profile"]}
            out["profile"] = prof
            out["profile_yaml"] = "gps:\n" + "".join(f"  {k}: {v}\n" for k, v in prof.items())
        world.send(out, dest=0, tag=3)
    if world.rank == 0:
        req = world.irecv(source=reader, tag=3)
        done, out = req.test()
        while not done:
            time.sleep(0.002)
            done, out = req.test()
        print(MARK + json.dumps(out, sort_keys=True), flush=True)
    return out


def _profile(gps, remote: bool) -> dict:
    """Bandwidth (64 MiB transfer) and overhead (many 4 KiB transfers) of one link kind."""
    from pivot_hpc.gps.transport import Arena, Batch

    node = 1 if remote else 0
    tr = gps.remote if remote else gps.local
    big, small, count = 64 << 20, 4096, 256
    n = min(big, int(gps.layout.node_bytes[0]) - 4096)
    arena = Arena(n)
    one = Batch(*(np.array([v], dtype=np.int64) for v in (4096, 1, n, n, 0)))
    tr.get(node, arena, one)
    t0 = time.perf_counter()
    tr.get(node, arena, one)
    bw = n / (time.perf_counter() - t0)
    offs = np.arange(count, dtype=np.int64) * small
    tiny = [Batch(offs[i : i + 1] + 4096, *(np.array([v]) for v in (1, small, small)), offs[i : i + 1]) for i in range(count)]  # fmt: skip
    t0 = time.perf_counter()
    for b in tiny:
        tr.get(node, arena, b)
    per = (time.perf_counter() - t0) / count - small / bw
    kind = "remote" if remote else "local"
    return {
        f"{kind}_bandwidth_gbps": round(bw / 1e9, 3),
        f"{kind}_overhead_us": round(max(per, 0.0) * 1e6, 2),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="pivot_hpc.bench.gps_bench")
    parser.add_argument("--json", action="store_true")
    add_arguments(parser)
    run(parser.parse_args())
