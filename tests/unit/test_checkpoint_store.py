"""Checkpoint directories: atomic commit, newest-complete discovery, pruning, verification,
and the resume checks a user meets before any rank starts (config mismatch, corruption,
missing dataset)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pivot_hpc.checkpoint import store
from pivot_hpc.cli.main import main
from pivot_hpc.config import load_config, to_dict

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")


def write_ckpt(run_dir: Path, config: dict, step: int, keep: int = 2, payload: bytes = b"w"):
    tmp = store.begin(run_dir)
    (tmp / "policy").mkdir()
    (tmp / "policy" / "model.safetensors").write_bytes(payload * 1000)
    (tmp / "rl_state.pkl").write_bytes(b"state")
    return store.commit(tmp, {"step": step, "reason": "periodic"}, config, keep)


def tiny_config(*overrides: str) -> dict:
    return to_dict(load_config(TINY, list(overrides)))


def test_commit_is_atomic_newest_wins_and_old_ones_are_pruned(tmp_path: Path) -> None:
    cfg = tiny_config()
    assert store.newest(tmp_path) is None
    paths = [write_ckpt(tmp_path, cfg, step) for step in (1, 2, 3)]
    assert [p.name for p in paths] == ["ckpt-000001", "ckpt-000002", "ckpt-000003"]
    assert store.complete(tmp_path) == paths[1:]  # keep=2
    manifest = store.verify(paths[2])
    assert manifest["step"] == 3 and set(manifest["files"]) == {
        "config.yaml",
        "policy/model.safetensors",
        "rl_state.pkl",
    }
    # a job killed while writing leaves only a temporary directory: never "complete"
    tmp = store.begin(tmp_path)
    (tmp / "rl_state.pkl").write_bytes(b"half")
    assert store.newest(tmp_path) == paths[2]
    # ... and one killed while pruning leaves a renamed directory, also never complete
    doomed = store.checkpoints_dir(tmp_path) / ".del-ckpt-000001"
    doomed.mkdir()
    nxt = write_ckpt(tmp_path, cfg, 4)
    assert nxt.name == "ckpt-000004" and store.newest(tmp_path) == nxt
    assert not tmp.exists() and not doomed.exists()  # leftovers are cleaned up


def test_resume_finds_the_newest_and_accepts_allowed_changes(tmp_path: Path) -> None:
    write_ckpt(tmp_path, tiny_config(), 5)
    path, manifest = store.find_resume(
        tmp_path, tiny_config("loop.steps=40", "checkpoint.keep=4", "planner.interval_s=2")
    )
    assert path.name == "ckpt-000001" and manifest["step"] == 5


def test_config_mismatch_is_refused_naming_the_keys(tmp_path: Path, capsys) -> None:
    write_ckpt(tmp_path, tiny_config(), 5)
    code = main(["run", TINY, "--run-dir", str(tmp_path), "rl.trainer.lr=1e-3"])
    err = capsys.readouterr().err
    assert code == 2
    assert "different config" in err and "rl.trainer.lr: 0.0005 → 0.001" in err
    assert "config.yaml" in err and "new --run-dir" in err


@pytest.mark.parametrize("damage", ["truncate", "flip", "remove", "manifest"])
def test_a_damaged_checkpoint_is_reported_with_the_file(
    tmp_path: Path, capsys, damage: str
) -> None:
    path = write_ckpt(tmp_path, tiny_config(), 5)
    target = path / "policy" / "model.safetensors"
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[:100])
    elif damage == "flip":
        data = bytearray(target.read_bytes())
        data[10] ^= 0xFF
        target.write_bytes(bytes(data))
    elif damage == "remove":
        target.unlink()
    else:
        (path / "manifest.json").write_text("{not json")
    code = main(["run", TINY, "--run-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and str(path) in err and "delete" in err
    if damage != "manifest":
        assert "policy/model.safetensors" in err


def test_resume_false_refuses_a_run_dir_with_checkpoints(tmp_path: Path, capsys) -> None:
    write_ckpt(tmp_path, tiny_config(), 5)
    assert main(["run", TINY, "--run-dir", str(tmp_path), "checkpoint.resume=false"]) == 2
    assert "checkpoint.resume=false" in capsys.readouterr().err


def test_a_missing_dataset_file_is_an_error_before_any_work(tmp_path: Path, capsys) -> None:
    missing = tmp_path / "dapo.jsonl"
    assert main(["run", TINY, "--run-dir", str(tmp_path), f"rl.data.train={missing}"]) == 2
    err = capsys.readouterr().err
    assert "rl.data.train" in err and str(missing) in err and "not found" in err
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "telemetry").exists()


def test_saved_config_is_the_users_config(tmp_path: Path) -> None:
    cfg = tiny_config("loop.steps=7")
    path = write_ckpt(tmp_path, cfg, 1)
    assert yaml.safe_load((path / "config.yaml").read_text()) == json.loads(json.dumps(cfg))
