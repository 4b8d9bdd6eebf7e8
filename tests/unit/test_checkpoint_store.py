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
from pivot_hpc.config import to_dict
from pivot_hpc.job.config import load_config

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny.yaml")


def write_ckpt(run_dir: Path, config: dict, step: int, keep: int = 2, payload: bytes = b"w"):
    tmp = store.begin(run_dir)
    (tmp / "policy").mkdir()
    (tmp / "policy" / "model.safetensors").write_bytes(payload * 1000)
    (tmp / "rl_state.json").write_bytes(b"state")
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
        "rl_state.json",
    }
    # a job killed while writing leaves only a temporary directory: never "complete"
    tmp = store.begin(tmp_path)
    (tmp / "rl_state.json").write_bytes(b"half")
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
    lr = tiny_config()["rl"]["trainer"]["lr"]
    code = main(["run", TINY, "--run-dir", str(tmp_path), "rl.trainer.lr=1e-3"])
    err = capsys.readouterr().err
    assert code == 2
    assert "different config" in err and f"rl.trainer.lr: {lr} → 0.001" in err
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


class _Payload:
    """Runs code when unpickled: what a crafted checkpoint would hold."""

    def __reduce__(self):
        import os

        return (os.system, ("touch /tmp/pivot-hpc-pwned-by-checkpoint",))


def _crafted_pickle() -> bytes:
    import pickle

    return pickle.dumps(_Payload())


@pytest.mark.parametrize("name", ["rl_state.pkl", "ranks.pkl", "train/extra.pkl"])
def test_a_checkpoint_with_a_pickle_is_refused_by_name(tmp_path: Path, capsys, name: str) -> None:
    """Files earlier versions unpickled: planted with a payload, nothing runs, the error
    names the file, before any rank starts."""
    marker = Path("/tmp/pivot-hpc-pwned-by-checkpoint")
    marker.unlink(missing_ok=True)
    tmp = store.begin(tmp_path)
    (tmp / "policy").mkdir()
    (tmp / "policy" / "model.safetensors").write_bytes(b"w" * 100)
    (tmp / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp / name).write_bytes(_crafted_pickle())
    store.commit(tmp, {"step": 3, "reason": "periodic"}, tiny_config(), 2)
    code = main(["run", TINY, "--run-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and name in err and "never unpickles" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not marker.exists()


def test_state_files_with_a_pickle_inside_are_data_errors(tmp_path: Path) -> None:
    """JSON state files decode into registered types only: pickle bytes or an unknown type
    are a clear error naming the file, never code."""
    from pivot_hpc.checkpoint import codec
    from pivot_hpc.runtime.checkpointing import RL_STATE, load_state

    (tmp_path / RL_STATE).write_bytes(_crafted_pickle())
    with pytest.raises(store.CheckpointError, match="rl_state.json: not a pivot_hpc state"):
        load_state(tmp_path, RL_STATE)
    evil = {"__dataclass__": "Popen", "fields": {"args": ["touch", "/tmp/x"]}}
    (tmp_path / RL_STATE).write_text(json.dumps({"rl": evil}))
    with pytest.raises(store.CheckpointError, match="unknown type 'Popen'"):
        load_state(tmp_path, RL_STATE)
    # the real state round-trips: samples with live payloads, partials keyed by tuples
    from pivot_hpc.coordinator.rl_state import Sample
    from pivot_hpc.data.problem import Problem
    from pivot_hpc.engines.base import SeqResult
    from pivot_hpc.runtime.live_payload import LivePayload

    res = SeqResult(7, [1, 2], [3, 4], [-0.5, -1.25], "abort", version=2)
    s = Sample(7, 1, 3, 0, 2, LivePayload(Problem("p", "4"), [1, 2], res), version_start=1)
    s.reward_verifiable, s.reward_genrm = 1.0, 0.5  # (NaN, the default, is != itself)
    state = {"rl": {"batches": {1: [s]}}, "partials": {("rollout", 7): res}}
    import numpy as np
    import torch

    state["rng"] = (torch.get_rng_state(), np.random.get_state(), float("nan"))
    back = codec.loads(codec.dumps(state), "x")
    assert back["rl"]["batches"][1][0] == s and back["partials"][("rollout", 7)] == res
    assert torch.equal(back["rng"][0], state["rng"][0])
    assert (back["rng"][1][1] == state["rng"][1][1]).all()


def test_dcp_metadata_allow_list_accepts_plain_data_and_refuses_code(tmp_path: Path) -> None:
    import pickle

    import torch
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    from pivot_hpc.checkpoint.safe_pickle import UnsafePickleError, check_metadata

    md = Metadata(
        state_dict_metadata={
            "w": TensorStorageMetadata(
                TensorProperties(dtype=torch.bfloat16),
                torch.Size([4, 4]),
                [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 4]))],
            )
        }
    )
    ok = tmp_path / ".metadata"
    ok.write_bytes(pickle.dumps(md))
    check_metadata(ok)
    bad = tmp_path / "evil.metadata"
    bad.write_bytes(_crafted_pickle())
    with pytest.raises(UnsafePickleError, match="system"):
        check_metadata(bad)


def test_run_dir_that_is_a_file_is_one_line_before_any_rank(tmp_path: Path, capsys) -> None:
    f = tmp_path / "not-a-dir"
    f.write_text("x")
    for run_dir in (f, f / "sub"):
        code = main(["run", TINY, "--run-dir", str(run_dir)])
        err = capsys.readouterr().err
        assert code == 2 and "is a file, not a directory" in err
        assert len(err.strip().splitlines()) == 1


