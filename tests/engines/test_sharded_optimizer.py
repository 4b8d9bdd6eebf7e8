"""The sharded (ZeRO-1) optimizer of the Megatron engine (`rl.trainer.distributed_optimizer`,
engines/megatron/sharded_adam.py): the range arithmetic here; on CPU/gloo with real megatron-core
(tests/engines/sharded_worker.py, fresh processes per world) the same training as the
unsharded optimizer at DP 2 with half the state per rank, re-partitioning, and checkpoints
across DP sizes and between the two optimizers. Elastic training with it:
tests/mpi/test_elastic_training.py."""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pivot_hpc.engines.megatron.sharded_adam import KINDS, FlatLayout, ShardedAdam, split

WORKER = Path(__file__).with_name("sharded_worker.py")
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("total, parts", [(100, 1), (100, 3), (7, 4), (3, 5), (10**9 + 7, 8)])
def test_split_covers_in_near_equal_ranges(total: int, parts: int) -> None:
    ranges = split(total, parts)
    assert ranges[0][0] == 0 and ranges[-1][1] == total
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    sizes = [hi - lo for lo, hi in ranges]
    assert max(sizes) - min(sizes) <= 1


def test_pieces_cut_parameters_at_range_ends() -> None:
    lay = FlatLayout([30, 45, 25])
    assert lay.total == 100
    got = [(p.index, p.start, p.stop, p.at) for p in lay.pieces(20, 80)]
    assert got == [(0, 20, 30, 20), (1, 0, 45, 30), (2, 0, 5, 75)]
    assert list(lay.pieces(40, 40)) == []
    # every element of every range lands in exactly one piece
    for lo, hi in split(100, 3):
        assert sum(p.stop - p.start for p in lay.pieces(lo, hi)) == hi - lo
    assert lay.first_owner(1, split(100, 2)) == 0 and lay.first_owner(2, split(100, 2)) == 1


def _adam(numels, masters: bool = True) -> ShardedAdam:
    cpu = torch.device("cpu")
    hyper = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    return ShardedAdam(numels, **hyper, device=cpu, masters=masters)


