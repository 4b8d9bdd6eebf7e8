"""The local Slurm helper keeps its state private: a directory someone else made, or one
others can write, is refused; the sacct stand-in ignores a cache it cannot trust."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "slurm" / "local_cluster.sh"


def status(state_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), "status", "--dir", str(state_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("mode", [0o755, 0o777, 0o750])
def test_a_state_dir_others_can_use_is_refused(tmp_path: Path, mode: int) -> None:
    d = tmp_path / "slurm"
    d.mkdir()
    d.chmod(mode)
    out = status(d)
    assert out.returncode == 1
    assert f"has mode {mode:o}" in out.stderr and f"chmod 700 {d}" in out.stderr


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a directory away")
def test_a_state_dir_someone_else_made_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "slurm"
    d.mkdir(mode=0o700)
    os.chown(d, 4242, 4242)
    out = status(d)
    assert out.returncode == 1 and "belongs to uid 4242" in out.stderr


def test_a_symlinked_state_dir_is_refused(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    out = status(tmp_path / "link")
    assert out.returncode == 1 and "symbolic link" in out.stderr


def test_a_new_state_dir_is_private(tmp_path: Path) -> None:
    d = tmp_path / "new" / "slurm"
    status(d)  # no cluster here: status fails, but the directory is made first
    assert d.stat().st_mode & 0o777 == 0o700


def load_standin(cache: Path):
    os.environ["PIVOT_SACCT_CACHE"] = str(cache)
    try:
        spec = importlib.util.spec_from_file_location(
            "sacct_standin", ROOT / "slurm" / "sacct_standin.py"
        )
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        del os.environ["PIVOT_SACCT_CACHE"]
    return mod


def test_sacct_cache_is_written_private_and_read_only_when_trusted(tmp_path: Path) -> None:
    cache = tmp_path / "cache" / "sacct.json"
    standin = load_standin(cache)
    standin.save_cache({"7": [{"JobState": "COMPLETED"}]})
    assert cache.stat().st_mode & 0o777 == 0o600
    assert cache.parent.stat().st_mode & 0o777 == 0o700
    assert standin.load_cache() == {"7": [{"JobState": "COMPLETED"}]}
    cache.chmod(0o666)  # anyone could have rewritten "FAILED" as "COMPLETED"
    assert standin.load_cache() == {}
    cache.chmod(0o600)
    cache.write_text(json.dumps(["not", "a", "mapping"]))
    assert standin.load_cache() == {}


@pytest.mark.parametrize(
    "override, says",
    [
        ("cluster.gpu_memory_gib=0.001", "memory plan: rollout needs"),
    ],
)
def test_sbatch_refuses_what_the_world_would_before_srun(
    tmp_path: Path, override: str, says: str
) -> None:
    """slurm/pivot.sbatch checks the memory plan and the live runtime's limits before srun,
    as `pivot-hpc run`/`submit` do: one clear error, exit 2, no requeue loop."""
    env = {**os.environ, "SLURM_JOB_ID": "1", "SLURM_NTASKS": "5", "SLURM_JOB_NODELIST": "n1"}
    out = subprocess.run(
        [
            "bash",
            str(ROOT / "slurm" / "pivot.sbatch"),
            "configs/tiny.yaml",
            str(tmp_path),
            override,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert says in out.stderr and "srun" not in out.stdout, out.stderr
