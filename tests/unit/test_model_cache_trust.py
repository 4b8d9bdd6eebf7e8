"""Issue 49, finding 9: the model cache (`models.cache_dir`, $PIVOT_HPC_CACHE) gets the run
directory's rule. Its entries' keys are hashes of public settings, so whoever can write to
the cache can plant the weights, tokenizer and profiles a job trains with: a cache root,
part or entry that belongs to someone else or that others can write to is refused in one
line (pivot_hpc/models/cache_trust.py). "Another user" is uid 65534."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pivot_hpc.cli.main import main
from pivot_hpc.errors import UsageError
from pivot_hpc.job.config import load_config
from pivot_hpc.models.zoo import model_dir
from pivot_hpc.recipes.tiny_models import ensure_model, ensure_models

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")
OTHER = 65534
as_root = pytest.mark.skipif(os.getuid() != 0, reason="needs root to play another user")


def planted(cache: Path) -> Path:
    """Both tiny models 'cached' in `cache` (a meta.json is all ensure_model looks for)."""
    models = load_config(TINY, [f"models.cache_dir={cache}"]).models
    for kind in ("policy", "genrm"):
        d = model_dir(models, kind)
        d.mkdir(parents=True)
        (d / "meta.json").write_text('{"planted_by": "uid 65534"}')
    return cache


def give_away(root: Path, mode: int | None = None) -> None:
    for path, dirs, files in os.walk(root):
        for name in [".", *dirs, *files]:
            p = os.path.join(path, name)
            os.chown(p, OTHER, OTHER)
            if mode is not None and name in [".", *dirs]:
                os.chmod(p, mode)


@as_root
def test_another_users_cache_is_refused(tmp_path: Path) -> None:
    """The review's reproducer: a 0777 cache of uid 65534's holding both models."""
    cache = planted(tmp_path / "shared_cache")
    give_away(cache, 0o777)
    models = load_config(TINY, [f"models.cache_dir={cache}"]).models
    with pytest.raises(UsageError) as info:
        ensure_models(models, progress=False)
    msg = str(info.value)
    assert "\n" not in msg and str(cache) in msg and f"belongs to uid {OTHER}" in msg, msg


@as_root
def test_a_planted_entry_in_your_own_cache_is_refused(tmp_path: Path) -> None:
    cache = planted(tmp_path / "cache")
    models = load_config(TINY, [f"models.cache_dir={cache}"]).models
    entry = model_dir(models, "genrm")
    give_away(entry)
    assert ensure_model(models, "policy", progress=False) == model_dir(models, "policy")
    with pytest.raises(UsageError, match=f"cached model {entry} belongs to uid {OTHER}"):
        ensure_model(models, "genrm", progress=False)


@pytest.mark.parametrize("part", ["", "models", "profiles", "compile"])
def test_a_cache_others_can_write_is_refused(tmp_path: Path, part: str) -> None:
    cache = planted(tmp_path / "cache")
    (cache / part).mkdir(exist_ok=True)
    (cache / part).chmod(0o777)
    models = load_config(TINY, [f"models.cache_dir={cache}"]).models
    with pytest.raises(UsageError, match="has mode 777, writable by others"):
        ensure_model(models, "policy", progress=False)


def test_your_own_cache_is_used(tmp_path: Path) -> None:
    cache = planted(tmp_path / "cache")
    models = load_config(TINY, [f"models.cache_dir={cache}"]).models
    assert ensure_models(models, progress=False) == (
        model_dir(models, "policy"),
        model_dir(models, "genrm"),
    )


@pytest.mark.parametrize("how", ["config", "environment"])
def test_run_refuses_a_shared_cache_before_launch(
    tmp_path: Path, capsys, monkeypatch, how: str
) -> None:
    cache = planted(tmp_path / "shared")
    cache.chmod(0o777)
    monkeypatch.setenv("PATH", str(tmp_path / "no-mpirun-here"))  # a launch fails loudly
    args = ["run", TINY, "--run-dir", str(tmp_path / "run")]
    if how == "config":
        args.append(f"models.cache_dir={cache}")
    else:
        monkeypatch.setenv("PIVOT_HPC_CACHE", str(cache))
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"the model cache {cache} has mode 777" in err, err
    assert "mpirun" not in err
