"""Issue 49, finding 2: compile caches are private. Torch inductor's default,
`/tmp/torchinductor_<user>`, is a name anyone can create first; vLLM's children compile
and `dlopen` there. Every compile cache a job uses is now under its model cache's
`compile/`, made 0700, and one that belongs to someone else or that others can write to
is refused in one line (pivot_hpc/compile_caches.py). "Another user" is uid 65534."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from pivot_hpc import compile_caches
from pivot_hpc.errors import UsageError

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")
OTHER = 65534
as_root = pytest.mark.skipif(os.getuid() != 0, reason="needs root to play another user")


def test_every_compile_cache_is_private_under_the_model_cache(tmp_path: Path) -> None:
    dirs = compile_caches.resolved({}, cache_dir=tmp_path / "cache")
    assert (
        set(dirs)
        == set(compile_caches.CACHE_DIRS)
        >= {
            "TORCHINDUCTOR_CACHE_DIR",
            "TRITON_CACHE_DIR",
            "VLLM_CACHE_ROOT",
        }
    )
    for var, path in dirs.items():
        p = Path(path)
        assert p == tmp_path / "cache" / "compile" / compile_caches.CACHE_DIRS[var]
        st = p.stat()
        assert st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700, (p, st)
    assert compile_caches.resolved({}, cache_dir=tmp_path / "cache") == dirs  # again: same


@as_root
def test_a_cache_directory_another_user_made_first_is_refused(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    planted = cache / "compile" / "inductor"
    planted.mkdir(parents=True)
    planted.chmod(0o777)
    os.chown(planted, OTHER, OTHER)
    with pytest.raises(UsageError) as info:
        compile_caches.resolved({}, cache_dir=cache)
    msg = str(info.value)
    assert "\n" not in msg and str(planted) in msg and f"belongs to uid {OTHER}" in msg, msg


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770])
def test_a_given_cache_others_can_write_is_refused(tmp_path: Path, mode: int) -> None:
    shared = tmp_path / "torchinductor_shared"
    shared.mkdir()
    shared.chmod(mode)
    with pytest.raises(UsageError) as info:
        compile_caches.resolved({"TORCHINDUCTOR_CACHE_DIR": str(shared)}, cache_dir=tmp_path)
    msg = str(info.value)
    assert "TORCHINDUCTOR_CACHE_DIR=" in msg and f"has mode {mode:o}" in msg, msg
    # a private one the user chose is kept
    own = tmp_path / "mine"
    got = compile_caches.resolved({"TORCHINDUCTOR_CACHE_DIR": str(own)}, cache_dir=tmp_path)
    assert got["TORCHINDUCTOR_CACHE_DIR"] == str(own) and own.is_dir()


@as_root
@pytest.mark.timeout(60)
def test_engine_children_no_longer_get_the_shared_tmp_name(tmp_path: Path) -> None:
    """The review's reproducer: with TMPDIR a sticky world-writable directory and another
    user's `torchinductor_victim` already in it, the cache the engine children get was
    that directory. Now it is the private one under the model cache."""
    faketmp = tmp_path / "faketmp"
    faketmp.mkdir()
    faketmp.chmod(0o1777)
    theirs = faketmp / "torchinductor_victim"
    theirs.mkdir()
    theirs.chmod(0o777)
    os.chown(theirs, OTHER, OTHER)
    env = {
        **os.environ,
        "TMPDIR": str(faketmp),
        "USER": "victim",
        "LOGNAME": "victim",
        "PIVOT_HPC_CACHE": str(tmp_path / "cache"),
        "PYTHONPATH": str(REPO),
    }
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    code = "from pivot_hpc.engines.process.child import _inductor_cache_dir as d; print(d())"
    out = subprocess.run(
        [sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True, timeout=50
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = Path(out.stdout.strip())
    assert got == tmp_path / "cache" / "compile" / "inductor", got
    assert got.stat().st_uid == os.getuid() and stat.S_IMODE(got.stat().st_mode) == 0o700


def test_run_refuses_a_shared_compile_cache_before_launch(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    from pivot_hpc.cli.main import main

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(shared))
    monkeypatch.setenv("PATH", str(tmp_path / "no-mpirun-here"))  # a launch fails loudly
    code = main(["run", TINY, "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "TRITON_CACHE_DIR=" in err and "mpirun" not in err, err


def test_the_ranks_take_the_private_caches(tmp_path: Path, monkeypatch) -> None:
    """`install` (each rank, before torch compiles) sets every variable, and an engine
    child is handed the same (engines/process/child.py)."""
    for var in compile_caches.CACHE_DIRS:  # set first, so that teardown restores each
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    compile_caches.install(tmp_path / "cache")
    want = compile_caches.resolved({}, cache_dir=tmp_path / "cache")
    assert {v: os.environ[v] for v in want} == want
    from pivot_hpc.engines.process.child import _inductor_cache_dir

    assert _inductor_cache_dir() == want["TORCHINDUCTOR_CACHE_DIR"]
