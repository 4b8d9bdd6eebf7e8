"""One rank of the sharded-optimizer checks (run by test_sharded_optimizer.py as a
subprocess; env: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; world size = DP size, TP 1).

usage: sharded_worker.py OUT_DIR MODE
- MODE=dp2: the sharded optimizer against the unsharded one (same init, same batches, fp32
  and bf16); offload; the re-partitioning of engines/megatron/sharded_adam.py point to point; checkpoints in
  either format loaded by the other optimizer; a DP-2 checkpoint for MODE=dp1.
- MODE=dp1: loads the DP-2 checkpoint at DP 1, trains a step, saves a DP-1 checkpoint.
- MODE=dp2load: loads that DP-1 checkpoint at DP 2.
Rank 0 writes OUT_DIR/MODE.json.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

STEPS = 3


def main() -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from pivot_hpc.engines.base import TrainBatch
    from pivot_hpc.engines.megatron.engine import MegatronTrainEngine
    from pivot_hpc.models.qwen2 import create_model
    from pivot_hpc.rl.config import TrainerConfig
    from pivot_hpc.runtime.training_seat import shard
    from tests.tiny_arch import tiny_arch

    out, mode = Path(sys.argv[1]), sys.argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    arch = tiny_arch()
    canonical = {k: v.detach().clone() for k, v in create_model(arch, seed=4).state_dict().items()}
    gen = torch.Generator().manual_seed(7)

    def batch(step: int) -> TrainBatch:
        rows = 6
        prompts = [torch.randint(3, 120, (5,), generator=gen).tolist() for _ in range(rows)]
        lengths = [4 + (i * 3 + step) % 9 for i in range(rows)]  # ragged responses
        responses = [torch.randint(3, 120, (n,), generator=gen).tolist() for n in lengths]
        return TrainBatch(
            prompt_ids=prompts,
            response_ids=responses,
            advantages=[float(a) for a in torch.randn(rows, generator=gen)],
            old_logprobs=[[-4.8] * n for n in lengths],
        )

    batches = [batch(s) for s in range(STEPS + 2)]  # the same on every rank

    def engine(sharded: bool, dtype: str = "fp32") -> MegatronTrainEngine:
        # warm-up, weight decay and a clip that bites: the whole schedule is compared
        cfg = TrainerConfig(
            tp=1,
            lr=2e-3,
            weight_decay=0.1,
            warmup_steps=2,
            grad_clip=0.5,
            seed=0,
            micro_batch_size=2,
            dtype=dtype,
            distributed_optimizer=sharded,
        )
        e = MegatronTrainEngine(arch, cfg)
        e.load_weights(canonical)
        return e

    def train(e, b) -> dict:
        return e.train_step(shard(b, e.dp_rank, e.dp) if e.dp > 1 else b)

    def params(e) -> dict[str, torch.Tensor]:
        return {k: v.detach().float().clone() for k, v in e.gpt.named_parameters()}

    def maxdiff(x: dict, y: dict) -> float:
        return max((x[k].float() - y[k].float()).abs().max().item() for k in x)

    def state_diff(x: dict, y: dict) -> float:
        return max(maxdiff(x[k], y[k]) for k in x)

    res: dict = {"world": world}
    if mode == "dp2":
        z, u = engine(True), engine(False)
        mz, mu = [], []
        for b in batches[:STEPS]:
            mz.append(train(z, b))
            mu.append(train(u, b))
        res["elements"] = [z.optimizer_elements, u.optimizer_elements]
        res["params_diff"] = maxdiff(params(z), params(u))
        res["grad_norms"] = [[m["grad_norm"] for m in mz], [m["grad_norm"] for m in mu]]
        res["lrs"] = [[m["lr"] for m in mz], [m["lr"] for m in mu]]
        res["state_diff"] = state_diff(z.full_optimizer_state(), u.full_optimizer_state())
        res["counters"] = [z.optimizer_step, z.steps, u.optimizer_step, u.steps]
        res["kinds"] = list(z.optimizer_kinds())
        res["published"] = len(z.optimizer_state())
        # offload and reload: the next step still agrees
        z.offload_optimizer()
        res["offloaded"] = z.optimizer_offloaded
        train(z, batches[STEPS])
        train(u, batches[STEPS])
        res["after_offload_diff"] = maxdiff(params(z), params(u))
        # ranks hold the same weights (the all-gather)
        mine = params(z)
        peer = [None] * world
        dist.all_gather_object(peer, {k: v.numpy() for k, v in mine.items()})
        res["replicas_bitwise"] = all(
            torch.equal(mine[k], torch.from_numpy(peer[1 - rank][k])) for k in mine
        )
        # explicit groups (use_data_parallel): the same owners, the same step as megatron's
        g = dist.new_group([0, 1])
        z.use_data_parallel(g, 2, rank)
        u.use_data_parallel(g, 2, rank)
        res["explicit_elements"] = z.optimizer_elements
        # one replica alone cannot step: half of the state is on the other
        res["alone_refused"] = rank != 0
        if rank == 0:
            try:
                z.use_data_parallel(None, 1, 0)
            except RuntimeError as exc:
                res["alone_refused"] = "held by no replica" in str(exc)
        z.use_data_parallel(g, 2, rank)
        train(z, batches[STEPS + 1])
        train(u, batches[STEPS + 1])
        res["explicit_diff"] = maxdiff(params(z), params(u))
        # a joiner given the whole canonical state (load_optimizer_state) and one given none
        full = z.full_optimizer_state()
        if rank == 1:
            z.discard_optimizer()
            res["discarded_elements"] = z.optimizer_elements
            z.load_optimizer_state(full, step=z.steps, version=z.version)
            res["held_full_elements"] = z.optimizer_elements
        z.use_data_parallel(g, 2, rank)
        res["rejoined_elements"] = z.optimizer_elements
        res["rejoined_state_diff"] = state_diff(z.full_optimizer_state(), full)
        # checkpoints: each optimizer loads the other's, at DP 2
        z.save(out / "ckpt_z2")
        u.save(out / "ckpt_u2")
        z_from_u, u_from_z = engine(True), engine(False)
        z_from_u.load(out / "ckpt_u2")
        u_from_z.load(out / "ckpt_z2")
        res["z_from_u"] = [
            maxdiff(params(z_from_u), params(u)),
            state_diff(z_from_u.full_optimizer_state(), u.full_optimizer_state()),
            z_from_u.optimizer_step,
            z_from_u.optimizer_elements,
        ]
        res["u_from_z"] = [
            maxdiff(params(u_from_z), params(z)),
            state_diff(u_from_z.full_optimizer_state(), full),
            u_from_z.optimizer_step,
        ]
        # as in elastic training: rank 0 trains alone while rank 1 never joins (it keeps its
        # fresh range of the first layout); both save, rank 0 alone writes the state, and a
        # resumed world gives it all to rank 0 again
        x = engine(True)
        if rank == 0:
            x.use_data_parallel(None, 1, 0)
            train(x, batches[0])
        x.save(out / "ckpt_elastic")
        y = engine(True)
        y.load(out / "ckpt_elastic")
        res["elastic_resume_elements"] = y.optimizer_elements
        policy = [x.export_weights()]  # the joiner takes the policy first (GPS in a run)
        dist.broadcast_object_list(policy, src=0)
        x.load_weights(policy[0])
        x.use_data_parallel(g, 2, rank)  # rank 1's step-0 range is stale: dropped
        y.use_data_parallel(g, 2, rank)
        train(x, batches[1])
        train(y, batches[1])
        res["elastic_resume_diff"] = maxdiff(params(x), params(y))
        if rank == 0:
            torch.save(
                {"params": params(z), "state": full, "step": z.optimizer_step}, out / "z2.pt"
            )
            torch.save(batches[STEPS + 1], out / "next_batch.pt")
        res["bf16"] = bf16_pair(engine, train, params, maxdiff, batches)
        res["repartition"] = repartition(rank)
    elif mode == "dp1":
        z = engine(True)
        z.load(out / "ckpt_z2")
        want = torch.load(out / "z2.pt")
        res["load_diff"] = [
            maxdiff(params(z), want["params"]),
            state_diff(z.full_optimizer_state(), want["state"]),
        ]
        res["counters"] = [z.optimizer_step, want["step"]]
        res["elements"] = z.optimizer_elements
        b = torch.load(out / "next_batch.pt", weights_only=False)
        train(z, b)
        z.save(out / "ckpt_z1")
        torch.save({"params": params(z), "state": z.full_optimizer_state()}, out / "z1.pt")
    elif mode == "dp2load":
        z = engine(True)
        z.load(out / "ckpt_z1")
        want = torch.load(out / "z1.pt")
        res["load_diff"] = [
            maxdiff(params(z), want["params"]),
            state_diff(z.full_optimizer_state(), want["state"]),
        ]
        res["elements"] = z.optimizer_elements
    gathered = [None] * world
    dist.all_gather_object(gathered, res)
    if rank == 0:
        (out / f"{mode}.json").write_text(json.dumps(gathered))
    dist.barrier()
    dist.destroy_process_group()


def bf16_pair(engine, train, params, maxdiff, batches) -> dict:
    """bf16 weights with fp32 masters: the sharded optimizer steps the masters like the
    unsharded one (the checkpoint carries them too)."""
    z, u = engine(True, "bf16"), engine(False, "bf16")
    for b in batches[:2]:
        train(z, b)
        train(u, b)
    zs, us = z.full_optimizer_state(), u.full_optimizer_state()
    return {
        "params_diff": maxdiff(params(z), params(u)),
        "master_diff": maxdiff(zs["master"], us["master"]),
        "kinds": sorted(zs),
        "elements": [z.optimizer_elements, u.optimizer_elements],
    }


def repartition(rank: int) -> dict:
    """sharded_adam.ShardedAdam alone: ranges that moved point to point, a whole copy
    narrowed, a stale copy dropped, a parameter assembled from two owners."""
    import torch
    import torch.distributed as dist

    from pivot_hpc.engines.megatron.sharded_adam import KINDS, ShardedAdam

    numels = [30, 45, 25]  # 100 elements
    params = [torch.zeros(n) for n in numels]
    truth = {k: torch.arange(100, dtype=torch.float32) + 1000 * i for i, k in enumerate(KINDS)}

    def holding(lo: int, hi: int, step: int) -> ShardedAdam:
        z = ShardedAdam(
            numels,
            lr=1e-3,
            betas=(0.9, 0.999),
            eps=1e-8,
            weight_decay=0.0,
            device=torch.device("cpu"),
        )
        z.hold_full(truth, step)
        z.lo, z.hi = lo, hi
        z.state = {k: v[lo:hi].clone() for k, v in truth.items()}
        return z

    g = dist.new_group([0, 1])
    out = {}
    # uneven halves from another layout → [0, 50), [50, 100): [50, 70) moves 0 → 1
    z = holding(*((0, 70) if rank == 0 else (70, 100)), step=3)
    owners, moved = z.regroup(g, 2, rank, params)
    out["uneven"] = [owners, moved, [z.lo, z.hi], _exact(z, truth)]
    full = z.gather()
    out["gather_exact"] = all(torch.equal(full[k], truth[k]) for k in KINDS)
    parts = z.assemble()  # param 1 ([30, 75)) straddles the owners: whole on rank 0
    out["assembled"] = sorted(parts)
    out["assembled_exact"] = all(
        torch.equal(parts[i][k], truth[k][z.layout.offsets[i] : z.layout.offsets[i + 1]])
        for i in parts
        for k in KINDS
    )
    # a stale copy (older step) is dropped: the current holder owns everything
    z = holding(0, 100, step=5 if rank == 0 else 4)
    owners, moved = z.regroup(g, 2, rank, params)
    out["stale"] = [owners, moved, [z.lo, z.hi], _exact(z, truth)]
    return out


def _exact(z, truth) -> bool:
    if z.state is None:
        return True
    return all(torch_equal(z.state[k], truth[k][z.lo : z.hi]) for k in truth)


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


if __name__ == "__main__":
    main()
