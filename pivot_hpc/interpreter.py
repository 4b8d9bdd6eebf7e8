"""How pivot_hpc starts Python: never with the working directory on `sys.path`.

`python -m mod` and `python -c code` put the current directory first on `sys.path`, ahead
of the standard library, so a module planted there (a `selectors.py` in a shared project
directory, in /tmp, in the Slurm submission directory, in a colleague's run directory one
`cd`s into) would run in that process: every rank, the node's sandbox service. So every
interpreter pivot_hpc starts gets `-P` (Python >= 3.11: no such entry), and the job's
environment carries PYTHONSAFEPATH=1, so that what those processes start in turn (vLLM's
and torch inductor's workers, multiprocessing's spawn, megatron's checkpoint Manager)
leaves it out as well.

One case needed the current directory: pivot_hpc run from a source checkout that is not
installed (`python -m pivot_hpc` in the repository root). There the package's own parent
directory, which is where its code is and not whatever the working directory holds, goes
on PYTHONPATH instead (`environ`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

SAFE_PATH_ENV = "PYTHONSAFEPATH"
_PACKAGE_PARENT = Path(__file__).resolve().parents[1]


def python(*args: str) -> list[str]:
    """The argv of a Python process of this job: this interpreter, `-P`, then `args`."""
    return [sys.executable, "-P", *args]


def environ(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (this process's environment by default) for a Python process of this job:
    PYTHONSAFEPATH=1, and pivot_hpc's parent directory on PYTHONPATH when this process
    found pivot_hpc only through the directory `-P` leaves out."""
    env = dict(os.environ if base is None else base)
    env[SAFE_PATH_ENV] = "1"
    # an empty or relative PYTHONPATH entry (`PYTHONPATH=$PYTHONPATH:/x` with it unset
    # gives ":/x") names the working directory again, whatever -P says: dropped
    given = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if os.path.isabs(p)]
    extra = _found_only_through_cwd()
    if extra is not None and extra not in given:
        given.insert(0, extra)
    if given:
        env["PYTHONPATH"] = os.pathsep.join(given)
    else:
        env.pop("PYTHONPATH", None)
    return env


def _found_only_through_cwd() -> str | None:
    """pivot_hpc's parent directory if the only entry of this process's `sys.path` that
    names it is the first (the working directory or the script's, which `-P` drops)."""
    parent = str(_PACKAGE_PARENT)

    def same(p: str) -> bool:
        try:
            return os.path.realpath(p or os.getcwd()) == parent
        except OSError:
            return False

    if not sys.path or not same(sys.path[0]) or sys.flags.safe_path:
        return None
    return None if any(same(p) for p in sys.path[1:] if p) else parent
