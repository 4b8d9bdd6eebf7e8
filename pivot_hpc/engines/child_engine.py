"""The `hf` engine in a child process of its worker rank (`engines.<role>.process: child`).

Production engines run outside the rank that drives them (SGLang's scheduler and
detokenizer, vLLM's engine core): the rank then owns a process whose signals, death and
memory are separate from its own. `ChildEngine` gives the `hf` engine the same shape, so
what that shape demands is tested on CPU with a real engine process: the job's stop
signals do not reach it (engines/job_signals.py), and its exit is the rank's to notice.

The child is `python -m pivot_hpc.engines.child_engine FD_IN FD_OUT`; each InferenceEngine
call is one request and one reply over a pipe pair (plain pickle, tensors by value: both
ends are this job's own processes, nothing is read from disk; torch's shared-memory
reductions would need multiprocessing's resource sharer). The child gets no MPI environment (it must not
join the world), exits when its pipe closes (the rank died or closed it), and is killed
by the rank on close if it does not.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Any

from pivot_hpc.engines.base import EngineStats, InferenceEngine, SamplingParams, SeqResult, Tensors
from pivot_hpc.engines.job_signals import JOB_SIGNALS, spawn_shielded
from pivot_hpc.errors import PivotError

# variables that would make the child think it is an MPI rank (OpenMPI, PMIx, Slurm PMI)
_MPI_ENV = ("OMPI_", "PMIX_", "PMI_", "MPI4PY_")


class EngineProcessError(PivotError, RuntimeError):
    """The engine process of a worker is gone (exit code or signal named)."""


class ChildEngine:
    """An InferenceEngine whose engine (`HFEngine` over `model_dir`) runs in a child process.

    `engine_kwargs` are HFEngine's keyword arguments (picklable values)."""

    def __init__(self, model_dir: str, engine_kwargs: dict[str, Any], device: str) -> None:
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        env = {k: v for k, v in os.environ.items() if not k.startswith(_MPI_ENV)}
        self._proc = spawn_shielded(
            lambda: subprocess.Popen(
                [sys.executable, "-P", "-m", __name__, str(to_child_r), str(from_child_w)],
                pass_fds=(to_child_r, from_child_w),
                env=env,
                stdin=subprocess.DEVNULL,
            )
        )
        os.close(to_child_r)
        os.close(from_child_w)
        self._send = Connection(to_child_w, readable=False)
        self._recv = Connection(from_child_r, writable=False)
        self.pid = self._proc.pid
        info = self._call("_start", model_dir, engine_kwargs, device)
        self.weights_device: str = info["weights_device"]
        self.version: int = info["version"]

    def _call(self, name: str, *args: Any) -> Any:
        try:
            self._send.send_bytes(pickle.dumps((name, args)))
            # a message from this rank's own child over its private pipe, never a file
            ok, value = pickle.loads(self._recv.recv_bytes())
        except (EOFError, OSError):
            raise self._died(name) from None
        if not ok:
            raise value
        return value

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
        return EngineProcessError(f"engine process {self._proc.pid} {how} (during {name})")

    # ---- InferenceEngine -------------------------------------------------------------------
    def add(
        self,
        seq_id: int,
        prompt_ids: list[int],
        generated_ids: list[int] | None = None,
        sampling: SamplingParams | None = None,
        generated_logprobs: list[float] | None = None,
    ) -> None:
        self._call("add", seq_id, prompt_ids, generated_ids, sampling, generated_logprobs)

    def can_admit(self, n_tokens: int) -> bool:
        return self._call("can_admit", n_tokens)

    def step(self) -> list[SeqResult]:
        return self._call("step")

    def abort(self, seq_id: int) -> SeqResult:
        return self._call("abort", seq_id)

    def abort_all(self) -> list[SeqResult]:
        return self._call("abort_all")

    def snapshot(self) -> list[SeqResult]:
        return self._call("snapshot")

    def seq_lengths(self) -> dict[int, int]:
        return self._call("seq_lengths")

    def has_unfinished(self) -> bool:
        return self._call("has_unfinished")

    def stats(self) -> EngineStats:
        return self._call("stats")

    def load_weights(self, tensors: Tensors, version: int) -> None:
        self._call("load_weights", dict(tensors), version)
        self.version = version

    def release_memory(self, weights: bool = False) -> None:
        self._call("release_memory", weights)

    def resume_memory(self) -> None:
        self._call("resume_memory")

    def rng_state(self) -> Any:
        return self._call("rng_state")

    def set_rng_state(self, state: Any) -> None:
        self._call("set_rng_state", state)

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self._call("close")
            except EngineProcessError:
                pass
        for conn in (self._send, self._recv):
            conn.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()  # it ignores the job's signals: only SIGKILL is sure
            self._proc.wait()


def _serve(recv: Connection, send: Connection) -> None:
    """The child: build the engine on `_start`, then answer calls until `close` or EOF."""
    engine: InferenceEngine | None = None
    while True:
        try:
            name, args = pickle.loads(recv.recv_bytes())  # from the parent rank's pipe
        except (EOFError, OSError):
            return  # the rank is gone or closed the pipe
        try:
            if name == "_start":
                engine = _build(*args)
                value: Any = {"weights_device": engine.weights_device, "version": engine.version}
            else:
                assert engine is not None, "the engine was not started"
                value = getattr(engine, name)(*args)
            reply = (True, value)
        except Exception as exc:  # the rank re-raises it where the call was made
            reply = (False, exc)
        send.send_bytes(pickle.dumps(reply))
        if name == "close":
            return


def _build(model_dir: str, engine_kwargs: dict[str, Any], device: str) -> InferenceEngine:
    from pivot_hpc.engines.hf_engine import HFEngine
    from pivot_hpc.models.zoo import load_model

    model, tok = load_model(model_dir)
    return HFEngine(model.to(device), eos_token_id=tok.eos_token_id, **engine_kwargs)


if __name__ == "__main__":
    import signal

    for s in JOB_SIGNALS:  # already ignored since the fork; kept so even if started by hand
        signal.signal(s, signal.SIG_IGN)
    _serve(
        Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False)
    )
