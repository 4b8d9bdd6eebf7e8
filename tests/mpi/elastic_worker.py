"""MPI program behind tests/mpi/test_elastic_training.py: elastic data parallelism with the
real pieces — megatron-core trainers on gloo, optimizer state through GPS, the process
groups of runtime/training_world.py.

`mpirun -n 3 python elastic_worker.py OUT.json [sharded]`: rank 0 is the node's host rank
(GPS window), ranks 1 and 2 are trainers (torch ranks 0 and 1). `sharded`: the trainers
shard their optimizer (`distributed_optimizer`, engines/megatron/sharded_adam.py): the training set
(rank 1) owns all of it in A and D, a joiner takes none; B and C split it in halves.
On each trainer rank:

- run A grows and shrinks: step 1 on rank 1 alone (DP 1); rank 2 joins through GPS (the
  policy and the optimizer state rank 1 publishes); step 2 at DP 2; rank 2 leaves; step 3
  at DP 1; it joins again; step 4 at DP 2;
- run B is at DP 2 in every step where A is (steps 1, 2 and 4; step 3 at DP 1 like A);
- run C is megatron's own data parallelism (its DDP reduction over its data-parallel
  group) at DP 2 for steps 1 and 2;
- run D grows like A but the joiner starts with fresh optimizer state (what re-sharding
  through GPS prevents).

Rank 1 writes the measurements to OUT.json and A's and B's final weights to OUT.pt; any
failed check raises (world aborts).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")


def main() -> None:
    import torch
    from mpi4py import MPI

    torch.set_num_threads(1)
    from pivot_hpc.engines.base import STORE_ENV
    from pivot_hpc.engines.megatron.model import private_store
    from pivot_hpc.gps import GlobalParameterStorage, GPSConfig, ModelSpec
    from pivot_hpc.models.qwen2 import create_model
    from pivot_hpc.runtime.training_world import TrainingWorld, optimizer_models
    from tests.tiny_arch import tiny_arch

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    assert comm.Get_size() == 3, "run with 3 ranks"
    arch = tiny_arch()
    hf = create_model(arch, seed=3)
    canonical = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    policy = ModelSpec.from_hf_config(hf.config.to_dict(), name="policy")
    policy = dataclasses.replace(policy, dtype="float32")
    gps = GlobalParameterStorage(
        comm,
        GPSConfig(),
        models={"policy": policy, **optimizer_models(policy, masters=False)},
    )
    gps.load("policy", {k: v.numpy() for k, v in canonical.items()}, version=0)
    store = comm.bcast(private_store() if rank == 0 else None)
    world = TrainingWorld(ranks=(1, 2), base=(1,), tp=1)
    out: dict = {}
    if rank != 0:
        os.environ.update(
            {STORE_ENV: store, "RANK": str(world.torch_rank(rank)), "WORLD_SIZE": "2"}
        )
        out = trainers(rank, comm, gps, world, arch, canonical)
    comm.Barrier()
    gps.close()
    if rank == 1:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1)
        print("ELASTIC-OK", flush=True)


def trainers(rank, comm, gps, world, arch, canonical) -> dict:
    import torch

    from pivot_hpc.engines.base import TrainBatch
    from pivot_hpc.engines.megatron.engine import MegatronTrainEngine
    from pivot_hpc.engines.step_groups import StepGroups
    from pivot_hpc.rl.config import TrainerConfig
    from pivot_hpc.runtime.training_seat import shard
    from pivot_hpc.runtime.training_world import TP1, publish_optimizer, read_optimizer

    groups = StepGroups(world.ranks, world.tp)
    formed: set = set()
    gen = torch.Generator().manual_seed(11)

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

    batches = [batch(s) for s in range(4)]  # the same on both ranks (same generator)
    sharded = sys.argv[2:] == ["sharded"]

    def engine() -> MegatronTrainEngine:
        e = MegatronTrainEngine(
            arch,
            TrainerConfig(
                tp=1,
                lr=2e-3,
                seed=0,
                grad_clip=1.0,
                micro_batch_size=2,
                distributed_optimizer=sharded,
            ),
        )
        e.load_weights(canonical)
        return e

    def step(e, b: TrainBatch, members: tuple[int, ...]) -> None:
        if members not in formed:  # every training rank, as FormGroups does in a run
            formed.add(members)
            groups.form(members, rank)
        if rank not in members:
            return
        group, dp, d = groups.of(members)
        e.use_data_parallel(group, dp, d)
        e.train_step(shard(b, d, dp) if dp > 1 else b)

    def params(e) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in e.gpt.named_parameters()}

    def publish(e) -> None:
        """Rank 1 publishes the policy it trained and its optimizer state (runtime path)."""
        if rank == 1:
            tensors = {k: v.contiguous() for k, v in e.export_weights().items()}
            v = gps.write("policy", [1], TP1, tensors, version=e.version)
            assert v == e.version
            publish_optimizer(gps, e, rank, 1, e.version)

    def join(e, version: int) -> None:
        """Rank 2 joins at `version`: the policy and the optimizer state from GPS (after
        rank 1 published: in a run the coordinator's messages order the two)."""
        comm.sendrecv(None, dest=3 - rank, source=3 - rank)
        if rank == 2:
            tensors, got = gps.read("policy", [2], TP1, device="cpu")
            assert got == version, (got, version)
            e.load_weights(tensors)
            read_optimizer(gps, e, rank, version)

    res: dict = {}
    both, one = (1, 2), (1,)

    # run A: grow, shrink, grow
    a = engine()
    step(a, batches[0], one)
    publish(a)
    join(a, 1)
    mine = a.optimizer_state()
    theirs = comm.sendrecv(
        {k: {n: t.numpy() for n, t in v.items()} for k, v in mine.items()},
        dest=3 - rank,
        source=3 - rank,
    )
    if rank == 2:  # the joiner holds bit for bit what the set published
        res["reshard_bitwise"] = all(
            torch.equal(mine[k][n], torch.from_numpy(theirs[k][n])) for k in mine for n in mine[k]
        )
        res["reshard_tensors"] = sum(len(v) for v in mine.values())
        res["reshard_step"] = [a.optimizer_step, a.steps, a.version]
    step(a, batches[1], both)
    res[f"elements_a_rank{rank}"] = a.optimizer_elements  # sharded: rank 1 owns it all
    a_after2 = params(a)
    peer = comm.sendrecv(
        {k: v.numpy() for k, v in a_after2.items()}, dest=3 - rank, source=3 - rank
    )
    res[f"replicas_bitwise_rank{rank}"] = all(
        torch.equal(v, torch.from_numpy(peer[k])) for k, v in a_after2.items()
    )
    if rank == 2:
        a.discard_optimizer()  # leaves
    step(a, batches[2], one)
    publish(a)
    join(a, 3)
    step(a, batches[3], both)
    a_final = params(a)

    # run B: DP 2 in every step (a data-parallel step is the same update as one rank's
    # over the whole batch, up to float summation order, so A must match it)
    b = engine()
    for i in range(4):
        step(b, batches[i], both)
        if i == 1:
            b_after2 = params(b)
    b_final = params(b)
    res[f"elements_b_rank{rank}"] = b.optimizer_elements  # sharded: half each

    # run C: megatron's own reduction at DP 2 (its data-parallel group is both ranks)
    c = engine()
    for i in (0, 1):
        c.train_step(shard(batches[i], c.dp_rank, c.dp))
    c_after2 = params(c)

    # run D: grows like A, but the joiner gets only the weights (over MPI here; GPS
    # versions belong to run A) and starts with fresh optimizer state
    dd = engine()
    step(dd, batches[0], one)
    mine = {k: v.numpy() for k, v in dd.export_weights().items()}
    weights = comm.sendrecv(mine, dest=3 - rank, source=3 - rank)  # rank 2 takes rank 1's
    if rank == 2:
        dd.load_weights({k: torch.from_numpy(v) for k, v in weights.items()})
        dd.discard_optimizer()
        dd.steps = dd.version = 1
    step(dd, batches[1], both)
    d_after2 = params(dd)

    def maxdiff(x, y) -> float:
        return max((x[k] - y[k]).abs().max().item() for k in x)

    diffs = {
        "grown_vs_dp2_after_step2": maxdiff(a_after2, b_after2),
        "grown_vs_dp2_final": maxdiff(a_final, b_final),
        "explicit_vs_megatron_dp2": maxdiff(b_after2, c_after2),
        "fresh_optimizer_vs_dp2_after_step2": maxdiff(d_after2, b_after2),
    }
    res["explicit_vs_megatron_bitwise"] = all(
        torch.equal(b_after2[k], c_after2[k]) for k in b_after2
    )
    # the size of a DP 1 vs DP 2 difference after one step (float summation order)
    e1 = engine()
    step(e1, batches[0], one)
    e2 = engine()
    step(e2, batches[0], both)
    if rank == 1:
        diffs["dp1_vs_dp2_step1_gap"] = maxdiff(params(e1), params(e2))
        torch.save({"a_final": a_final, "b_final": b_final}, sys.argv[1] + ".pt")
    theirs = comm.sendrecv(diffs, dest=3 - rank, source=3 - rank)
    for k, v in diffs.items():  # the worse of the two ranks
        res[k] = max(v, theirs.get(k, v))
    bitwise = comm.sendrecv(res["explicit_vs_megatron_bitwise"], dest=3 - rank, source=3 - rank)
    res["explicit_vs_megatron_bitwise"] = res["explicit_vs_megatron_bitwise"] and bitwise
    other = comm.sendrecv(res, dest=3 - rank, source=3 - rank)  # (rank 0 only hosts GPS)
    res["sharded"] = sharded
    return {**other, **res} if rank == 1 else {}


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        import traceback

        from mpi4py import MPI

        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)  # a failed check ends every rank, never a hang
