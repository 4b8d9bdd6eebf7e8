"""Engine processes are children of their worker rank, started so that the job's signals
reach only our ranks.

Slurm signals every process of a step, not only the task it launched: the time-limit
warning (`--signal=USR1@N`), preemption and `scancel` (TERM) go to every pid in the
step's container (proctrack), engine children included. A child with the default
disposition dies, its rank loses its engine, and the job requeues from the previous
checkpoint instead of writing one. Our ranks handle these signals (runtime/stop.py);
engine children must not act on them at all.

A disposition set to SIG_IGN survives fork and exec (a handler does not), and nothing in
an engine child sets these signals again, so children are started with the job's stop
signals ignored — only for the instant of the fork, so that the rank itself keeps its
own handlers and misses no signal. `spawn_shielded()` does that for children started
directly (`subprocess`: engines/process/child.py, which hosts the `hf` engine or vLLM with its engine
core in-process), `shielded()` for those a library starts through `multiprocessing`
(SGLang's scheduler and detokenizer). The rank stops its children itself (close, then
SIGKILL), and a child also exits when its rank's pipe closes.
"""

from __future__ import annotations

import contextlib
import multiprocessing.util
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

# what Slurm and our launcher send to every process of a job (runtime/stop.py)
JOB_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def _ignored_for_fork() -> Iterator[None]:
    """SIG_IGN for the job's signals around one fork+exec, on the main thread (the only
    one that may change dispositions); the rank's own handlers are back right after. The
    main thread blocks them meanwhile, so one that arrives then is delivered afterwards
    (Linux never drops a blocked signal as ignored)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # cannot change dispositions here: the child relies on its own setup
        return
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, JOB_SIGNALS)
    saved = {s: signal.signal(s, signal.SIG_IGN) for s in JOB_SIGNALS}
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def spawn_shielded(start: Callable[[], Any]) -> Any:
    """`start()` (a `subprocess.Popen(...)`) with the job's signals ignored in the child."""
    with _ignored_for_fork():
        return start()


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """Inside, every process `multiprocessing` spawns (or forkserver-starts) ignores the
    job's stop signals: wrap an engine's start (SGLang's `Engine(...)`, vLLM's engine)."""
    real = multiprocessing.util.spawnv_passfds

    def spawnv_passfds(path, args, passfds):  # multiprocessing's one fork+exec
        with _ignored_for_fork():
            return real(path, args, passfds)

    multiprocessing.util.spawnv_passfds = spawnv_passfds
    try:
        yield
    finally:
        multiprocessing.util.spawnv_passfds = real
