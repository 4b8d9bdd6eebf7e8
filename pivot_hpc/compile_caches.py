"""Where compiled kernels are cached: private to this user, never a shared /tmp name.

Torch inductor's default cache is `/tmp/torchinductor_<user>`, made with
`os.makedirs(exist_ok=True)`: a directory of that name that another user created first is
used whoever owns it, and what it holds (generated C++ and Python, `.so` files it
`dlopen`s, pickled graphs) is loaded, not rewritten. vLLM's engine children compile and
load there. So every compile cache a job's processes use is set here, to a directory of
the job's model cache (`models.cache_dir`, $PIVOT_HPC_CACHE or ~/.cache/pivot_hpc), under
`compile/`, made 0700 and refused in one line if it, or a directory above it up to the
cache root, belongs to someone else or is writable by others (private_dirs.py). The
cache outlives a run, so a restart compiles nothing again. A variable the user set
already is kept and held to the same rule.

Set in each rank before torch loads (cli/run.py, cli/submit.py), checked once by the
launcher before any rank starts, and passed to every engine child (engines/process/child.py).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from pivot_hpc import private_dirs
from pivot_hpc.models.config import cache_root

# variable -> its directory under <cache root>/compile
CACHE_DIRS = {
    # torch inductor: generated C++/Python modules, the .so files built from them, FX graphs
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    # Triton's compiled kernels (inductor puts them under its own directory unless this is set)
    "TRITON_CACHE_DIR": "triton",
    # vLLM: torch_compile_cache (its own inductor and Triton directories inside), assets
    "VLLM_CACHE_ROOT": "vllm",
    # torch.utils.cpp_extension's JIT builds (.so)
    "TORCH_EXTENSIONS_DIR": "torch_extensions",
}
_FIX = "unset the variable or point it at a directory only you can write, or set models.cache_dir"


def resolved(env: Mapping[str, str] | None = None, cache_dir: Path | str | None = None) -> dict:
    """Each compile cache variable -> its directory, made and checked (UsageError, one
    line): `env`'s own value where it has one (os.environ by default), else its directory
    under the cache root of `cache_dir` (models.cache_dir)."""
    env = os.environ if env is None else env
    root = cache_root(cache_dir if cache_dir is not None else env.get("PIVOT_HPC_CACHE") or None)
    out = {}
    for var, name in CACHE_DIRS.items():
        given = env.get(var)
        if given:
            path = Path(given).absolute()
            private_dirs.ensure(path, f"{var}={given}:", _FIX)
        else:
            path = root / "compile" / name
            private_dirs.ensure(path, f"the compile cache ({var})", _FIX, up_to=root)
        out[var] = str(path)
    return out


def install(cache_dir: Path | str | None = None) -> None:
    """Point this process (and all it starts) at the private compile caches."""
    os.environ.update(resolved(os.environ, cache_dir))
