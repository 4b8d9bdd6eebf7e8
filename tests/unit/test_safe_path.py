"""Issue 49, finding 1: no Python process pivot_hpc starts imports a module planted in the
directory it was started from. `python -m`/`-c` put that directory first on sys.path; every
interpreter the project starts runs with `-P` and PYTHONSAFEPATH=1 (pivot_hpc/interpreter.py).
The planted module here stands for one another user dropped in a shared directory: it
leaves a marker and ends its process, so any process that imported it either fails or is
found out. The whole tiny job from such a directory: tests/mpi/test_safe_path_live.py."""

from __future__ import annotations

import os
import re
import shlex
import sys
import time
from pathlib import Path

import pytest

from pivot_hpc import interpreter

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")
# Modules the job's processes import late (socket imports selectors; json, typing, enum
# everywhere): any of them planted in the working directory would do.
PLANTED = ("selectors", "json", "typing", "enum", "struct", "fcntl")


def plant(where: Path, marker_dir: Path) -> Path:
    """A directory holding modules that leave a marker and exit 99 when imported."""
    where.mkdir(parents=True, exist_ok=True)
    for name in PLANTED:
        (where / f"{name}.py").write_text(
            "import os\n"
            f"open(os.path.join({str(marker_dir)!r}, 'ran-{name}-%d' % os.getpid()), 'w')"
            ".close()\n"
            "os._exit(99)\n"
        )
    return where


def markers(marker_dir: Path) -> list[str]:
    return sorted(p.name for p in marker_dir.glob("ran-*"))


def test_the_project_starts_python_with_safe_path() -> None:
    assert interpreter.python("-m", "x") == [sys.executable, "-P", "-m", "x"]
    env = interpreter.environ({"PATH": "/bin"})
    assert env["PYTHONSAFEPATH"] == "1" and env["PATH"] == "/bin"


def test_pythonpath_entries_that_name_the_working_directory_are_dropped() -> None:
    env = interpreter.environ({"PYTHONPATH": f":/opt/lib{os.pathsep}.{os.pathsep}rel"})
    entries = env["PYTHONPATH"].split(os.pathsep)
    assert "/opt/lib" in entries and all(os.path.isabs(p) for p in entries), entries
    none = interpreter.environ({"PYTHONPATH": os.pathsep}).get("PYTHONPATH", "")
    assert all(os.path.isabs(p) for p in none.split(os.pathsep) if none), none


def test_the_ranks_are_started_with_safe_path(tmp_path: Path, monkeypatch) -> None:
    """What `pivot-hpc run` hands mpirun as every rank's command line."""
    from pivot_hpc.cli import local_world
    from pivot_hpc.cli.main import main

    seen: list[list[str]] = []
    monkeypatch.setattr(local_world, "launch", lambda cfg, argv, run_dir: seen.append(argv) or 0)
    assert main(["run", TINY, "--run-dir", str(tmp_path / "run"), "loop.steps=1"]) == 0
    (argv,) = seen
    assert argv[:4] == [sys.executable, "-P", "-m", "pivot_hpc"], argv


@pytest.mark.timeout(60)
def test_loopback_probe_ignores_a_planted_module(tmp_path: Path, monkeypatch) -> None:
    """The probe of the private network namespace and the process that execs mpirun."""
    from pivot_hpc.cli import local_world

    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.chdir(plant(tmp_path / "cwd", marks))
    prefix, why = local_world.namespace_prefix()
    if why is not None and "no private network namespace" not in why:
        pytest.skip(why)  # no unshare here: nothing of ours started
    assert markers(marks) == [] and why is None, (why, markers(marks))
    assert prefix[-4:] == [sys.executable, "-P", "-m", "pivot_hpc.cli.loopback_up"]


@pytest.mark.timeout(120)
def test_the_sandbox_service_ignores_a_planted_module(tmp_path: Path, monkeypatch) -> None:
    from pivot_hpc.agentic.config import ToolsConfig
    from pivot_hpc.agentic.messages import ToolCall
    from pivot_hpc.runtime.host_tools import HostToolService

    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.chdir(plant(tmp_path / "cwd", marks))
    svc = HostToolService.start(ToolsConfig(enabled=True), node=0)
    try:
        svc.wait_ready(60)
        svc.submit(ToolCall(1, 1, "calculator", '{"expression": "6*7"}', 5.0))
        results, end = [], time.monotonic() + 30
        while not results and time.monotonic() < end:
            results = svc.poll()
            time.sleep(0.02)
        assert [(r.status, r.text) for r in results] == [("ok", "42")], results
    finally:
        svc.close()
    assert markers(marks) == []


def test_pivot_sbatch_starts_python_with_safe_path() -> None:
    """slurm/pivot.sbatch: its config check and every rank (srun) get -P; what they start
    gets PYTHONSAFEPATH."""
    script = (REPO / "slurm" / "pivot.sbatch").read_text()
    calls = re.findall(r'"\$PY"\s+(\S+)', script)
    assert calls and all(flag == "-P" for flag in calls), calls
    assert re.search(r"^export PYTHONSAFEPATH=1$", script, re.M)


def test_submitit_runs_its_tasks_with_safe_path(tmp_path: Path, monkeypatch) -> None:
    """`pivot-hpc submit`: submitit's runner on every task is `python -P -u -m
    submitit.core._submit`, and the batch script exports PYTHONSAFEPATH."""
    from pivot_hpc.cli.submit import submit
    from pivot_hpc.job.config import load_config

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("sbatch", "echo 'Submitted batch job 4242'"), ("srun", "exit 1")):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    submit(load_config(TINY), tmp_path / "run", time_min=15)
    (script,) = (tmp_path / "run" / "slurm").glob("*_submission.sh")
    text = script.read_text()
    runner = f"{shlex.quote(sys.executable)} -P -u -m submitit.core._submit"
    assert runner in text, text
    assert "export PYTHONSAFEPATH=1" in text, text