def reseal(path: Path) -> None:
    """Rewrite the manifest's sizes and CRCs to match the files (a hand-edited checkpoint)."""
    manifest = json.loads((path / "manifest.json").read_text())
    for rel in manifest["files"]:
        p = path / rel
        manifest["files"][rel] = {"bytes": p.stat().st_size, "crc32": store._crc32(p)}
    (path / "manifest.json").write_text(json.dumps(manifest))


def edit_manifest(**changes):
    def apply(path: Path) -> None:
        m = json.loads((path / "manifest.json").read_text())
        for k, v in changes.items():
            if v is ...:
                m.pop(k)
            else:
                m[k] = v
        (path / "manifest.json").write_text(json.dumps(m))

    return apply


def edit_config(text: bytes):
    def apply(path: Path) -> None:
        (path / "config.yaml").write_bytes(text)
        reseal(path)

    return apply


MALFORMED = {
    "manifest is a list": (lambda p: (p / "manifest.json").write_text("[]"), "holds a list"),
    "manifest is binary": (
        lambda p: (p / "manifest.json").write_bytes(b"\xff\xfe\x00"),
        "unreadable manifest.json",
    ),
    "manifest nested deeply": (
        lambda p: (p / "manifest.json").write_text("[" * 100_000 + "]" * 100_000),
        "nested too deeply",
    ),
    "no files": (edit_manifest(files=...), "lists no files"),
    "file added afterwards": (
        lambda p: (p / "policy" / "extra.metadata").write_bytes(b"x"),
        "policy/extra.metadata is not in its manifest.json",
    ),
    "a link": (
        lambda p: (p / "policy" / "passwd").symlink_to("/etc/passwd"),
        "policy/passwd is a symbolic link",
    ),
    "files is a list": (edit_manifest(files=["a"]), "lists no files"),
    "no step": (edit_manifest(step=...), "has step None"),
    "step is text": (edit_manifest(step="five"), "has step 'five'"),
    "negative step": (edit_manifest(step=-1), "has step -1"),
    "bad file entry": (edit_manifest(files={"rl_state.json": 3}), "entry 'rl_state.json' is 3"),
    "path escapes": (
        edit_manifest(files={"../../x": {"bytes": 1, "crc32": 0}}),
        "outside the checkpoint directory",
    ),
    "config not yaml": (edit_config(b"a: [\n"), "unreadable config.yaml"),
    "config not utf-8": (edit_config(b"\xff\xfe"), "unreadable config.yaml"),
    "config a list": (edit_config(b"- 1\n- 2\n"), "config.yaml holds a list"),
    "config a billion laughs": (
        edit_config(
            b"a: &a [x, x, x, x, x, x, x, x, x]\n"
            + b"".join(
                f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n".encode()
                for p, c in zip("abcdefgh", "bcdefghi", strict=True)
            )
            + b"loop: {steps: *i}\n"
        ),
        "aliases",
    ),
    "config of another shape": (edit_config(b"bogus: 1\n"), "different config"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_checkpoints_are_one_line_naming_the_file(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    damage, says = MALFORMED[case]
    damage(write_ckpt(tmp_path, tiny_config(), 5))
    monkeypatch.setenv("PATH", str(tmp_path / "no-mpirun-here"))  # a launch would fail loudly
    assert main(["run", TINY, "--run-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err and "mpirun" not in err


@pytest.mark.parametrize(
    "text, says",
    [
        ('{"t": {"__tensor__": "AAAA", "dtype": "float32", "shape": [7, 7]}}', "not a pivot"),
        ('{"a": {"__ndarray__": "AAAA", "dtype": "<f4", "shape": [9]}}', "not a pivot"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ],
)
def test_malformed_state_files_are_one_line(tmp_path: Path, text: str, says: str) -> None:
    from pivot_hpc.runtime.checkpointing import RL_STATE, load_state

    (tmp_path / RL_STATE).write_text(text)
    with pytest.raises(store.CheckpointError, match=says) as err:
        load_state(tmp_path, RL_STATE)
    assert len(str(err.value).splitlines()) == 1 and len(str(err.value)) < 400


def test_a_key_added_after_the_checkpoint_is_compared_with_its_default(tmp_path: Path) -> None:
    """A checkpoint written before a config key existed ran with the key's default: an
    upgrade of pivot_hpc between allocations resumes, a changed value is still refused."""
    from pivot_hpc.job.config import default_dict

    saved = tiny_config()
    del saved["engines"]["rollout"]["process"]  # as written by a pivot_hpc without the key
    write_ckpt(tmp_path, saved, 5)
    found = store.find_resume(tmp_path, tiny_config(), defaults=default_dict())
    assert found is not None and found[1]["step"] == 5
    with pytest.raises(store.CheckpointError, match="engines.rollout.process: 'in_rank' → 'child'"):
        store.find_resume(
            tmp_path, tiny_config("engines.rollout.process=child"), defaults=default_dict()
        )


def test_a_checkpoint_with_the_simulators_old_keys_still_resumes(tmp_path: Path) -> None:
    """Checkpoints written before the simulator's settings moved into the live sections
    (configs/groups/) hold `sim.hardware` and friends; a live run never read them."""
    from pivot_hpc.job.config import default_dict

    saved = tiny_config()
    saved["sim"].update(hardware="h20", training_tp=1, policy_model="qwen2.5-7b")
    write_ckpt(tmp_path, saved, 4)
    found = store.find_resume(tmp_path, tiny_config(), defaults=default_dict())
    assert found is not None and found[1]["step"] == 4
