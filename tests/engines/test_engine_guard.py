"""An engine process that dies leaves a dead engine, not a dead rank (engines/process/guard.py):
its sequences keep the tokens streamed before the death, its aborts answer with them, and
a death between calls is found by the health check."""

from __future__ import annotations

import os
import signal
import time

import pytest

from pivot_hpc.engines.process.child import ChildEngine
from pivot_hpc.engines.process.guard import GuardedEngine

from .test_child_engine import ARGS, greedy
from .test_engine_conformance import PROMPTS

# each test starts its own engine process and some wait out a watchdog (~60 s on 2 cores):
# out of the fast tier; tests/engines/test_child_engine.py keeps one engine process there
pytestmark = pytest.mark.slow


def wait_gone(pid: int) -> None:
    end = time.monotonic() + 10
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


@pytest.mark.timeout(120)
def test_a_killed_engine_keeps_the_streamed_tokens_and_counts_what_is_lost(hf_model_dir) -> None:
    eng = GuardedEngine(ChildEngine("hf", str(hf_model_dir), {**ARGS, "device": "cpu"}))
    try:
        eng.add(0, PROMPTS[0], None, greedy(50))
        eng.add(1, PROMPTS[1], [7, 8], greedy(50), [-0.5, -0.25])  # came with 2 tokens
        for _ in range(5):
            eng.step()
        eng.stream()
        streamed = {r.seq_id: list(r.token_ids) for r in eng.snapshot()}
        assert streamed[1][:2] == [7, 8] and len(streamed[1]) == len(streamed[0]) + 2 > 2
        for _ in range(3):
            eng.step()
        os.kill(eng.engine.pid, signal.SIGKILL)
        wait_gone(eng.engine.pid)
        assert eng.step() == [] and eng.dead and not eng.has_unfinished()
        f = eng.failure
        assert "killed by signal 9" in f.cause and f.sequences == 2
        assert f.tokens_kept == sum(len(t) for t in streamed.values())
        assert f.tokens_lost == 3 * 2  # 3 steps × 2 sequences since the refresh
        kept = eng.abort(1)
        assert kept.token_ids == streamed[1] and kept.logprobs[:2] == [-0.5, -0.25]
        assert kept.finish_reason == "abort"
        with pytest.raises(KeyError):
            eng.abort(99)
        eng.load_weights({}, version=3)  # a dead engine takes nothing and raises nothing
        assert eng.stats().running == 0
    finally:
        eng.close()


@pytest.mark.timeout(120)
def test_a_death_between_calls_is_found_by_the_health_check(hf_model_dir) -> None:
    eng = GuardedEngine(ChildEngine("hf", str(hf_model_dir), {**ARGS, "device": "cpu"}))
    try:
        eng.check()
        assert not eng.dead
        os.kill(eng.engine.pid, signal.SIGKILL)
        wait_gone(eng.engine.pid)
        eng.check()
        assert eng.dead and "health check" in eng.failure.cause
    finally:
        eng.close()


@pytest.mark.timeout(120)
def test_a_hung_engine_is_killed_by_the_watchdog(hf_model_dir) -> None:
    """Alive but not answering (SIGSTOP stands for a wedged scheduler): the rank's call
    returns within the watchdog, the process is killed, the engine is dead, not hung."""
    child = ChildEngine("hf", str(hf_model_dir), {**ARGS, "device": "cpu"}, watchdog_s=120)
    child.watchdog_s = 2.0  # (a start on this busy machine may take longer)
    eng = GuardedEngine(child)
    try:
        eng.add(0, PROMPTS[0], None, greedy(50))
        eng.step()
        os.kill(eng.engine.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        assert eng.step() == []
        assert 1.5 < time.monotonic() - t0 < 10
        assert eng.dead and "watchdog" in eng.failure.cause
        wait_gone(child.pid)
        assert eng.abort(0).seq_id == 0  # its tokens as added (no refresh yet)
    finally:
        eng.close()


@pytest.mark.timeout(120)
def test_an_engine_process_leaves_no_temporary_files_however_it_ends(hf_model_dir) -> None:
    """The child's TMPDIR is its own: gone after a SIGKILL (vLLM's in-process engine core
    leaves a `vllm_dist_<uuid>` file store there, which a killed or `os._exit`ed process
    never removes) and after a clean close; torch inductor's cache stays the rank's."""
    from pivot_hpc.engines.process.child import _inductor_cache_dir

    killed = GuardedEngine(ChildEngine("hf", str(hf_model_dir), {**ARGS, "device": "cpu"}))
    closed = ChildEngine("hf", str(hf_model_dir), {**ARGS, "device": "cpu"})
    try:
        for child in (killed.engine, closed):
            env = dict(
                e.split("=", 1)
                for e in open(f"/proc/{child.pid}/environ").read().split("\0")
                if "=" in e
            )
            assert env["TMPDIR"] == child.tmp_dir and os.path.isdir(child.tmp_dir)
            assert env["TORCHINDUCTOR_CACHE_DIR"] == _inductor_cache_dir()
            with open(os.path.join(child.tmp_dir, "vllm_dist_0"), "w") as f:  # as vLLM's
                f.write("store")
        assert killed.engine.tmp_dir != closed.tmp_dir
        os.kill(killed.engine.pid, signal.SIGKILL)
        wait_gone(killed.engine.pid)
        killed.check()
        assert killed.dead and os.path.isdir(killed.engine.tmp_dir)  # until the rank closes
    finally:
        killed.close()
        closed.close()
    assert not os.path.exists(killed.engine.tmp_dir) and not os.path.exists(closed.tmp_dir)
