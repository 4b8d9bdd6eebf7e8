"""Issue 49, findings 4, 5 and 8: a run directory from someone else is refused in one line,
exit 2, before it can hang or crash `pivot-hpc run`.

- 4: a FIFO (`mkfifo` needs no privilege; `cp -a`, `tar`, `rsync -a` carry FIFOs along),
  a socket, a device or a symbolic link anywhere in a checkpoint is refused before
  anything in it is opened: a FIFO as `manifest.json` or as an unlisted `*.metadata` used
  to block `run` for ever.
- 5: who owns the run directory is checked before anything in it is read or announced.
- 8: the two bad checkpoints that still gave a traceback (a `TensorProperties` whose
  `__setstate__` raises RuntimeError; a manifest name over 255 bytes: ENAMETOOLONG).
"""

from __future__ import annotations

import json
import os
import pickle
import socket
from pathlib import Path

import pytest

from pivot_hpc.checkpoint import store
from pivot_hpc.cli.main import main
from tests.unit.test_checkpoint_store import TINY, reseal, tiny_config, write_ckpt

OTHER = 65534


def run_refused(run_dir: Path, capsys, monkeypatch) -> tuple[str, str]:
    """`pivot-hpc run` on `run_dir`: exit 2 and one line on stderr (returned, with stdout)."""
    monkeypatch.setenv("PATH", str(run_dir.parent / "no-mpirun-here"))  # a launch fails loudly
    code = main(["run", TINY, "--run-dir", str(run_dir)])
    out = capsys.readouterr()
    err = out.err.strip()
    assert code == 2 and len(err.splitlines()) == 1, (code, err)
    assert "Traceback" not in err and "mpirun" not in err, err
    return err, out.out


def _fifo(p: Path) -> None:
    os.mkfifo(p)


def _socket(p: Path) -> None:
    # bind by a relative name from its own directory: a pytest tmp path can exceed
    # AF_UNIX's 108-byte limit (CI's clone path is long)
    here = os.getcwd()
    os.chdir(p.parent)
    try:
        s = socket.socket(socket.AF_UNIX)
        s.bind(p.name)
        s.close()
    finally:
        os.chdir(here)


def _device(p: Path) -> None:
    try:
        os.mknod(p, 0o600 | 0o020000, os.makedev(1, 3))  # a character device: /dev/null's
    except PermissionError:
        pytest.skip("no CAP_MKNOD here")


def _dir_link(p: Path) -> None:
    p.symlink_to("/etc", target_is_directory=True)


SPECIAL = {
    "manifest.json a FIFO": ("manifest.json", _fifo, "manifest.json is a FIFO"),
    "an unlisted .metadata FIFO": ("train/evil.metadata", _fifo, "evil.metadata is a FIFO"),
    "a listed state file a FIFO": ("rl_state.json", _fifo, "rl_state.json is a FIFO"),
    "a weights FIFO": ("policy/model.safetensors", _fifo, "model.safetensors is a FIFO"),
    "a socket": ("policy/tokenizer.json", _socket, "tokenizer.json is a socket"),
    "a device": ("train/common.pt", _device, "common.pt is a character device"),
    "a linked directory": ("train", _dir_link, "train is a symbolic link"),
}


@pytest.mark.timeout(30)  # the FIFOs used to block here for ever
@pytest.mark.parametrize("case", sorted(SPECIAL))
def test_special_files_in_a_checkpoint_are_refused_before_they_are_opened(
    tmp_path: Path, capsys, monkeypatch, case: str
) -> None:
    rel, make, says = SPECIAL[case]
    ckpt = write_ckpt(tmp_path, tiny_config(), 5)
    target = ckpt / rel
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():
        target.unlink()
    make(target)
    err, _ = run_refused(tmp_path, capsys, monkeypatch)
    assert says in err and str(ckpt) in err, err
    with pytest.raises(store.CheckpointError, match=says.split(" is ")[0]):
        store.verify(ckpt)  # what rank 0 and the launcher's death line call too


@pytest.mark.timeout(30)
def test_a_checkpoint_that_is_itself_a_fifo_is_refused(tmp_path: Path, capsys, monkeypatch):
    write_ckpt(tmp_path, tiny_config(), 5)
    os.mkfifo(store.checkpoints_dir(tmp_path) / "ckpt-000009")
    err, _ = run_refused(tmp_path, capsys, monkeypatch)
    assert "ckpt-000009 is a FIFO" in err, err


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a directory away")
@pytest.mark.timeout(30)
@pytest.mark.parametrize("fifo", [False, True], ids=["plain", "with-a-fifo"])
def test_a_foreign_run_dir_is_refused_before_its_checkpoint_is_read(
    tmp_path: Path, capsys, monkeypatch, fifo: bool
) -> None:
    run_dir = tmp_path / "theirs"
    ckpt = write_ckpt(run_dir, tiny_config(), 5)
    if fifo:
        os.mkfifo(ckpt / "train.metadata")
    for root, dirs, files in os.walk(run_dir):
        for name in [".", *dirs, *files]:
            os.chown(os.path.join(root, name), OTHER, OTHER, follow_symlinks=False)
    read: list[Path] = []
    monkeypatch.setattr(store, "verify", lambda path: read.append(path) or {})
    err, out = run_refused(run_dir, capsys, monkeypatch)
    assert f"belongs to uid {OTHER}" in err, err
    assert read == [] and "resuming" not in out and "checkpoint" not in out, out


def _bad_memory_format() -> bytes:
    """A TensorProperties whose state names memory-format encoding 99: torch's
    __setstate__ raises RuntimeError (the review's bytes)."""
    P = pickle

    def sg(mod: bytes, name: bytes) -> bytes:
        return (
            P.SHORT_BINUNICODE + bytes([len(mod)]) + mod
            + P.SHORT_BINUNICODE + bytes([len(name)]) + name + P.STACK_GLOBAL
        )  # fmt: skip

    m = b"torch.distributed.checkpoint.metadata"
    return (
        P.PROTO + b"\x04" + sg(m, b"TensorProperties") + P.EMPTY_TUPLE + P.NEWOBJ + P.MARK
        + sg(b"torch", b"float32") + P.NONE + P.NEWFALSE + P.BININT1 + b"\x63"
        + P.NEWFALSE + P.TUPLE + P.BUILD + P.STOP
    )  # fmt: skip


def test_metadata_whose_setstate_raises_is_one_line(tmp_path: Path, capsys, monkeypatch):
    ckpt = write_ckpt(tmp_path, tiny_config(), 5)
    (ckpt / "train").mkdir()
    (ckpt / "train" / ".metadata").write_bytes(_bad_memory_format())
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"]["train/.metadata"] = {"bytes": 0, "crc32": 0}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    reseal(ckpt)  # anyone can recompute the CRCs
    err, _ = run_refused(tmp_path, capsys, monkeypatch)
    assert "train/.metadata" in err and "memory_format" in err, err


@pytest.mark.parametrize(
    "name", ["x" * 300, "policy/" + "y" * 256, "a\u0000b", "é" * 130], ids=str.__len__
)
def test_a_manifest_name_no_file_system_takes_is_one_line(
    tmp_path: Path, capsys, monkeypatch, name: str
) -> None:
    ckpt = write_ckpt(tmp_path, tiny_config(), 5)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"][name] = {"bytes": 1, "crc32": 0}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    err, _ = run_refused(tmp_path, capsys, monkeypatch)
    assert "manifest.json names" in err and "not a file name" in err, err
