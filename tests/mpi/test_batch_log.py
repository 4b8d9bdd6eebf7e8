"""The main job's log as a batch system keeps it: stdout and stderr in a file (as under
`sbatch`), the default tiny job including the creation of its models (SFT warm-up).

The whole log stays under 150 lines that a user would read: progress is a line every
PIVOT_HPC_PROGRESS_S seconds instead of a redrawn bar, library warnings go to the ranks'
log files (RUN_DIR/logs), and no terminal control codes end up in the file.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from live import ROOT, run_command

from pivot_hpc.progress import PROGRESS_ENV

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs OpenMPI (mpirun)")

MAX_LINES = 150
NOISE = re.compile(r"Warning|warnings\.warn|Traceback|it/s\]|\d+%\|")  # what a user skips


STEPS = 20  # a third of the default 60: every kind of line a step writes, eval included


@pytest.mark.timeout(1000)  # 20 steps plus both SFT warm-ups: ~2 min on 2 cores
def test_the_default_tiny_job_writes_a_short_plain_log(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    env = {k: v for k, v in os.environ.items() if k != PROGRESS_ENV}  # the default interval
    with log.open("w") as out:  # a file, not a terminal, for every rank and the launcher
        code = subprocess.run(
            run_command(
                tmp_path / "run", f"models.cache_dir={tmp_path / 'cache'}", f"loop.steps={STEPS}"
            ),
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=960,
            env=env,
        ).returncode
    text = log.read_text()
    lines = text.splitlines()
    assert code == 0, text[-5000:]
    assert len(lines) < MAX_LINES, f"{len(lines)} lines:\n{text}"
    assert "\r" not in text and "\x1b" not in text, "terminal control codes in a batch log"
    noisy = [line for line in lines if NOISE.search(line)]
    assert not noisy, "\n".join(noisy)
    assert not [line for line in lines if not line.strip()], "blank lines"
    # what the user reads: both models created (with their progress), one line per step
    for kind in ("policy", "genrm"):
        assert f"pivot-hpc: creating the tiny {kind} " in text
        assert re.search(rf"SFT warm-up of the tiny {kind}: 300/300 steps done in \d", text)
    assert len(re.findall(rf"^step \d+/{STEPS} ", text, flags=re.M)) == STEPS
    assert f"pivot-hpc: done: {STEPS} steps" in text
    # the library noise went to the ranks' log files
    assert (tmp_path / "run" / "logs" / "rank-0000.log").is_file()
