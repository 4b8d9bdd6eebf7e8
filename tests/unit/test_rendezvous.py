"""Where the training world meets (issue 49 #3): a file store nobody else can open, never a
TCP store listening on every interface. Across nodes the file is in RUN_DIR/.rendezvous
(0700, the run directory's shared filesystem), new at every launch; a directory someone
else owns or may write is refused."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

from pivot_hpc.engines.base import STORE_ENV
from pivot_hpc.errors import UsageError
from pivot_hpc.runtime.training_world import RENDEZVOUS_DIR, TrainingWorld, rendezvous


class WorldOfOne:
    """An MPI communicator of one rank, as far as `rendezvous` uses it (MPI itself is not
    initialised in test processes; tests/mpi runs the real world)."""

    def Get_rank(self) -> int:
        return 0

    def bcast(self, obj, root: int = 0):
        return obj


SELF = WorldOfOne()


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for k in (STORE_ENV, "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)


def _cfg(nodes: int) -> SimpleNamespace:
    return SimpleNamespace(cluster=SimpleNamespace(nodes=nodes))


def test_across_nodes_the_world_meets_in_a_private_file_of_the_run_directory(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    (run_dir / RENDEZVOUS_DIR).mkdir(mode=0o700)
    stale = run_dir / RENDEZVOUS_DIR / "train-earlier"
    stale.write_text("keys of a launch that died")
    rendezvous(SELF, _cfg(2), run_dir)
    store = Path(os.environ[STORE_ENV])
    assert store.parent == run_dir / RENDEZVOUS_DIR and not stale.exists()
    assert stat.S_IMODE(store.parent.stat().st_mode) == 0o700
    assert "MASTER_ADDR" not in os.environ and "MASTER_PORT" not in os.environ
    rendezvous(SELF, _cfg(2), run_dir)
    assert Path(os.environ[STORE_ENV]) != store  # a new file at every launch
    # trainer children of each generation meet beside it
    env = TrainingWorld(ranks=(1, 2), base=(1,), tp=1).trainer_env(2, child=True, generation=3)
    assert env == {"RANK": "1", "WORLD_SIZE": "2", STORE_ENV: f"{os.environ[STORE_ENV]}.trainers3"}


def test_on_one_node_it_meets_in_a_private_temporary_directory(tmp_path):
    rendezvous(SELF, _cfg(1), tmp_path)
    store = Path(os.environ[STORE_ENV])
    assert not (tmp_path / RENDEZVOUS_DIR).exists()
    assert stat.S_IMODE(store.parent.stat().st_mode) == 0o700


def test_a_rendezvous_directory_others_may_write_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    (run_dir / RENDEZVOUS_DIR).mkdir()
    os.chmod(run_dir / RENDEZVOUS_DIR, 0o777)
    with pytest.raises(UsageError) as err:
        rendezvous(SELF, _cfg(2), run_dir)
    assert "\n" not in str(err.value) and RENDEZVOUS_DIR in str(err.value)
