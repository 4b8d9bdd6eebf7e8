"""A checkpoint from someone else is data, never code: hostile pickles planted in a real
megatron-core checkpoint's `train/.metadata` (with the manifest's CRCs recomputed, as an
attacker would) are refused before any rank starts and again when a training rank loads
the checkpoint; no payload runs; the genuine checkpoint still loads bit for bit."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pivot_hpc.checkpoint import store
from pivot_hpc.cli.main import main
from pivot_hpc.config import to_dict
from pivot_hpc.job.config import load_config
from tests.engines.pickle_payloads import payloads, plant

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("ckpt_payload_worker.py")
TINY = str(REPO / "configs" / "tiny.yaml")
NAMES = sorted(payloads("x"))

# Every test needs `genuine`, a megatron-core checkpoint saved by a worker process (10-15 s):
# the full suite (CI) runs them; tests/unit/test_checkpoint_store.py is the fast tier's.
pytestmark = pytest.mark.slow


def _worker(*args: str, timeout: float = 240) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(
        os.environ,
        RANK="0",
        WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(REPO),
    )
    done = subprocess.run(
        [sys.executable, str(WORKER), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]


@pytest.fixture(scope="module")
def genuine(tmp_path_factory) -> Path:
    """A real megatron-core distributed checkpoint of the tiny architecture."""
    out = tmp_path_factory.mktemp("genuine")
    _worker("save", str(out))
    return out


def _planted(genuine: Path, where: Path, name: str, marker: Path) -> Path:
    """A copy of the genuine checkpoint with payload `name` in front of its metadata."""
    shutil.copytree(genuine, where)
    meta = where / "train" / ".metadata"
    meta.write_bytes(plant(meta.read_bytes(), payloads(str(marker))[name]))
    return where


def _pivot_checkpoint(run_dir: Path, train_src: Path) -> Path:
    """A complete pivot_hpc checkpoint (manifest with fresh CRCs) holding `train_src`."""
    tmp = store.begin(run_dir)
    shutil.copytree(train_src / "train", tmp / "train")
    (tmp / "rl_state.json").write_text("{}")
    return store.commit(tmp, {"step": 3, "reason": "periodic"}, to_dict(load_config(TINY)), 2)


def test_the_payloads_would_run_under_a_plain_load(genuine: Path, tmp_path: Path) -> None:
    """Sanity check of the test itself: the planted file is a working exploit (run in a
    child, since it changes process state)."""
    marker = tmp_path / "ran"
    meta = _planted(genuine, tmp_path / "c", "dotted_name", marker) / "train" / ".metadata"
    code = f"import pickle; print(type(pickle.load(open({str(meta)!r}, 'rb'))).__name__)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "Metadata" and marker.exists()


@pytest.mark.parametrize("name", NAMES)
def test_resume_refuses_a_planted_payload_before_any_rank(
    genuine: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    marker = tmp_path / "ran"
    src = _planted(genuine, tmp_path / "src", name, marker)
    run_dir = tmp_path / "run"
    ckpt = _pivot_checkpoint(run_dir, src)
    with pytest.raises(store.CheckpointError, match=r"train/\.metadata"):
        store.verify(ckpt)
    monkeypatch.setenv("PATH", str(tmp_path / "no-mpirun-here"))  # a launch would fail loudly
    assert main(["run", TINY, "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert ".metadata" in err and "not loaded" in err and "mpirun" not in err
    assert not marker.exists()


def test_the_genuine_checkpoint_passes_the_same_check(genuine: Path, tmp_path: Path) -> None:
    store.verify(_pivot_checkpoint(tmp_path / "run", genuine))


@pytest.mark.slow  # a second worker process: the full suite (CI) runs it
@pytest.mark.timeout(300)
def test_the_training_rank_refuses_payloads_and_loads_the_genuine_bitwise(
    genuine: Path, tmp_path: Path
) -> None:
    """At load time, not only before launch: a file swapped after the check (or a checkpoint
    loaded by other means) goes through the same allow-list inside torch's DCP reader."""
    marker = tmp_path / "ran"
    dirs = [genuine] + [_planted(genuine, tmp_path / n, n, marker) for n in NAMES]
    out = tmp_path / "results.json"
    _worker("load", str(out), *map(str, dirs))
    results = json.loads(out.read_text())
    assert results[str(genuine)] == {"loaded": True, "bitwise": True}
    for d in dirs[1:]:
        got = results[str(d)]
        assert not got["loaded"] and "UnsafePickleError" in got["error"], (d.name, got)
        assert ".metadata" in got["error"]
    assert not marker.exists()


@pytest.mark.parametrize("where", ["../outside.distcp", "/etc/passwd", "sub/../../x"])
def test_metadata_that_stores_tensors_outside_the_checkpoint_is_refused(
    genuine: Path, tmp_path: Path, where: str
) -> None:
    """Plain data, but it would make DCP read another file into the weights."""
    import dataclasses
    import pickle

    from pivot_hpc.checkpoint.safe_pickle import load_metadata

    src = tmp_path / "src"
    shutil.copytree(genuine, src)
    meta = src / "train" / ".metadata"
    with open(meta, "rb") as f:
        md = load_metadata(f)
    md.storage_data = {
        k: dataclasses.replace(v, relative_path=where) for k, v in md.storage_data.items()
    }
    meta.write_bytes(pickle.dumps(md))
    with pytest.raises(store.CheckpointError, match="outside the checkpoint's own files"):
        store.verify(_pivot_checkpoint(tmp_path / "run", src))


@pytest.mark.parametrize(
    "text",
    [
        '{"sharded_backend": "zarr", "sharded_backend_version": 1, "common_backend": "torch"}',
        "[" * 100_000 + "]" * 100_000,
        "not json",
    ],
)
def test_a_train_config_that_picks_other_loaders_is_refused(
    genuine: Path, tmp_path: Path, text: str
) -> None:
    """megatron's metadata.json chooses the loaders of the rest: only ours are accepted."""
    src = tmp_path / "src"
    shutil.copytree(genuine, src)
    (src / "train" / "metadata.json").write_text(text)
    with pytest.raises(store.CheckpointError, match="train/metadata.json"):
        store.verify(_pivot_checkpoint(tmp_path / "run", src))
