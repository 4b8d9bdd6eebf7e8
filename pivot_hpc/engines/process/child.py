"""An engine in a child process of its worker rank (`engines.<role>.process: child`).

Production engines run outside the rank that drives them (SGLang's scheduler and
detokenizer, vLLM's engine core): the rank then owns a process whose signals, death and
memory are separate from its own. `ChildEngine` runs the `hf` engine or the `vllm` adapter
(vLLM in-process inside the child: engines/vllm/launch.py) in such a process. What that shape
demands is tested on CPU with real engine processes: the job's stop signals do not reach
the engine (engines/process/job_signals.py), and its exit is one error for the rank, not
a hang.

The child is `python -m pivot_hpc.engines.process.serve FD_IN FD_OUT LOG_FD`; each
InferenceEngine call is one request and one reply over a pipe pair (plain pickle, tensors
by value: both ends are this job's own processes, nothing is read from disk; torch's
shared-memory reductions would need multiprocessing's resource sharer). The child gets no
MPI environment (it must not join the world, nor see its torch.distributed group), exits
when its pipe closes (the rank died or closed it), and is killed by the rank on close if it
does not. Its library log records (WARNING and above) go to the rank's log file
(runtime/library_noise.py) through an inherited descriptor.

Its temporary files live in a directory of its own (TMPDIR), which the child removes when
it exits and the rank once the process is gone, however it went (a rank that dies first
closes the pipe: its child exits and removes it). vLLM's in-process engine core meets its
one-rank torch.distributed group through a `vllm_dist_<uuid>` file store in the temporary
directory, which only the store's destructor removes; a child ends with `os._exit` (or
SIGKILL), so every vLLM start used to leave one behind. The compile caches stay where the
rank's are (private, checked: pivot_hpc/compile_caches.py): a restart compiles nothing again.

`ChildTrainer` runs the training engine (`rl.trainer.process: child`) through the same
machinery (`_ChildProcess`: spawn, calls, liveness, watchdog, `_died`; `kind` "train"
picks what the child builds). The training set's children make a torch.distributed world
of their own (`world_env`: their ranks, and where this generation of them meets; one
child alone uses a file store in its own temporary directory); the rank's launcher
variables never reach them. A child dies with its rank (PR_SET_PDEATHSIG: SIGKILL; a step
in progress would otherwise hold its GPU until it ends).
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from typing import Any

from pivot_hpc import compile_caches
from pivot_hpc.engines.base import STORE_ENV, InferenceEngine, SupervisedTrainer, Tensors
from pivot_hpc.engines.forwarding import forward
from pivot_hpc.engines.process.job_signals import spawn_shielded
from pivot_hpc.errors import PivotError

# variables that would make the child think it is an MPI rank (OpenMPI, PMIx, Slurm PMI)
# or a member of the rank's torch.distributed world
_MPI_ENV = ("OMPI_", "PMIX_", "PMI_", "MPI4PY_")
_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
# how often a rank waiting for a reply checks that the child still lives: the pipe alone
# would not tell if a process the child started kept its end open
_LIVENESS_S = 0.5
KINDS = ("hf", "vllm")
SERVE_MODULE = "pivot_hpc.engines.process.serve"  # the child's main
TMP_ENV = "PIVOT_HPC_ENGINE_TMPDIR"  # the child's own temporary directory (removed at exit)
# a child that must die with its rank (ChildTrainer): the rank's pid, for PR_SET_PDEATHSIG
PARENT_ENV = "PIVOT_HPC_ENGINE_PARENT"


class EngineProcessError(PivotError, RuntimeError):
    """The engine process of a worker is gone (exit code or signal named)."""


class _ChildProcess:
    """The machinery every engine child shares: the shielded spawn, one call per request
    and reply over the pipe pair, the liveness check while waiting, the watchdog and the
    words of a death (`_died`). `kind` picks what the child builds (`_build`); `name`
    words its errors ("<name> engine process PID …"). `pdeathsig`: the child is killed
    (SIGKILL) as soon as the thread that started it ends (the rank's main thread: start
    it from no other), even in the middle of a call. `env_extra`: variables set in the
    child after the rank's MPI and torch.distributed ones are taken out (a trainer child's
    own world: ChildTrainer)."""

    def __init__(
        self,
        kind: str,
        start_args: tuple[Any, ...],
        *,
        name: str,
        watchdog_s: float | None,
        pdeathsig: bool = False,
        env_extra: dict[str, str] | None = None,
    ) -> None:
        self.watchdog_s = watchdog_s
        self.kind = name
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(_MPI_ENV) and k not in _DIST_ENV and k != STORE_ENV
        }
        env.update(compile_caches.resolved(env))  # private compile caches, checked
        env.update(env_extra or {})
        if pdeathsig:
            env[PARENT_ENV] = str(os.getpid())
        # the child's temporary files: removed at its exit and by `_stop` (module docstring)
        self.tmp_dir = tempfile.mkdtemp(prefix=f"pivot-{name}-engine-")
        env["TMPDIR"] = env[TMP_ENV] = self.tmp_dir
        log_fd = _rank_log_fd()
        fds = (to_child_r, from_child_w) + ((log_fd,) if log_fd is not None else ())
        argv = [str(to_child_r), str(from_child_w), str(-1 if log_fd is None else log_fd)]
        try:
            self._proc = spawn_shielded(
                lambda: subprocess.Popen(
                    [sys.executable, "-P", "-m", SERVE_MODULE, *argv],
                    pass_fds=fds,
                    env=env,
                    stdin=subprocess.DEVNULL,
                )
            )
        except BaseException:
            for fd in (to_child_r, to_child_w, from_child_r, from_child_w):
                os.close(fd)
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
            raise
        os.close(to_child_r)
        os.close(from_child_w)
        self._send = Connection(to_child_w, readable=False)
        self._recv = Connection(from_child_r, writable=False)
        self.pid = self._proc.pid
        try:
            self.info: dict[str, Any] = self._call("_start", kind, *start_args)
        except BaseException:
            self._stop()
            raise

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        try:
            self._send.send_bytes(pickle.dumps((name, args, kwargs)))
            deadline = None if self.watchdog_s is None else time.monotonic() + self.watchdog_s
            while not self._recv.poll(_LIVENESS_S):
                if self._proc.poll() is not None and not self._recv.poll(0):
                    raise EOFError  # gone, and no reply written before it went
                if deadline is not None and time.monotonic() > deadline:
                    self._proc.kill()  # alive but hung: the watchdog ends it
                    self._proc.wait()
                    raise EngineProcessError(
                        f"{self.kind} engine process {self._proc.pid} did not answer {name} "
                        f"within {self.watchdog_s:g}s ({self._watchdog_key}): "
                        "killed by the watchdog"
                    )
            # a message from this rank's own child over its private pipe, never a file
            ok, value = pickle.loads(self._recv.recv_bytes())
        except (EOFError, OSError):
            raise self._died(name) from None
        if not ok:
            raise value
        return value

    _watchdog_key = "engines.<role>.watchdog_timeout_s"

    def _died(self, name: str) -> EngineProcessError:
        try:
            code = self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        how = (
            "is not answering"
            if code is None
            else f"was killed by signal {-code}"
            if code < 0
            else f"exited with code {code}"
        )
        return EngineProcessError(
            f"{self.kind} engine process {self._proc.pid} {how} (during {name})"
        )

    def exit_code(self) -> int | None:
        """None while the process lives; else its exit code (-N: killed by signal N)."""
        return self._proc.poll()

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self._call("close")
            except EngineProcessError:
                pass
        self._stop()

    def _stop(self) -> None:
        for conn in (self._send, self._recv):
            conn.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()  # it ignores the job's signals: only SIGKILL is sure
            self._proc.wait()
        shutil.rmtree(self.tmp_dir, ignore_errors=True)  # gone with it: nothing writes there


def _call(proxy: _ChildProcess, name: str, args: tuple, kwargs: dict) -> Any:
    return proxy._call(name, *args, **kwargs)


def _get(proxy: _ChildProcess, name: str) -> Any:
    return proxy._call("_get", name)


@forward(InferenceEngine, call=_call, get=_get)
class ChildEngine(_ChildProcess):
    """An InferenceEngine whose engine runs in a child process: every call of the protocol
    is one request over the pipe (engines/forwarding.py writes the forwards).

    kind "hf": `kwargs` are HFEngine's keyword arguments plus `device`. kind "vllm":
    make_vllm_engine's keyword arguments (`ec`, `role`, `tp`, `kv_capacity_tokens`,
    `seed`). Values must pickle. `watchdog_s`: a call not answered within this many
    seconds (the process alive but hung) kills the process and raises EngineProcessError
    (`engines.<role>.watchdog_timeout_s`); None: wait as long as it lives."""

    weights_device: str  # fixed for the process's life (the engine's own answer at start)
    version: int

    def __init__(
        self, kind: str, model_dir: str, kwargs: dict[str, Any], watchdog_s: float | None = None
    ) -> None:
        if kind not in KINDS:
            raise ValueError(f"ChildEngine: kind {kind!r} is not one of {KINDS}")
        super().__init__(kind, (model_dir, kwargs), name=kind, watchdog_s=watchdog_s)
        info = self.info
        self.weights_device = info["weights_device"]
        self.version = info["version"]  # (info: the engine's limits, max_batch, ...)

    def load_weights(self, tensors: Tensors, version: int) -> None:
        self._call("load_weights", dict(tensors), version)
        self.version = version

    @property
    def alive(self) -> bool:
        """The process still runs (the guard's health check between calls)."""
        return self._proc.poll() is None


@forward(SupervisedTrainer, call=_call, get=_get)
class ChildTrainer(_ChildProcess):
    """A trainer (`rl.trainer.engine`, engines/factory.py) in a child process of its rank
    (`rl.trainer.process: child`): a SupervisedTrainer whose every call is one request
    (tensors by value: the batch, canonical weights and optimizer state travel on the
    CPU), and whose attributes (`version`, `steps`, `optimizer_step`, …) are asked for
    when read. The children of the training set make a torch.distributed world of their
    own: `world_env` gives each its RANK and WORLD_SIZE and where this generation of them
    meets (`PIVOT_HPC_STORE`, a file store private to the job: runtime/training_world.py
    names a new one whenever they are started again).
    Without it the child trains alone (a world of one, a file store in its own temporary
    directory). No MPI or launcher variable reaches it. `world`, `rank`: the world ranks
    that may train with training's tp, and this rank's own, for elastic training's step
    groups, which live in the child (engines/process/local.py).

    The child dies with its rank (PR_SET_PDEATHSIG: SIGKILL), even inside a step. A dead
    child raises EngineProcessError at the next call; `dead` tells it between calls (the
    training seat then starts a new one and refits it from GPS)."""

    _watchdog_key = "the training engine's watchdog"
    device: Any  # fixed for the process's life

    def __init__(
        self,
        model_cfg: Any,
        trainer: Any,
        grpo: Any = None,
        *,
        max_response_tokens: int | None = None,
        watchdog_s: float | None = None,
        num_threads: int = 1,
        world: Any = None,
        rank: int | None = None,
        world_env: dict[str, str] | None = None,
    ) -> None:
        kwargs = {
            "model_cfg": model_cfg,
            "trainer": trainer,
            "grpo": grpo,
            "max_response_tokens": max_response_tokens,
            "num_threads": num_threads,
            "world": world,
            "rank": rank,
        }
        super().__init__(
            "train",
            (kwargs,),
            name="training",
            watchdog_s=watchdog_s,
            pdeathsig=True,
            env_extra=world_env,
        )
        self.device = self.info["device"]

    @property
    def dead(self) -> bool:
        """The process is gone (between calls: a call on it raises EngineProcessError)."""
        return self._proc.poll() is not None

    def death(self) -> EngineProcessError:
        """The error of a dead process, as a call on it would raise it (health check)."""
        return self._died("health check")

    def kill(self) -> None:
        """SIGKILL the process and wait for it (the worker's test hook)."""
        self._proc.kill()
        self._proc.wait()

    def load_weights(self, tensors: Tensors, *, masters: bool = True) -> None:
        self._call("load_weights", _on_cpu(tensors), masters=masters)

    def load_optimizer_state(self, state: dict[str, Tensors], *, step: int, version: int) -> None:
        state = {k: _on_cpu(v) for k, v in state.items()}
        self._call("load_optimizer_state", state, step=step, version=version)

    def form_groups(self, members: Any) -> None:
        """Form a step member set's data-parallel groups (in the child; collective over
        every child of the world, in the same order)."""
        self._call("form_groups", tuple(members))

    def use_members(self, members: Any) -> None:
        self._call("use_members", tuple(members))

    def save(self, path: Any) -> None:
        self._call("save", str(path))

    def load(self, path: Any) -> None:
        self._call("load", str(path))


def _on_cpu(tensors: Tensors) -> dict[str, Any]:
    """Tensors to send by value (a device tensor would pickle its device along)."""
    return {k: v.cpu() if v.device.type != "cpu" else v for k, v in tensors.items()}


def _inductor_cache_dir() -> str:
    """Torch inductor's cache directory as the rank's children get it: private, checked
    (pivot_hpc/compile_caches.py), never torch's shared /tmp default."""
    return compile_caches.resolved()["TORCHINDUCTOR_CACHE_DIR"]


def _rank_log_fd() -> int | None:
    """The descriptor of the file this rank's library records go to (a root-logger stream
    handler on a file: runtime/library_noise.py), or None."""
    for h in logging.getLogger().handlers:
        stream = getattr(h, "stream", None)
        if type(h) is not logging.StreamHandler or stream in (sys.stderr, sys.stdout):
            continue
        try:
            return stream.fileno()
        except (AttributeError, OSError, ValueError):
            continue
    return None
