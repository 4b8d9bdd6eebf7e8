"""The run directory: checked before anything starts, private unless the user says not.

A run directory holds the policy's weights, the optimizer and RL state and the telemetry,
so by default only its owner can read it: every rank runs with umask 077 (directories
700, files 600) and a new run directory is made 700. `checkpoint.private_run_dir=false`
keeps the user's umask (e.g. to share runs with a group); a directory the user made
beforehand keeps the mode it has.

Whoever can write to a run directory decides what the next resume loads, so an existing
one (or its checkpoints/ and slurm/ folders) that belongs to someone else, or that group
or others may write to, is refused before anything starts.
"""

from __future__ import annotations

import os
from pathlib import Path

from pivot_hpc.errors import UsageError

PRIVATE_UMASK = 0o077
PARTS = ("checkpoints", "telemetry", "logs")  # what a run writes under its directory
# what decides what a resume runs: the run dir, its checkpoints, submitit's job pickles
_TRUSTED = ("", "checkpoints", "slurm")


def check(run_dir: Path) -> None:
    """One clear line when `run_dir` cannot be a directory."""
    for parent in (run_dir, *run_dir.parents):
        if parent.exists() and not parent.is_dir():
            raise UsageError(
                f"--run-dir {run_dir}: {parent} is a file, not a directory; choose another path"
            )
    for part in PARTS:
        if (run_dir / part).exists() and not (run_dir / part).is_dir():
            raise UsageError(
                f"--run-dir {run_dir}: {run_dir / part} is a file where the run keeps its "
                f"{part} directory; move it aside or choose another --run-dir"
            )


def prepare(run_dir: Path, private: bool) -> None:
    """Set this process's umask (inherited by what it launches) and make `run_dir`."""
    check(run_dir)
    if private:
        os.umask(PRIVATE_UMASK)
    try:
        run_dir.mkdir(parents=True, exist_ok=True, mode=0o700 if private else 0o777)
    except OSError as exc:
        raise UsageError(f"--run-dir {run_dir}: cannot create it ({exc.strerror})") from None
    check_owned(run_dir)


def check_owned(run_dir: Path) -> None:
    """One line when someone other than this user could change what a resume loads."""
    for part in _TRUSTED:
        path = run_dir / part
        try:
            st = path.stat()
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise UsageError(f"--run-dir {run_dir}: cannot read {path} ({exc.strerror})") from None
        if st.st_uid != os.getuid():
            raise UsageError(
                f"--run-dir {run_dir}: {path} belongs to uid {st.st_uid}, not to you (uid "
                f"{os.getuid()}); whoever owns it decides what a resume runs: use a run "
                "directory of your own"
            )
        if st.st_mode & 0o022:
            raise UsageError(
                f"--run-dir {run_dir}: {path} has mode {st.st_mode & 0o7777:o}, writable by "
                "others, who could plant a checkpoint that your resume would load: "
                f"chmod go-w {path}, or use a new --run-dir"
            )
