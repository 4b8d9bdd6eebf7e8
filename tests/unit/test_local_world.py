"""The world `pivot-hpc run` starts by itself: checks before launch, private run dirs,
exit status through a file, deaths named by role, SIGTERM passed on as itself."""

from __future__ import annotations

import os
import signal
import stat
from pathlib import Path

import pytest

from pivot_hpc.cli import local_world
from pivot_hpc.cli.main import main
from pivot_hpc.job.config import load_config
from pivot_hpc.runtime import run_dir as run_dirs
from pivot_hpc.runtime import stop

TINY = str(Path(__file__).parents[2] / "configs" / "tiny.yaml")

# what OpenMPI 4.1's mpirun printed when `kill -9` hit world rank 3
MPIRUN_DEATH = """\
--------------------------------------------------------------------------
Primary job  terminated normally, but 1 process returned
a non-zero exit code. Per user-direction, the job has been aborted.
--------------------------------------------------------------------------
--------------------------------------------------------------------------
mpirun noticed that process rank 3 with PID 0 on node vm exited on signal 9 (Killed).
--------------------------------------------------------------------------
"""


@pytest.mark.parametrize(
    ("override", "names"),
    [
        ("rollout.tp=2", "rollout.tp=2 with engines.rollout.engine=hf"),
        ("reward.tp=2", "reward.tp=2 with engines.reward.engine=hf"),
        ("rl.trainer.tp=3", "rl.trainer.tp=3"),
    ],
)
def test_live_only_limits_are_refused_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], override: str, names: str
) -> None:
    assert main(["run", TINY, "--run-dir", str(tmp_path / "r"), override]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and names in err
    assert not (tmp_path / "r").exists()  # nothing was made, nothing launched


def test_new_run_dirs_are_private(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        run_dirs.prepare(tmp_path / "a" / "run", private=True)
        assert stat.S_IMODE((tmp_path / "a" / "run").stat().st_mode) == 0o700
        (tmp_path / "a" / "run" / "f").write_text("x")
        assert stat.S_IMODE((tmp_path / "a" / "run" / "f").stat().st_mode) == 0o600
        os.umask(0o022)
        run_dirs.prepare(tmp_path / "shared", private=False)
        assert stat.S_IMODE((tmp_path / "shared").stat().st_mode) == 0o755
    finally:
        os.umask(old)


@pytest.mark.parametrize("part", run_dirs.PARTS)
def test_a_file_where_the_run_keeps_a_directory_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], part: str
) -> None:
    (tmp_path / part).write_text("")
    assert main(["run", TINY, "--run-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{tmp_path / part} is a file" in err


def test_a_dead_rank_is_named_by_role_with_how_to_resume(tmp_path: Path) -> None:
    cfg = load_config(TINY, [])
    tail = local_world._Tail()
    tail.lines.extend(MPIRUN_DEATH.splitlines(keepends=True))
    assert tail.dead_rank() == (3, 9)
    line = local_world._death_line(cfg, tail, 137, tmp_path)
    assert "rank 3, the worker of GPU 2 (node 0), was killed by SIGKILL" in line
    assert "out-of-memory" in line and "starts over" in line
    assert local_world.role_of_rank(cfg, 0).startswith("the coordinator")


def test_ranks_leave_their_status_for_the_launcher(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert local_world.report_status(3) == 3  # no launcher of ours: the plain way
    monkeypatch.setenv(local_world.STATUS_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "2")
    assert local_world.report_status(0) == 0 and not any(tmp_path.iterdir())
    assert local_world.report_status(3) == 0
    assert (tmp_path / "rank-2").read_text() == "3"


def test_private_network_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(local_world.PRIVATE_NET_ENV, "0")
    assert local_world.namespace_prefix() == ([], "PIVOT_HPC_PRIVATE_NET=0")


def test_a_forwarded_sigterm_is_recorded_as_sigterm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stop, "_requested", None)
    saved = {s: signal.getsignal(s) for s in (*stop.SIGNALS, stop.FORWARDED_TERM)}
    try:
        stop.install()
        os.kill(os.getpid(), stop.FORWARDED_TERM)
        assert stop.requested() == "SIGTERM"
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
