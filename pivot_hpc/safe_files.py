"""Opening files of a run directory without being redirected or blocked by what it holds.

A run directory may come from someone else ("please look at my run"): a `trace.json` or a
checkpoint file planted there as a symbolic link would make a plain `open(path, "w")`
overwrite whatever the link points to, with the rights of the user running pivot-hpc.
`open_for_write` refuses that in one line instead. Reading has its own trap: `mkfifo`
needs no privilege and `cp -a`, `tar` and `rsync -a` carry FIFOs along, and a plain
`open(path)` of a FIFO waits for a writer for ever. `open_for_read` refuses anything but
a regular file before it reads a byte.
"""

from __future__ import annotations

import io
import os
import stat
from typing import IO

from pivot_hpc.errors import PivotError

_MODES = ("w", "wb", "a")


class UnsafeWriteError(PivotError, OSError):
    """An output path that is a symbolic link, not a regular file, or cannot be opened.
    An OSError too, so that callers which handle write failures keep doing so."""


def open_for_write(path: str | os.PathLike[str], mode: str = "w", *, private: bool = True) -> IO:
    """Open `path` for writing, truncated, as text (`mode="w"`, UTF-8) or bytes (`"wb"`),
    or for appending text, line-buffered (`"a"`: a log file).

    The last path component is never followed if it is a symbolic link, and anything but
    a regular file with a single name (a FIFO, a device, a hard link into another
    directory) is refused: UnsafeWriteError, one line naming the path. `private`: the file
    is created, or left, readable by its owner only (0600); otherwise it is created
    0666 minus the umask, like `open`. Use it as a context manager like `open`'s result.
    """
    if mode not in _MODES:
        raise ValueError(f"open_for_write mode {mode!r}: use one of {_MODES}")
    # No O_TRUNC yet: what is there is checked first, so that a refused file keeps its
    # bytes. O_NONBLOCK: opening a planted FIFO must fail or return, never wait for a reader.
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if mode == "a":
        flags |= os.O_APPEND
    try:
        fd = os.open(path, flags, 0o600 if private else 0o666)
    except OSError as exc:
        raise _refusal(path, exc) from None
    try:
        _check_target(path, fd)
        os.set_blocking(fd, True)
        if private:
            os.fchmod(fd, 0o600)
        if mode != "a":
            os.ftruncate(fd, 0)
    except BaseException as exc:
        os.close(fd)
        if isinstance(exc, OSError) and not isinstance(exc, PivotError):
            raise _refusal(path, exc) from None
        raise
    raw = io.FileIO(fd, "w", closefd=True)
    if mode == "wb":
        return io.BufferedWriter(raw)
    return io.TextIOWrapper(io.BufferedWriter(raw), encoding="utf-8", line_buffering=mode == "a")


def _check_target(path: str | os.PathLike[str], fd: int) -> None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeWriteError(
            f"{os.fspath(path)}: not a regular file; refusing to write to it (remove it, or "
            "write somewhere else)"
        )
    if st.st_nlink > 1:
        # Truncating a second name of another file would change that file too.
        raise UnsafeWriteError(
            f"{os.fspath(path)}: has {st.st_nlink} hard links; refusing to overwrite it "
            "(remove it, or write somewhere else)"
        )


def _refusal(path: str | os.PathLike[str], exc: OSError) -> UnsafeWriteError:
    p = os.fspath(path)
    try:
        st_mode = os.lstat(p).st_mode
    except OSError:
        st_mode = 0
    if stat.S_ISLNK(st_mode):  # O_NOFOLLOW answers ELOOP (Linux) or EMLINK (BSD)
        why = "is a symbolic link; refusing to write through it (remove it, or write "
        why += "somewhere else)"
    elif st_mode and not stat.S_ISREG(st_mode) and not stat.S_ISDIR(st_mode):
        why = "not a regular file; refusing to write to it (remove it, or write somewhere else)"
    else:
        why = f"cannot write ({exc.strerror or exc})"
    err = UnsafeWriteError(f"{p}: {why}")
    err.errno = exc.errno  # for callers that look at it; the message stays one line
    return err


class UnsafeReadError(PivotError, OSError):
    """An input path that is a symbolic link or not a regular file (a FIFO, a socket, a
    device): refused before anything is read, so a planted FIFO cannot block the reader."""


def open_for_read(path: str | os.PathLike[str]) -> IO[bytes]:
    """Open regular file `path` for reading bytes, without following a symbolic link in its
    last component and without waiting on a FIFO (O_NONBLOCK, then checked on the open
    descriptor): UnsafeReadError, one line naming the path, for anything else."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    p = os.fspath(path)
    try:
        fd = os.open(p, flags)
    except OSError as exc:
        try:
            kind = _kind(os.lstat(p).st_mode)
        except OSError:
            kind = None
        why = f"is {kind}" if kind else f"cannot be read ({exc.strerror or exc})"
        err = UnsafeReadError(f"{p}: {why}")
        err.errno = exc.errno
        raise err from None
    try:
        kind = _kind(os.fstat(fd).st_mode)
        if kind:
            raise UnsafeReadError(f"{p}: is {kind}, not a regular file; refusing to read it")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return io.BufferedReader(io.FileIO(fd, "r", closefd=True))


def _kind(mode: int) -> str | None:
    """What a file that is not a regular one is ("a FIFO" …); None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    for test, name in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def special_kind(path: str | os.PathLike[str]) -> str | None:
    """What `path` is if it is neither a regular file nor a directory (a symbolic link is
    named as one, not followed); None otherwise, or when it does not exist."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    return None if stat.S_ISDIR(mode) else _kind(mode)
