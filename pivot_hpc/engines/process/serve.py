"""The engine child's main (`python -m pivot_hpc.engines.process.serve FD_IN FD_OUT
LOG_FD`, started by engines/process/child.py): build the engine on `_start`, then answer
one call per request until `close` or the pipe's end. Dispatch is by the protocol: a name
the engine's protocol does not declare is refused, never looked up on the engine."""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import sys
from multiprocessing.connection import Connection
from typing import Any

from pivot_hpc.engines.base import InferenceEngine, SupervisedTrainer, protocol_members
from pivot_hpc.engines.process.child import PARENT_ENV, TMP_ENV
from pivot_hpc.engines.process.job_signals import JOB_SIGNALS

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# what a rank may ask of each kind of child
_CALLS = {
    "train": frozenset(protocol_members(SupervisedTrainer)),
    "inference": frozenset(protocol_members(InferenceEngine)),
}


def _serve(recv: Connection, send: Connection) -> None:
    """The child: build the engine on `_start`, then answer calls until `close` or EOF."""
    engine: Any = None
    calls: frozenset[str] = frozenset()
    while True:
        try:
            name, args, kwargs = pickle.loads(recv.recv_bytes())  # from the parent rank's pipe
        except (EOFError, OSError):
            return  # the rank is gone or closed the pipe
        try:
            if name == "_start":
                engine = _build(*args)
                calls = _CALLS["train" if args[0] == "train" else "inference"]
                value: Any = _describe(args[0], engine)
            elif name == "close":
                value = None  # the process's exit frees it all, at once (vLLM's shutdown: s)
            elif engine is None:
                raise RuntimeError(f"{name}: the engine was not started")
            elif (args[0] if name == "_get" else name) not in calls:
                raise AttributeError(
                    f"{name} {args[:1] if name == '_get' else ''}: not in the protocol"
                )
            elif name == "_get":
                value = getattr(engine, args[0])
            else:
                value = getattr(engine, name)(*args, **kwargs)
            reply = (True, value)
        except Exception as exc:  # the rank re-raises it where the call was made
            reply = (False, exc)
        send.send_bytes(pickle.dumps(reply))
        if name == "close" or (name == "_start" and not reply[0]):
            return


def _describe(kind: str, engine: Any) -> dict[str, Any]:
    """What the rank keeps of a started engine: an inference engine's limits, or a
    trainer's device and data parallelism (fixed for the process's life)."""
    if kind == "train":
        return {"device": engine.device}
    value = {
        k: getattr(engine, k)
        for k in ("weights_device", "version", "max_batch", "max_seq_len")
        if hasattr(engine, k)
    }
    value["kv_capacity"] = engine.stats().kv_capacity
    return value


def _build(kind: str, *args: Any) -> Any:
    if kind == "train":
        return _build_trainer(*args)
    return _build_inference(kind, *args)


def _build_trainer(kwargs: dict[str, Any]) -> Any:
    """The training engine of this child, as its rank drives it (a LocalTrainer: the step
    groups of elastic training beside it), in the world its rank gave it (RANK,
    WORLD_SIZE and a store: ChildTrainer's `world_env`), else a world of one rank
    (init_distributed makes a private file store in TMPDIR)."""
    from types import SimpleNamespace

    import torch

    from pivot_hpc.engines.factory import make_train_engine
    from pivot_hpc.engines.process.local import LocalTrainer
    from pivot_hpc.engines.step_groups import StepGroups
    from pivot_hpc.rl.config import GRPOConfig

    torch.set_num_threads(kwargs["num_threads"])
    cfg = SimpleNamespace(
        rl=SimpleNamespace(
            trainer=kwargs["trainer"],
            grpo=kwargs["grpo"] or GRPOConfig(),
            max_response_tokens=kwargs["max_response_tokens"],
        )
    )
    engine = make_train_engine(cfg, kwargs["model_cfg"])
    world = kwargs["world"]
    groups = StepGroups(*world) if world is not None else None
    return LocalTrainer(engine, groups, kwargs["rank"])


def _build_inference(kind: str, model_dir: str, kwargs: dict[str, Any]) -> InferenceEngine:
    if kind == "vllm":
        from pivot_hpc.engines.vllm.launch import make_vllm_engine

        return make_vllm_engine(model_dir=model_dir, **kwargs)
    from pivot_hpc.engines.hf.engine import make_hf_engine

    return make_hf_engine(model_dir, **kwargs)


def _die_with_parent(parent: int) -> None:
    """PR_SET_PDEATHSIG(SIGKILL): the kernel kills this process when the thread that
    started it (the rank's main thread) ends; a rank already gone before that was set
    is seen as a new parent."""
    import ctypes
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:
        os._exit(1)


def _route_logs(fd: int) -> None:
    """Library records and warnings (WARNING and above) to the rank's log file."""
    handler = logging.StreamHandler(os.fdopen(fd, "a", buffering=1))
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    handler.setLevel(logging.WARNING)
    logging.getLogger().addHandler(handler)
    logging.captureWarnings(True)


if __name__ == "__main__":
    import signal

    for s in JOB_SIGNALS:  # already ignored since the fork; kept so even if started by hand
        signal.signal(s, signal.SIG_IGN)
    if os.environ.get(PARENT_ENV):
        _die_with_parent(int(os.environ.pop(PARENT_ENV)))
    if int(sys.argv[3]) >= 0:
        _route_logs(int(sys.argv[3]))
    _serve(
        Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False)
    )
    logging.shutdown()
    if os.environ.get(TMP_ENV):  # (its rank removes it too: after a kill, or if this fails)
        shutil.rmtree(os.environ[TMP_ENV], ignore_errors=True)
    os._exit(0)  # no interpreter teardown: the engine's threads and atexit hooks hold nothing
