"""Worker GPU binding (runtime/devices.py) for each way a launcher shows GPUs to a rank,
the replica GPU lists an SGLang leader starts with, and taking SIGTERM back
(runtime/stop.reinstall)."""

from __future__ import annotations

import signal

import pytest

from pivot_hpc.engines.sglang.launch import replica_gpus
from pivot_hpc.runtime import devices, stop
from pivot_hpc.runtime.devices import NODE_GPUS_ENV, PlacementError, bind_worker_gpu

PER_NODE = 5  # 4 GPUs + the host rank


def _proc(tmp_path, n: int):
    d = tmp_path / "gpus"
    d.mkdir(parents=True)
    for i in range(n):
        (d / f"0000:0{i}:00.0").mkdir()
    return d


def test_every_gpu_visible_each_worker_takes_its_slot(tmp_path):
    no_driver = tmp_path / "none"
    for rank, want in ((1, "0"), (4, "3"), (6, "0"), (9, "3")):  # two nodes, block order
        env = {"OMPI_COMM_WORLD_RANK": str(rank)}
        b = bind_worker_gpu(PER_NODE, 4, env, proc=_proc(tmp_path / str(rank), 4))
        assert b is not None and b.gpu == want and b.slot == int(want)
        assert env["CUDA_VISIBLE_DEVICES"] == want and env["LOCAL_RANK"] == "0"
        assert env[NODE_GPUS_ENV] == "0,1,2,3"
    env = {"SLURM_PROCID": "3", "CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b,GPU-c,GPU-d"}
    assert bind_worker_gpu(PER_NODE, 4, env, proc=no_driver).gpu == "GPU-c"  # srun's list


def test_per_task_binding_is_kept(tmp_path):
    env = {"PMIX_RANK": "3", "CUDA_VISIBLE_DEVICES": "6"}
    b = bind_worker_gpu(PER_NODE, 4, env, proc=tmp_path / "none")
    assert b.gpu == "6" and b.node_gpus == () and env[NODE_GPUS_ENV] == ""


def test_hosts_cpu_runs_and_no_world_are_left_alone(tmp_path):
    none = tmp_path / "none"
    host = {"OMPI_COMM_WORLD_RANK": "5", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    assert bind_worker_gpu(PER_NODE, 4, host, proc=none) is None
    assert host["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    cpu = {"OMPI_COMM_WORLD_RANK": "2"}  # no driver, nothing set: a CPU machine
    assert bind_worker_gpu(PER_NODE, 4, cpu, proc=none) is None and cpu == {
        "OMPI_COMM_WORLD_RANK": "2"
    }
    hidden = {"OMPI_COMM_WORLD_RANK": "2", "CUDA_VISIBLE_DEVICES": ""}  # the dry run's way
    assert bind_worker_gpu(PER_NODE, 4, hidden, proc=_proc(tmp_path, 4)) is None
    assert bind_worker_gpu(PER_NODE, 4, {}, proc=_proc(tmp_path / "x", 4)) is None


def test_a_gpu_count_that_fits_no_rule_names_the_key(tmp_path):
    env = {"OMPI_COMM_WORLD_RANK": "0", "CUDA_VISIBLE_DEVICES": "0,1"}  # the host fails too
    with pytest.raises(PlacementError, match=r"cluster\.gpus_per_node.*sees 2 GPUs"):
        bind_worker_gpu(PER_NODE, 4, env, proc=tmp_path / "none")


def test_replica_gpus(monkeypatch):
    env = {NODE_GPUS_ENV: "0,1,2,3", "CUDA_VISIBLE_DEVICES": "2"}
    assert replica_gpus(2, 2, "reward.tp", env) == "2,3"
    assert replica_gpus(2, 1, "reward.tp", env) == "2"
    with pytest.raises(PlacementError, match=r"reward\.tp.*one node"):
        replica_gpus(2, 4, "reward.tp", env)
    per_task = {NODE_GPUS_ENV: "", "CUDA_VISIBLE_DEVICES": "7"}
    assert replica_gpus(0, 1, "reward.tp", per_task) == "7"
    with pytest.raises(PlacementError, match=r"reward\.tp.*one GPU per task"):
        replica_gpus(0, 2, "reward.tp", per_task)
    assert replica_gpus(0, 2, "reward.tp", {}) is None  # unbound (tests, CPU): leave it
    assert devices.world_rank({"PMI_RANK": "4"}) == 4 and devices.world_rank({}) is None


def test_reinstall_puts_our_handlers_back(monkeypatch):
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)}
    try:
        monkeypatch.setattr(stop, "_installed", False)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # someone else's
        assert stop.reinstall() is False
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        stop.install()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        assert stop.reinstall() is True and stop.installed()
        assert signal.getsignal(signal.SIGTERM) == stop._handler
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
