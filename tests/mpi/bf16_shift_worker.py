"""MPI program behind tests/mpi/test_bf16_shifts.py: a bf16 trainer whose training role
shifts down and up between steps (runtime/training_seat.py, the real seat over the real
GPS) against the same trainer with no shifts.

`mpirun -n 2 python bf16_shift_worker.py OUT.json [sharded]`: rank 0 is the node's host
rank (GPS window), rank 1 trains. Three bf16 megatron-core trainers from the same weights,
lr 1e-6 (the paper's: most updates are below a bf16 weight's resolution, so only the fp32
masters keep them), the same batches:

- `shifted`: the seat's shift_up → train (publishes into GPS) → shift_down, every step;
- `kept`: train_step only;
- `reloaded`: train_step, then the weights loaded back with their masters, what a shift-up
  did before masters survived shifts (the control: it must lose updates).

Rank 1 writes the measurements to OUT.json; a failed check raises (the world aborts).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import warnings
from types import SimpleNamespace

warnings.filterwarnings("ignore")

STEPS = 5


def main() -> None:
    import torch
    from mpi4py import MPI

    torch.set_num_threads(1)
    from pivot_hpc.engines.base import STORE_ENV
    from pivot_hpc.engines.megatron.model import private_store
    from pivot_hpc.gps import GlobalParameterStorage, GPSConfig, ModelSpec
    from pivot_hpc.models.qwen2 import create_model
    from tests.tiny_arch import tiny_arch

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    assert comm.Get_size() == 2, "run with 2 ranks"
    arch = tiny_arch()
    hf = create_model(arch, seed=3)
    canonical = {k: v.detach().to(torch.bfloat16).float() for k, v in hf.state_dict().items()}
    policy = ModelSpec.from_hf_config(hf.config.to_dict(), name="policy")
    policy = dataclasses.replace(policy, dtype="bfloat16")  # the policy as a bf16 run keeps it
    gps = GlobalParameterStorage(comm, GPSConfig(), models={"policy": policy})
    gps.load("policy", {k: v.to(torch.bfloat16) for k, v in canonical.items()}, version=0)
    store = comm.bcast(private_store() if rank == 0 else None)
    out: dict = {}
    if rank == 1:
        os.environ.update({STORE_ENV: store, "RANK": "0", "WORLD_SIZE": "1"})
        out = trainer(gps, arch, canonical, sharded=sys.argv[2:] == ["sharded"])
    comm.Barrier()
    gps.close()
    if rank == 1:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1)
        print("BF16-SHIFT-OK", flush=True)


def trainer(gps, arch, canonical, *, sharded: bool) -> dict:
    import torch

    from pivot_hpc.engines.base import TrainBatch
    from pivot_hpc.engines.megatron.engine import MegatronTrainEngine
    from pivot_hpc.rl.config import TrainerConfig
    from pivot_hpc.runtime.training_seat import TrainingSeat
    from pivot_hpc.runtime.training_world import TP1, TrainingWorld

    gen = torch.Generator().manual_seed(7)

    def batch() -> TrainBatch:
        rows = 6
        prompts = [torch.randint(3, 120, (5,), generator=gen).tolist() for _ in range(rows)]
        lengths = [4 + i % 5 for i in range(rows)]
        responses = [torch.randint(3, 120, (n,), generator=gen).tolist() for n in lengths]
        return TrainBatch(
            prompt_ids=prompts,
            response_ids=responses,
            advantages=[float(a) for a in torch.randn(rows, generator=gen)],
            old_logprobs=[[-4.8] * n for n in lengths],
        )

    batches = [batch() for _ in range(STEPS)]

    def engine() -> MegatronTrainEngine:
        e = MegatronTrainEngine(
            arch,
            TrainerConfig(tp=1, lr=1e-6, seed=0, dtype="bf16", distributed_optimizer=sharded),
        )
        e.load_weights(canonical)
        return e

    def masters(e) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in e.full_optimizer_state()["master"].items()}

    def params(e) -> dict[str, torch.Tensor]:
        return {k: v.detach().float().clone() for k, v in e.gpt.named_parameters()}

    def diff(x: dict, y: dict) -> float:
        return max(float((x[k].float() - y[k].float()).abs().max()) for k in x)

    cfg = SimpleNamespace(
        rl=SimpleNamespace(
            trainer=SimpleNamespace(process="in_rank", distributed_optimizer=sharded),
            grpo=SimpleNamespace(kl_coef=0.0),
        )
    )
    sent: list = []
    seat = TrainingSeat(1, gps, cfg, None, TrainingWorld(ranks=(1,), base=(1,), tp=1), sent.append)
    seat.trainer = shifted = engine()
    shifted.offload_optimizer()  # prepared: shifted down
    kept, reloaded = engine(), engine()
    start = masters(kept)
    read_s = []
    for step, b in enumerate(batches):
        phases: dict[str, float] = {}
        seat.shift_up(gps.version("policy"), True, phases)
        read_s.append(phases.get("read_s", 0.0))
        seat.train(step, b)
        seat.shift_down({})
        kept.train_step(b)
        reloaded.train_step(b)
        reloaded.load_weights(reloaded.export_weights())  # the shift-up before the fix
    shifted.reload_optimizer()
    assert [m.step for m in sent] == list(range(STEPS)), sent
    assert gps.version("policy") == STEPS == shifted.version
    published, _ = gps.read("policy", [1], TP1, device="cpu")
    return {
        "sharded": sharded,
        "masters_max_abs_diff": diff(masters(shifted), masters(kept)),
        "params_max_abs_diff": diff(params(shifted), params(kept)),
        "published_max_abs_diff": diff(published, shifted.export_weights()),
        "reloaded_masters_max_abs_diff": diff(masters(reloaded), masters(kept)),
        "masters_moved_max": diff(masters(kept), start),
        "optimizer_steps": [shifted.steps, kept.steps],
        "read_s": read_s,
    }


if __name__ == "__main__":
    main()
