"""A run directory decides what a resume loads, so only its owner may write there: an
existing one that belongs to someone else or that others can write to is refused in one
line before anything starts, and `pivot-hpc submit` leaves it (and submitit's job pickle,
which every allocation unpickles) private."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from pivot_hpc.cli.main import main
from pivot_hpc.job.config import load_config

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")


def _run(run_dir: Path, capsys, monkeypatch) -> tuple[int, str]:
    monkeypatch.setenv("PATH", str(run_dir.parent / "no-mpirun-here"))  # a launch fails loudly
    code = main(["run", TINY, "--run-dir", str(run_dir)])
    return code, capsys.readouterr().err.strip()


@pytest.mark.parametrize("part", ["", "checkpoints"])
@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757])
def test_a_run_dir_others_can_write_is_refused(
    tmp_path: Path, capsys, monkeypatch, part: str, mode: int
) -> None:
    run_dir = tmp_path / "run"
    (run_dir / part).mkdir(parents=True, mode=0o700, exist_ok=True)
    (run_dir / part).chmod(mode)
    code, err = _run(run_dir, capsys, monkeypatch)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"has mode {mode:o}" in err and "chmod go-w" in err and "mpirun" not in err


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a directory away")
def test_a_run_dir_someone_else_owns_is_refused(tmp_path: Path, capsys, monkeypatch) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    os.chown(run_dir, 65534, 65534)
    code, err = _run(run_dir, capsys, monkeypatch)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "belongs to uid 65534" in err


def _fake_slurm(bin_dir: Path) -> None:
    """sbatch that accepts any job (prints an id) and srun that exists: nothing runs."""
    bin_dir.mkdir()
    for name, body in (("sbatch", "echo 'Submitted batch job 4242'"), ("srun", "exit 1")):
        tool = bin_dir / name
        tool.write_text(f"#!/bin/sh\n{body}\n")
        tool.chmod(0o755)


def test_submit_makes_the_run_dir_and_job_pickle_private(tmp_path: Path, monkeypatch) -> None:
    from pivot_hpc.cli.submit import submit

    _fake_slurm(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    before = os.umask(0o022)
    try:
        job = submit(load_config(TINY), tmp_path / "run", time_min=15)
        assert os.umask(0o022) == 0o022  # the caller's umask is left as it was
    finally:
        os.umask(before)
    assert job.job_id == "4242"
    made = [tmp_path / "run", *(tmp_path / "run").rglob("*")]
    assert any(p.name.endswith("_submitted.pkl") for p in made)
    for p in made:
        mode = stat.S_IMODE(p.stat().st_mode)
        assert mode & 0o077 == 0, f"{p} has mode {mode:o}"


def test_submit_refuses_a_run_dir_others_can_write(tmp_path: Path, monkeypatch, capsys) -> None:
    _fake_slurm(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run_dir.chmod(0o777)
    assert main(["submit", TINY, "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "has mode 777" in err, err
    assert not (run_dir / "slurm").exists()


def test_rank_logs_append_and_never_follow_a_planted_link(tmp_path: Path) -> None:
    from pivot_hpc.runtime.library_noise import route_to_log
    from pivot_hpc.safe_files import UnsafeWriteError, open_for_write

    log = tmp_path / "logs" / "rank-0001.log"
    log.parent.mkdir()
    for line in ("one\n", "two\n"):
        with open_for_write(log, "a", private=False) as f:
            f.write(line)
    assert log.read_text() == "one\ntwo\n"
    victim = tmp_path / "victim"
    victim.write_text("keep")
    planted = tmp_path / "logs" / "rank-0002.log"
    planted.symlink_to(victim)
    with pytest.raises(UnsafeWriteError, match="symbolic link"):
        route_to_log(tmp_path, 2)
    assert victim.read_text() == "keep"
