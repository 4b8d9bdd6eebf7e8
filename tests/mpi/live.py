"""Shared by the live-runtime tests: the `pivot-hpc run` command line of the tiny config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).parents[2]


def run_command(run_dir: Path, *overrides: str, config: str = "configs/tiny.yaml") -> list[str]:
    """`python -m pivot_hpc run CONFIG --run-dir RUN_DIR OVERRIDES…` (cwd: ROOT)."""
    return [
        sys.executable,
        "-m",
        "pivot_hpc",
        "run",
        config,
        "--run-dir",
        str(run_dir),
        *overrides,
    ]


def start_job(command: list[str], log: Path, **env: str) -> subprocess.Popen:
    """Start a job (cwd: ROOT, `env` added to this environment) writing to `log`, in a
    session of its own: mpirun and its ranks share it, so a test can signal them all."""
    return subprocess.Popen(
        command,
        cwd=ROOT,
        stdout=open(log, "w"),  # the child keeps it; closed when it exits
        stderr=subprocess.STDOUT,
        env={**os.environ, **env},
        start_new_session=True,
    )


def wait_for(log: Path, text: str, proc: subprocess.Popen, timeout: float) -> None:
    """Until `text` appears in a job's log (an AssertionError with the log's tail if the
    job exits first or `timeout` seconds pass)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if text in log.read_text():
            return
        if proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode} before {text!r}:\n{log.read_text()}")
        time.sleep(0.05)
    raise AssertionError(f"no {text!r} within {timeout}s:\n{log.read_text()[-3000:]}")


def report_json(run_dir: Path) -> dict:
    """`pivot-hpc report RUN_DIR --json`, as a user would run it."""
    out = subprocess.run(
        [sys.executable, "-m", "pivot_hpc", "report", str(run_dir), "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)
