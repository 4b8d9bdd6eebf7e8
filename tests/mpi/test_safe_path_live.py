"""Issue 49, finding 1, live: a tiny job with tools, started from a directory another user
could write to (modules planted there leave a marker and exit 99 when imported), runs to
the end, and no process of it (launcher probe, mpirun's loopback_up, every rank, the
node's sandbox service, its tool calls, engine children) imported any of them. The
launcher stands for the `pivot-hpc` console script, whose own directory, not the working
directory, is its sys.path[0]: `python -P -m pivot_hpc`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_safe_path import markers, plant

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs OpenMPI (mpirun)")
ROOT = Path(__file__).parents[2]


@pytest.mark.timeout(900)
def test_a_job_started_among_planted_modules_imports_none_of_them(tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    cwd = plant(tmp_path / "shared", marks)
    cmd = [sys.executable, "-P", "-m", "pivot_hpc", "run", str(ROOT / "configs" / "tiny.yaml")]
    cmd += ["--run-dir", str(tmp_path / "run"), "loop.steps=1", "loop.batch_prompts=4"]
    cmd += ["loop.eval_every_steps=0", "tools.enabled=true"]
    # (no empty entry: PYTHONPATH "ROOT:" would name the working directory for the
    # launcher itself, before pivot_hpc runs; its children get such entries dropped)
    given = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *given])}
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=840, env=env)
    assert markers(marks) == [], (markers(marks), out.stderr[-3000:])
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "pivot-hpc: done: 1 steps" in out.stdout, out.stdout[-2000:]
