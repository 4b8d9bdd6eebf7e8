"""A local Slurm cluster for tests/slurm: `slurm/local_cluster.sh start --two-nodes`.

One session fixture brings the cluster up (installing slurm-wlm, munge and libpmix-dev with
apt-get on a fresh machine) and stops it at the end if it was not running before. Two fake
nodes n1, n2 on this host: one-node jobs land on either, two-node jobs span both. Every
step that can hang has a timeout; a job that overruns its wait is cancelled and its log
shown.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "slurm" / "local_cluster.sh"
CLUSTER_DIR = Path(os.environ.get("PIVOT_SLURM_DIR", "/tmp/pivot-slurm"))
START_TIMEOUT_S = 900  # includes apt-get install on a fresh machine
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
         "BOOT_FAIL", "DEADLINE", "PREEMPTED"}  # fmt: skip
# OpenMPI between the two fake nodes (same host): TCP over loopback (docs/platform.md)
TWO_NODE_ENV = {"OMPI_MCA_btl": "self,tcp", "OMPI_MCA_btl_tcp_if_include": "lo"}


def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "tests/slurm run a local Slurm cluster (slurmd, munged): they need root"
    installed = all(shutil.which(x) for x in ("slurmctld", "slurmd", "munged"))
    if not installed and shutil.which("apt-get") is None:
        return (
            "Slurm is not installed and apt-get is not available to install slurm-wlm, "
            "munge and libpmix-dev"
        )
    if shutil.which("mpirun") is None:
        return "needs OpenMPI (apt-get install openmpi-bin libopenmpi-dev; tests/run_all.sh does)"
    return None


@dataclass
class Slurm:
    """The running local cluster and helpers to submit to it and wait for jobs."""

    dir: Path

    def env(self, two_nodes: bool = False, **extra: str) -> dict[str, str]:
        """Environment for sbatch/srun: this checkout importable in every task."""
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTHONPATH": path, "SLURM_CONF": str(self.dir / "slurm.conf")}
        if two_nodes:
            env.update(TWO_NODE_ENV)
        env.update(extra)
        return env

    def sbatch(self, *args: str, env: dict[str, str] | None = None) -> str:
        p = subprocess.run(
            ["sbatch", "--parsable", *args],
            cwd=ROOT,
            env=env or self.env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert p.returncode == 0, f"sbatch {' '.join(args)} failed: {p.stdout}{p.stderr}"
        return p.stdout.strip().split(";")[0]

    def show(self, job: str) -> dict[str, str]:
        p = subprocess.run(
            ["scontrol", "-o", "show", "job", job],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=30,
        )
        return dict(re.findall(r"(\w+)=(\S*)", p.stdout)) if p.returncode == 0 else {}

    def wait(self, job: str, timeout_s: float, log: Path | None = None) -> dict[str, str]:
        """Poll `scontrol show job` until the job is in a final state; cancel on timeout."""
        deadline = time.monotonic() + timeout_s
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.show(job)
            if info.get("JobState") in FINAL:
                return info
            time.sleep(1)
        subprocess.run(["scancel", job], env=self.env(), timeout=30)
        text = log.read_text()[-4000:] if log is not None and log.exists() else "(no log)"
        pytest.fail(f"job {job} not finished after {timeout_s}s (state {info}); log:\n{text}")

    def wait_for(self, what: str, cond, timeout_s: float, job: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if cond():
                return
            if self.show(job).get("JobState") in FINAL:
                pytest.fail(f"job {job} ended before {what}")
            time.sleep(0.2)
        subprocess.run(["scancel", job], env=self.env(), timeout=30)
        pytest.fail(f"job {job}: no {what} after {timeout_s}s")


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[Slurm]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    env = {**os.environ, "PIVOT_SLURM_DIR": str(CLUSTER_DIR)}
    status = subprocess.run(
        ["bash", str(SCRIPT), "status"], env=env, capture_output=True, timeout=60
    )
    was_up = status.returncode == 0
    t0 = time.monotonic()
    try:
        p = subprocess.run(
            ["bash", str(SCRIPT), "start", "--two-nodes"],
            env=env,
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(
            f"slurm/local_cluster.sh start --two-nodes did not finish in {START_TIMEOUT_S}s: "
            f"{exc.stdout}{exc.stderr}"
        )
    if p.returncode != 0:
        pytest.fail(f"slurm/local_cluster.sh start --two-nodes failed:\n{p.stdout}{p.stderr}")
    print(f"local Slurm cluster up in {time.monotonic() - t0:.1f}s: {p.stdout.strip()}")
    yield Slurm(CLUSTER_DIR)
    if not was_up:
        subprocess.run(["bash", str(SCRIPT), "stop"], env=env, capture_output=True, timeout=120)
