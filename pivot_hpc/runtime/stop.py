"""Graceful stop on a signal: checkpoint, then exit with EXIT_REQUEUE.

Slurm sends SIGUSR1 before the time limit (`--signal=B:USR1@N`, forwarded to every task
by slurm/pivot.sbatch) and SIGTERM on preemption or `scancel`. Every rank installs the
same handler; only the coordinator acts on it (it drains, checkpoints and tells all ranks
to exit), the others keep serving until it does. A second signal is not needed and
changes nothing.

`pivot-hpc run` on a workstation passes a SIGTERM it receives on as SIGUSR2
(`FORWARDED_TERM`): mpirun forwards USR1/USR2 to the ranks but kills them on TERM. The
ranks record it as the SIGTERM it was.

Libraries may take a signal over: SGLang's first request installs its own SIGTERM handler
(drain, then `sys.exit(0)`: a preempted job would exit without its checkpoint). Whoever
starts such a library calls `reinstall()` afterwards.
"""

from __future__ import annotations

import signal

EXIT_REQUEUE = 3  # "checkpointed, not finished: run me again with the same run dir"
SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
FORWARDED_TERM = signal.SIGUSR2

_requested: str | None = None
_installed = False


def _handler(signum, _frame) -> None:
    global _requested
    if _requested is None:
        signum = signal.SIGTERM if signum == FORWARDED_TERM else signum
        _requested = signal.Signals(signum).name


def install() -> None:
    global _installed
    for s in (*SIGNALS, FORWARDED_TERM):
        signal.signal(s, _handler)
    _installed = True


def installed() -> bool:
    return _installed


def reinstall() -> bool:
    """Put our handlers back if `install` ran (checkpoint.on_signal), else restore the
    default SIGTERM action (the process ends); returns whether ours are in place."""
    if _installed:
        install()
    else:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return _installed


def requested() -> str | None:
    """The name of the first stop signal received, or None."""
    return _requested


def request(reason: str) -> None:
    """Ask for a graceful stop from code (tests, the submitit checkpoint hook)."""
    global _requested
    if _requested is None:
        _requested = reason
