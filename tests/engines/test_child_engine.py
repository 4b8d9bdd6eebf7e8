"""The `hf` engine in a child process of its rank (`engines.<role>.process: child`): the
same tokens as in the rank, the job's stop signals do not reach it, and its death is one
clear error for the rank instead of a hang (vLLM in a child: test_vllm_child.py)."""

from __future__ import annotations

import copy
import os
import signal
import time

import pytest

from pivot_hpc.engines.base import InferenceEngine, SamplingParams
from pivot_hpc.engines.hf.engine import HFEngine
from pivot_hpc.engines.process.child import ChildEngine, EngineProcessError

from .test_engine_conformance import PROMPTS, drain

ARGS = {"kv_capacity_tokens": 4096, "max_batch": 8, "max_seq_len": 256, "seed": 3}


@pytest.fixture(scope="module")
def child(hf_model_dir):
    eng = ChildEngine("hf", str(hf_model_dir), {**ARGS, "device": "cpu"})
    yield eng
    eng.close()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_same_tokens_as_the_engine_in_the_rank(child, tiny_model) -> None:
    assert isinstance(child, InferenceEngine) and child.weights_device == "cpu"
    inline = HFEngine(copy.deepcopy(tiny_model), **ARGS)
    for eng in (child, inline):
        for i, p in enumerate(PROMPTS):
            eng.add(i, p, sampling=greedy(6))
    got, want = drain(child), drain(inline)
    assert {i: r.token_ids for i, r in got.items()} == {i: r.token_ids for i, r in want.items()}
    weights = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    child.load_weights(weights, version=4)
    assert child.version == 4 and child.stats().kv_capacity == 4096


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT])
def test_the_jobs_stop_signals_do_not_reach_the_engine(child, sig) -> None:
    """What Slurm sends every process of a step: the engine goes on; the rank decides."""
    child.add(0, PROMPTS[0], sampling=greedy(4))
    os.kill(child.pid, sig)
    time.sleep(0.3)
    assert len(drain(child)[0].token_ids) == 4


def test_a_dead_engine_is_one_error_naming_it(child) -> None:
    os.kill(child.pid, signal.SIGKILL)
    with pytest.raises(
        EngineProcessError, match=f"engine process {child.pid} was killed by signal 9"
    ):
        child.step()


@pytest.mark.slow  # a second engine process (the module's is shared)
def test_no_mpi_environment_reaches_the_child(hf_model_dir, monkeypatch) -> None:
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    eng = ChildEngine("hf", str(hf_model_dir), {**ARGS, "device": "cpu"})
    try:
        env = open(f"/proc/{eng.pid}/environ", "rb").read().split(b"\0")
        assert not [e for e in env if e.startswith(b"OMPI_")]
    finally:
        eng.close()
    assert eng._proc.returncode == 0  # closed cleanly, not killed


def _wait_forever() -> None:  # a multiprocessing child: what SGLang's scheduler looks like
    while True:
        time.sleep(0.1)


def test_children_a_library_spawns_inside_shielded_ignore_the_jobs_signals() -> None:
    """SGLang's scheduler/detokenizer (and vLLM's engine core) are multiprocessing spawn
    children: started inside `shielded()` they outlive a USR1/TERM; outside, they die."""
    import multiprocessing

    from pivot_hpc.engines.process.job_signals import shielded

    ctx = multiprocessing.get_context("spawn")
    with shielded():
        kept = ctx.Process(target=_wait_forever, daemon=True)
        kept.start()
    plain = ctx.Process(target=_wait_forever, daemon=True)
    plain.start()
    try:
        time.sleep(1.0)  # both past interpreter start-up
        for p in (kept, plain):
            os.kill(p.pid, signal.SIGUSR1)
            os.kill(p.pid, signal.SIGTERM)
        plain.join(timeout=10)
        time.sleep(0.3)
        assert plain.exitcode is not None and kept.is_alive()
    finally:
        for p in (kept, plain):
            p.kill()
            p.join(timeout=10)
