"""The training engine in a child process of its rank (`rl.trainer.process: child`,
engines/process/child.py `ChildTrainer`): a child SIGKILLed between steps is one clear
error at the next call, and a fresh child given the dead one's weights and optimizer state
(what the worker reads back from GPS) trains the next step bit for bit like one that never
died. No MPI: each child makes a torch.distributed world of its own (fp32, CPU)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal

import pytest
import torch

from pivot_hpc.engines.base import SupervisedTrainer, TrainBatch
from pivot_hpc.engines.process.child import ChildTrainer, EngineProcessError
from pivot_hpc.models.qwen2 import create_model
from pivot_hpc.rl.config import TrainerConfig
from tests.tiny_arch import tiny_arch

ARCH = tiny_arch()
TRAINER = TrainerConfig(lr=1e-3, grad_clip=1.0, micro_batch_size=3, dtype="fp32")


def batch(seed: int) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 99, (n,), generator=g).tolist() for n in (5, 9, 3, 7)]
    responses = [torch.randint(3, 99, (n,), generator=g).tolist() for n in (6, 2, 8, 4)]
    return TrainBatch(prompt_ids=prompts, response_ids=responses, advantages=[1.0, -0.5, 0.3, -0.8])


def trainer() -> ChildTrainer:
    return ChildTrainer(ARCH, TRAINER)


@pytest.mark.timeout(240)
def test_a_restarted_trainer_refit_from_weights_and_optimizer_state_trains_alike(
    tmp_path,
) -> None:
    canonical = {k: v.clone() for k, v in create_model(ARCH, seed=5).state_dict().items()}
    a, b = trainer(), trainer()
    fresh = None
    try:
        assert isinstance(a, SupervisedTrainer)  # every member of the contract
        assert a.device == torch.device("cpu") and (a.dp, a.dp_rank) == (1, 0)
        first = batch(1)
        for t in (a, b):
            t.load_weights(canonical)
        first.old_logprobs = a.compute_logprobs(first, temperature=1.0)
        for t in (a, b):
            t.train_step(first)
            assert (t.version, t.steps, t.optimizer_step) == (1, 1, 1)
        # what the worker publishes to GPS after each step, taken from the one to kill
        weights = b.export_weights()
        state = b.optimizer_state()
        assert set(state) == set(b.optimizer_kinds()) == {"exp_avg", "exp_avg_sq"}
        os.kill(b.pid, signal.SIGKILL)
        with pytest.raises(EngineProcessError, match=f"engine process {b.pid} was killed by"):
            b.train_step(batch(2))
        assert b.dead
        b.close()  # (a dead child: nothing to ask, the pipe closed and its TMPDIR gone)
        assert not os.path.exists(b.tmp_dir)

        fresh = trainer()
        fresh.load_weights(weights)
        fresh.load_optimizer_state(state, step=1, version=1)
        assert (fresh.version, fresh.steps, fresh.optimizer_step) == (1, 1, 1)
        # the restarted trainer offloads and reloads its state like the first one
        fresh.offload_optimizer()
        assert fresh.optimizer_offloaded
        fresh.reload_optimizer()
        second = batch(2)
        second.old_logprobs = a.compute_logprobs(second, temperature=1.0)
        ma, mf = a.train_step(second), fresh.train_step(second)
        assert ma == mf
        wa, wf = a.export_weights(), fresh.export_weights()
        assert wa.keys() == wf.keys() and all(torch.equal(wa[k], wf[k]) for k in wa)
        sa, sf = a.optimizer_state(), fresh.optimizer_state()
        assert all(torch.equal(sa[k][n], sf[k][n]) for k in sa for n in sa[k])
        # trained at all: the step moved the weights
        assert not all(torch.equal(wa[k], weights[k]) for k in wa)
        # a checkpoint written and read by trainer children (megatron dist_checkpointing)
        a.save(tmp_path / "train")
        fresh.close()
        fresh = trainer()
        fresh.load(tmp_path / "train")
        assert (fresh.version, fresh.steps, fresh.optimizer_step) == (2, 2, 2)
        wf = fresh.export_weights()
        assert all(torch.equal(wa[k], wf[k]) for k in wa)
    finally:
        for t in (a, b, fresh):
            if t is not None:
                t.close()


class Pair:
    """The trainer children of a two-rank training set (data parallel), each started and
    driven from a thread of its own that lives as long as the pair (a child dies with the
    thread that started it), meeting through `store` as the worker's `world_env` has them."""

    def __init__(self, store, trainer: TrainerConfig = TRAINER) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.threads = [ThreadPoolExecutor(max_workers=1) for _ in range(2)]
        env = [{"RANK": str(r), "WORLD_SIZE": "2", "PIVOT_HPC_STORE": str(store)} for r in (0, 1)]
        self.trainers = self.each(lambda r: ChildTrainer(ARCH, trainer, world_env=env[r]))

    def each(self, call) -> list:
        """call(rank) on both ranks at once (a collective needs both)."""
        futures = [t.submit(call, r) for r, t in enumerate(self.threads)]
        return [f.result(timeout=120) for f in futures]

    def train(self, b: TrainBatch) -> list[dict]:
        return self.each(lambda r: self.trainers[r].train_step(b.rows(range(r, len(b), 2))))

    def close(self) -> None:
        self.each(lambda r: self.trainers[r].close())
        for t in self.threads:
            t.shutdown()


