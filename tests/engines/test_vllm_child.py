"""vLLM in a child process of its rank (`engines.<role>.process: child`, vLLM's default):
what that process shape promises beyond the conformance suite (which runs over it too).

The job's stop signals (what Slurm sends every process of a step) do not reach the engine;
the child joins neither the MPI world nor a torch.distributed group of the rank; vLLM's
log records reach the rank's log file; a bad model directory is one line before vLLM is
even imported; and a child killed mid-generation is one `EngineProcessError` within
seconds, not a rank blocked on its pipe. One vLLM child serves the module (the last test
kills it).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from pivot_hpc.engines.base import InferenceEngine, SamplingParams
from pivot_hpc.engines.config import InferenceEngineConfig
from pivot_hpc.engines.factory import make_inference_engine
from pivot_hpc.engines.process.child import ChildEngine, EngineProcessError
from pivot_hpc.engines.process.guard import GuardedEngine
from pivot_hpc.errors import PivotError
from tests.vllm_support import require_vllm, vllm_model_dir

from .fake_sglang import drain

PROMPTS = [[3, 4, 5], [7, 8, 9, 10, 11], [20, 21], [30, 31, 32, 33]]


def _cfg(**kw) -> SimpleNamespace:
    return SimpleNamespace(
        engines=SimpleNamespace(rollout=InferenceEngineConfig(engine="vllm", max_batch=8, **kw)),
        rollout=SimpleNamespace(tp=1, kv_capacity_tokens=2048),
    )


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def rank_log(tmp_path_factory):
    """A root-logger file handler, as runtime/library_noise.py gives every rank."""
    path = tmp_path_factory.mktemp("logs") / "rank-0001.log"
    handler = logging.StreamHandler(open(path, "a"))
    logging.getLogger().addHandler(handler)
    yield path
    logging.getLogger().removeHandler(handler)
    handler.stream.close()


@pytest.fixture(scope="module")
def child(tmp_path_factory, rank_log):
    require_vllm()
    d = vllm_model_dir(tmp_path_factory.mktemp("vllm-child-model"))
    os.environ["OMPI_COMM_WORLD_RANK"] = "3"  # what a rank has; the child must not see it
    os.environ["MASTER_PORT"] = "29511"
    try:
        t0 = time.monotonic()
        guarded = make_inference_engine(_cfg(), "rollout", d, seed=5)  # process: auto → child
        print(f"vllm child started in {time.monotonic() - t0:.1f}s")
    finally:
        del os.environ["OMPI_COMM_WORLD_RANK"], os.environ["MASTER_PORT"]
    # the factory guards every child (engine fault tolerance); these tests are about the
    # child process itself, so they drive the proxy under the guard
    assert isinstance(guarded, GuardedEngine)
    yield guarded.engine
    guarded.close()


@pytest.mark.slow  # the module's vLLM child: 10-15 s to start
def test_the_default_for_vllm_is_a_child_with_its_own_environment(child, rank_log):
    assert isinstance(child, ChildEngine) and isinstance(child, InferenceEngine)
    assert child.info["kv_capacity"] == 2048 and child.weights_device == "cpu"
    env = Path(f"/proc/{child.pid}/environ").read_bytes().split(b"\0")
    assert not [e for e in env if e.startswith((b"OMPI_", b"MASTER_PORT="))]
    # vLLM's engine core is in the child itself: no process of its own that the job's
    # signals could reach unshielded
    assert Path(f"/proc/{child.pid}/task/{child.pid}/children").read_text().split() == []
    assert "vllm" in rank_log.read_text()  # its records are in the rank's log file
    for i, p in enumerate(PROMPTS):
        child.add(i, p, sampling=greedy(8))
    out = drain(child)
    assert sorted(out) == [0, 1, 2, 3] and all(len(r.token_ids) == 8 for r in out.values())


@pytest.mark.slow  # the module's vLLM child
@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT])
def test_the_jobs_stop_signals_do_not_reach_the_engine(child, sig):
    """What Slurm sends every process of a step: the vLLM child goes on generating."""
    child.add(0, PROMPTS[1], sampling=greedy(12))
    child.step()
    os.kill(child.pid, sig)
    time.sleep(0.3)
    r = drain(child)[0]
    assert len(r.token_ids) == 12 and child.stats().kv_capacity == 2048


def test_a_bad_model_directory_is_one_line_before_vllm_is_imported(tmp_path):
    require_vllm()
    t0 = time.monotonic()
    with pytest.raises(PivotError) as err:
        make_inference_engine(_cfg(), "rollout", tmp_path, seed=0)
    msg = str(err.value)
    assert "\n" not in msg and str(tmp_path) in msg and "engines.rollout.engine" in msg
    print(f"refused in {time.monotonic() - t0:.1f}s")


@pytest.mark.slow  # the module's vLLM child: 10-15 s to start
def test_a_killed_child_is_one_error_within_seconds_not_a_hang(child):
    """SIGKILL while the rank drives generation: the next (or the blocked) call raises
    EngineProcessError naming the signal, within a few seconds."""
    for i in range(8):
        child.add(i, [5 + i] * 20, sampling=greedy(200))
    child.step()
    killer = threading.Timer(0.5, os.kill, (child.pid, signal.SIGKILL))
    killer.start()
    t0 = time.monotonic()
    with pytest.raises(
        EngineProcessError, match=f"engine process {child.pid} was killed by signal 9"
    ):
        while True:  # the 200-token batch outlasts the timer
            child.step()
    killer.join()
    waited = time.monotonic() - t0 - 0.5
    print(f"killed child noticed {waited:.2f}s after the kill")
    assert waited < 5