@pytest.mark.parametrize("masters", [True, False])
def test_one_owner_steps_like_torch_adamw_over_the_parameters(masters: bool) -> None:
    """A single owner (DP 1) over three parameters: torch's AdamW on each parameter, with
    fp32 masters (a bf16 model's) or on the parameters' pieces in place (an fp32 model)."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(3, 4), (5,), (2, 2, 2)]
    ref = [torch.randn(s, generator=gen) for s in shapes]
    mine = [t.clone() for t in ref]
    z = _adam([t.numel() for t in mine], masters=masters)
    z.own(_owners_all(z), 0, mine)
    opt = torch.optim.AdamW(ref, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    for _ in range(3):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        for r, g in zip(ref, grads, strict=True):
            r.grad = g.clone() * 0.5
        opt.step()
        z.step(mine, grads, lr=1e-2, scale=0.5)
    assert z.step_count == 3 and z.elements == len(z.kinds) * sum(t.numel() for t in ref)
    for a, b in zip(mine, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


def _owners_all(z: ShardedAdam):
    from pivot_hpc.engines.megatron.sharded_adam import Owners

    return Owners(None, (0,), ((0, z.layout.total),))


def test_canonical_round_trip_and_offload() -> None:
    """hold_full → gather (one member) gives the state back; offload keeps it bit for bit;
    a load of whole parameters (a checkpoint) fills the range."""
    z = _adam([6, 10])
    truth = {k: torch.arange(16, dtype=torch.float32) * (i + 1) for i, k in enumerate(KINDS)}
    z.hold_full(truth, step=4)
    z.owners, z.me = _owners_all(z), 0
    got = z.gather()
    assert all(torch.equal(got[k], truth[k]) for k in KINDS)
    z.offload(pin=False)
    assert z.offloaded
    z.reload()
    assert all(torch.equal(z.state[k], truth[k]) for k in KINDS)
    z.state = {k: torch.zeros(16) for k in KINDS}
    z.fill({0: {k: truth[k][:6] for k in KINDS}, 1: {k: truth[k][6:] for k in KINDS}}, step=4)
    assert all(torch.equal(z.state[k], truth[k]) for k in KINDS) and z.step_count == 4
    assert z.needed() == [0, 1]
    z.discard()
    assert z.state is None and z.elements == 0


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(world: int, out: Path, mode: str, timeout: float = 300) -> list[dict]:
    port = _port()
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            PYTHONPATH=str(REPO),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), str(out), mode],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-4000:]
    return json.loads((out / f"{mode}.json").read_text())


@pytest.fixture(scope="module")
def worlds(tmp_path_factory) -> dict[str, list[dict]]:
    """DP 2 (compare, re-partition, checkpoints) → DP 1 (load, step, save) → DP 2 (load)."""
    out = tmp_path_factory.mktemp("sharded")
    return {mode: _run(n, out, mode) for n, mode in ((2, "dp2"), (1, "dp1"), (2, "dp2load"))}


# the unsharded and sharded steps differ only in float rounding of the same elementwise
# AdamW (one flat tensor vs one per parameter); several steps at lr 2e-3 stay near 1e-6
TOL = 1e-5


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dp2_sharded_trains_like_unsharded_with_half_the_state(worlds) -> None:
    for r in worlds["dp2"]:
        elements_sharded, elements_full = r["elements"]
        assert abs(elements_sharded - elements_full / 2) <= 3  # ranges differ by ≤ 1 each
        assert r["params_diff"] <= TOL and r["state_diff"] <= TOL
        assert r["grad_norms"][0] == pytest.approx(r["grad_norms"][1], rel=1e-5)
        assert r["grad_norms"][0][0] > 0.5  # the clip bit
        assert r["lrs"][0] == r["lrs"][1] == pytest.approx([1e-3, 2e-3, 2e-3])
        assert r["counters"] == [3, 3, 3, 3]
        assert r["kinds"] == [] and r["published"] == 0  # a joiner takes no state
        assert r["offloaded"] and r["after_offload_diff"] <= TOL
        assert r["replicas_bitwise"]
        assert r["explicit_elements"] == elements_sharded and r["explicit_diff"] <= TOL
        assert r["alone_refused"]
        assert r["rejoined_elements"] == elements_sharded and r["rejoined_state_diff"] == 0
    assert worlds["dp2"][1]["discarded_elements"] == 0
    assert worlds["dp2"][1]["held_full_elements"] == worlds["dp2"][0]["elements"][1]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bf16_masters_are_sharded_and_step_like_unsharded(worlds) -> None:
    for r in worlds["dp2"]:
        b = r["bf16"]
        assert b["kinds"] == ["exp_avg", "exp_avg_sq", "master"]
        assert abs(b["elements"][0] - b["elements"][1] / 2) <= 3
        assert b["master_diff"] <= TOL
        assert b["params_diff"] <= 1e-2  # a bf16 ulp where a master sits on a rounding edge


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_repartition_moves_ranges_point_to_point(worlds) -> None:
    r0, r1 = (r["repartition"] for r in worlds["dp2"])
    assert r0["uneven"] == [2, 60, [0, 50], True]  # sends [50, 70): 20 elements x 3 kinds
    assert r1["uneven"] == [2, 60, [50, 100], True]
    assert r0["gather_exact"] and r1["gather_exact"]
    assert r0["assembled"] == [0, 1] and r1["assembled"] == [2]
    assert r0["assembled_exact"] and r1["assembled_exact"]
    assert r0["stale"] == [1, 0, [0, 100], True] and r1["stale"] == [1, 0, [0, 0], True]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_checkpoints_load_across_optimizers_and_dp_sizes(worlds) -> None:
    for r in worlds["dp2"]:
        params, state, step, elements = r["z_from_u"]
        assert params == 0 and state == 0 and step == 5
        assert elements == r["elements"][0]  # loaded sharded: half each again
        params, state, step = r["u_from_z"]
        assert params == 0 and state == 0 and step == 5
    # elastic: rank 0 alone trained and wrote it all; resumed, it owns it all again
    r0, r1 = worlds["dp2"]
    assert r0["elastic_resume_elements"] == r0["elements"][1] and r1["elastic_resume_elements"] == 0
    assert r0["elastic_resume_diff"] == 0 and r1["elastic_resume_diff"] == 0
    (dp1,) = worlds["dp1"]
    assert dp1["load_diff"] == [0, 0] and dp1["counters"] == [5, 5]
    assert dp1["elements"] == worlds["dp2"][0]["elements"][1]  # all of it at DP 1
    for r in worlds["dp2load"]:
        assert r["load_diff"] == [0, 0]
        assert abs(r["elements"] - dp1["elements"] / 2) <= 3


def test_elastic_runs_register_no_optimizer_models_when_sharded() -> None:
    """GPS carries no optimizer state for a sharded trainer: a joiner reads none."""
    from types import SimpleNamespace as NS

    from pivot_hpc.gps import ModelSpec
    from pivot_hpc.models.qwen2 import create_model
    from pivot_hpc.runtime.training_world import run_optimizer_models
    from tests.tiny_arch import tiny_arch

    policy = ModelSpec.from_hf_config(create_model(tiny_arch(), seed=0).config.to_dict(), "policy")

    def cfg(sharded: bool):
        trainer = NS(distributed_optimizer=sharded, dtype="bf16")
        return NS(
            planner=NS(elastic_training=True), deployment=NS(mode="pivot"), rl=NS(trainer=trainer)
        )

    assert len(run_optimizer_models(cfg(False), policy)) == 3  # type: ignore[arg-type]
    assert run_optimizer_models(cfg(True), policy) == {}  # type: ignore[arg-type]