@pytest.mark.slow  # two two-rank worlds each (12 s): the one-rank refit above stays fast
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sharded", [False, True], ids=["full-state", "sharded-optimizer"])
def test_a_two_rank_training_set_replaced_after_a_death_trains_like_one_that_never_died(
    tmp_path, sharded: bool
) -> None:
    """What the worker does when one of two trainer children dies between steps
    (runtime/worker.py `_start_trainer`): both are replaced, in a new world (the
    survivor's lost a member), and refit from what was kept after the last step: the
    state the set's first rank published (full: alike on both ranks, the gradients were
    averaged), or with rl.trainer.distributed_optimizer each rank's own range
    (`optimizer_shard`: no rank holds the whole state). The next step then matches, bit
    for bit, a set that never lost a child."""
    trainer = dataclasses.replace(TRAINER, distributed_optimizer=sharded)
    canonical = {k: v.clone() for k, v in create_model(ARCH, seed=5).state_dict().items()}
    first, second = batch(1), batch(2)
    pairs = []
    try:
        hit, steady = Pair(tmp_path / "hit.g0", trainer), Pair(tmp_path / "steady", trainer)
        pairs += [hit, steady]
        assert [(t.dp, t.dp_rank) for t in hit.trainers] == [(2, 0), (2, 1)]
        for pair in pairs:
            pair.each(lambda r, p=pair: p.trainers[r].load_weights(canonical))
        first.old_logprobs = hit.trainers[0].compute_logprobs(first, temperature=1.0)
        for pair in pairs:
            pair.train(first)
        weights = hit.trainers[0].export_weights()
        if sharded:  # what each rank keeps
            kept = hit.each(lambda r: hit.trainers[r].optimizer_shard())
            (lo0, hi0), (lo1, hi1) = [(k["lo"], k["hi"]) for k in kept]
            assert lo0 == 0 < hi0 == lo1 < hi1 and all(k["step"] == 1 for k in kept)
        else:  # what the set's first rank publishes
            state = hit.trainers[0].optimizer_state()
        os.kill(hit.trainers[1].pid, signal.SIGKILL)
        hit.close()  # the survivor too: its world lost a member
        new = Pair(tmp_path / "hit.g1", trainer)
        pairs.append(new)
        new.each(lambda r: new.trainers[r].load_weights(weights))
        if sharded:
            new.each(lambda r: new.trainers[r].load_optimizer_shard(kept[r], version=1))
        else:
            new.each(lambda r: new.trainers[r].load_optimizer_state(state, step=1, version=1))
        assert [(t.version, t.steps, t.optimizer_step) for t in new.trainers] == [(1, 1, 1)] * 2
        second.old_logprobs = steady.trainers[0].compute_logprobs(second, temperature=1.0)
        assert new.train(second) == steady.train(second)
        for r in (0, 1):
            wn, ws = new.trainers[r].export_weights(), steady.trainers[r].export_weights()
            assert all(torch.equal(wn[k], ws[k]) for k in ws)
        assert not all(torch.equal(ws[k], weights[k]) for k in ws)  # trained at all
        if sharded:
            sn, ss = (p.each(lambda r, p=p: p.trainers[r].optimizer_shard()) for p in (new, steady))
            for a, b in zip(sn, ss, strict=True):
                assert all(torch.equal(a["state"][k], b["state"][k]) for k in b["state"])
    finally:
        for pair in pairs:
            with contextlib.suppress(Exception):
                pair.close()


@pytest.mark.timeout(120)
def test_the_trainer_child_dies_with_its_rank(tmp_path) -> None:
    """PR_SET_PDEATHSIG: a rank that dies (SIGKILL: no close, no pipe EOF handling) takes
    its trainer child with it, even while the child would be busy."""
    import subprocess
    import sys
    import time

    pid_file = tmp_path / "child.pid"
    code = (
        "import sys, time\n"
        "from pivot_hpc.engines.process.child import ChildTrainer\n"
        "from pivot_hpc.rl.config import TrainerConfig\n"
        "from tests.tiny_arch import tiny_arch\n"
        "t = ChildTrainer(tiny_arch(), TrainerConfig(dtype='fp32'))\n"
        f"open({str(pid_file)!r}, 'w').write(str(t.pid))\n"
        "time.sleep(600)\n"
    )
    rank = subprocess.Popen([sys.executable, "-c", code], cwd=os.getcwd())
    try:
        end = time.monotonic() + 90
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < end:
            assert rank.poll() is None, "the rank died before its trainer started"
            time.sleep(0.1)
        child = int(pid_file.read_text())
        os.kill(child, 0)  # alive
        rank.kill()
        rank.wait()
        end = time.monotonic() + 10
        while time.monotonic() < end and _alive(child):
            time.sleep(0.05)
        assert not _alive(child), "the trainer child outlived its rank"
    finally:
        if rank.poll() is None:
            rank.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_child_is_accepted_for_every_training_layout() -> None:
    from pivot_hpc.job.config import load_config
    from pivot_hpc.runtime.world import check_live_config

    for layout in (
        [],
        ["training.num_gpus=2"],
        ["training.num_gpus=2", "rl.trainer.tp=2"],
        ["planner.elastic_training=true"],
        ["training.num_gpus=2", "rl.trainer.distributed_optimizer=true"],
    ):
        check_live_config(load_config("configs/tiny.yaml", ["rl.trainer.process=child", *layout]))


def test_child_registers_the_optimizer_state_in_gps() -> None:
    """What a restarted child reads back: the elastic path's optimizer-state models."""
    from pivot_hpc.gps import ModelSpec
    from pivot_hpc.job.config import load_config
    from pivot_hpc.runtime.training_world import OPTIMIZER_MODELS, run_optimizer_models

    policy = ModelSpec.from_hf_config(create_model(ARCH, seed=0).config.to_dict(), name="policy")
    for process, want in (("in_rank", set()), ("child", set(OPTIMIZER_MODELS.values()))):
        cfg = load_config("configs/tiny.yaml", [f"rl.trainer.process={process}"])
        assert set(run_optimizer_models(cfg, policy)) == want
