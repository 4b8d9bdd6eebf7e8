"""GPS on real architectures under MPI (tests/mpi/gps_arch_worker.py): every tiny
architecture registered from its directory, loaded tensor by tensor from its safetensors,
read at tp 1, 2, 4 and written from tp 2, byte for byte against the checkpoint; replicated
(k=1) and sharded over two pseudo-nodes (k=2, half of every tensor remote)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pivot_hpc.recipes.tiny_arch_dirs import ARCHITECTURES, build_arch_dir

WORKER = Path(__file__).with_name("gps_arch_worker.py")
REPO = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("archs")
    return [build_arch_dir(a, root / a, dtype="bfloat16", seed=3) for a in ARCHITECTURES]


@pytest.mark.parametrize("group", [1, 2])
def test_every_architecture_round_trips_through_gps(dirs, group):
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.fail("mpirun not found: install openmpi-bin libopenmpi-dev (tests/run_all.sh does)")
    cmd = [mpirun, "-n", "4"]
    if "Open MPI" in subprocess.run([mpirun, "--version"], capture_output=True, text=True).stdout:
        cmd += ["--oversubscribe"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])
    cmd += [sys.executable, str(WORKER), "--group", str(group), *map(str, dirs)]
    env = dict(os.environ, OMPI_MCA_osc="^ucx", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"mpirun hung for 240 s:\n{(exc.stdout or '')[-3000:]}")
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "GPS-ARCH-OK" in p.stdout, out[-6000:]
