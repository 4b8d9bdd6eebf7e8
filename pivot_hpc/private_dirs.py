"""Directories whose contents decide what this user's job runs: only this user may write.

A run directory, the model cache and the compile caches all hold what a job loads without
asking (a checkpoint, the tiny models' weights and tokenizer, compiled kernels that are
`dlopen`ed). A directory that belongs to someone else, or that group or others may write
to, lets them choose it; so such a directory is refused in one line, and one made here is
made 0700. The same rule as runtime/run_dir.check_owned, for the other directories.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from pivot_hpc.errors import UsageError


def problem(path: Path) -> str | None:
    """Why `path` may not hold what a job loads (None: it may, or it does not exist)."""
    try:
        st = path.stat()  # a link is followed: whoever owns what it leads to decides
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != os.getuid():
        return f"belongs to uid {st.st_uid}, not to you (uid {os.getuid()})"
    if st.st_mode & 0o022:
        return f"has mode {st.st_mode & 0o7777:o}, writable by others"
    return None


def check(paths: list[Path], what: str, fix: str) -> None:
    """UsageError naming the first of `paths` that `problem` refuses: '<what> <path> <why>;
    whoever can write there decides what your job loads: <fix>'."""
    for path in paths:
        why = problem(path)
        if why is not None:
            raise UsageError(
                f"{what} {path} {why}; whoever can write there decides what your job loads: {fix}"
            )


def ensure(path: Path, what: str, fix: str, *, up_to: Path | None = None) -> Path:
    """`path`, made 0700 if absent (its missing parents too), after `check` on it and on
    each directory between `up_to` (an ancestor of it) and it."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{what} {path} cannot be created ({exc.strerror}): {fix}") from None
    chain = [path]
    if up_to is not None and path.is_relative_to(up_to):
        parts = path.relative_to(up_to).parts
        chain = [up_to.joinpath(*parts[:i]) for i in range(len(parts) + 1)]
    check(chain, what, fix)
    return path
