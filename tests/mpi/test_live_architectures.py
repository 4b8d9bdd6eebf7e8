"""Real architectures live (issue 46): `pivot-hpc run configs/tiny.yaml` with a tiny
random-init directory (recipes/tiny_arch_dirs.py, the tiny job's char tokenizer inside) as
the GenRM, a tied-embedding Qwen2 (Qwen2.5-0.5B/1.5B/3B's layout), a Qwen3 and a
Llama 3 as the trained policy: every step runs, the policy is published at every step (no KeyError
'lm_head.weight'), and the run checkpoints and resumes. Random weights need not learn:
their judgements are unparsable, which the run counts."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from live import ROOT, run_command

from pivot_hpc.recipes.tiny_arch_dirs import build_arch_dir
from pivot_hpc.telemetry import open_run

pytestmark = [
    pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs OpenMPI (mpirun)"),
    pytest.mark.slow,
]


def run(run_dir: Path, *overrides: str, steps: int = 3) -> subprocess.CompletedProcess:
    return subprocess.run(
        run_command(run_dir, f"loop.steps={steps}", "loop.batch_prompts=4", *overrides),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=420,
        env=dict(os.environ),
    )


@pytest.mark.parametrize("arch", ["qwen3", "llama3", "glm4", "qwen3-moe"])
def test_genrm_of_each_architecture_runs_its_steps(tmp_path: Path, arch: str) -> None:
    genrm = build_arch_dir(arch, tmp_path / arch, dtype="bfloat16")
    out = run(tmp_path / "run", f"models.genrm_path={genrm}")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "pivot-hpc: done: 3 steps" in out.stdout and "GenRM unparsable" in out.stdout
    assert list(open_run(tmp_path / "run")["steps"]["version"]) == [1, 2, 3]


@pytest.mark.parametrize("arch", ["qwen3", "llama3"])
def test_dense_policy_of_each_family_trains_and_publishes(tmp_path: Path, arch: str) -> None:
    # Qwen3 (q/k norms, no q/k/v bias) and Llama 3 (llama3 rope scaling) as the trained
    # policy, beside the tiny GenRM: every step trains and publishes a new version
    policy = build_arch_dir(arch, tmp_path / arch, dtype="bfloat16")
    out = run(tmp_path / "run", f"models.policy_path={policy}", steps=2)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "pivot-hpc: done: 2 steps" in out.stdout
    assert list(open_run(tmp_path / "run")["steps"]["version"]) == [1, 2]


def test_tied_policy_trains_publishes_and_resumes(tmp_path: Path) -> None:
    policy = build_arch_dir("qwen2-tied", tmp_path / "policy", dtype="bfloat16")
    genrm = build_arch_dir("qwen3", tmp_path / "genrm", dtype="bfloat16")
    models = [f"models.policy_path={policy}", f"models.genrm_path={genrm}"]
    first = run(tmp_path / "run", *models)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "pivot-hpc: done: 3 steps" in first.stdout
    again = run(tmp_path / "run", *models, steps=5)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "resuming from" in again.stdout and "pivot-hpc: done: 5 steps" in again.stdout
    versions = [int(v) for v in open_run(tmp_path / "run")["steps"]["version"]]
    assert versions[-2:] == [4, 5]
