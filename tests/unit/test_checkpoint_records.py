"""Issue 49, finding 6: every record a checkpoint holds is checked as input. The codec used
to rebuild a saved trajectory with its constructor, so `Trajectory.from_dict`'s checks
never ran: a token id of -5 ended in torch.embedding's IndexError on the training rank, an
MPI abort, and "running the same command resumes" into the same abort. Now each record is
checked as it is decoded, and before any rank starts the state files are decoded whole and
every token id and sequence checked against its model (runtime/checkpoint_records.py):
one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pivot_hpc.agentic.trajectory import CallRecord, Segment, Trajectory
from pivot_hpc.checkpoint import codec, store
from pivot_hpc.cli.main import main
from pivot_hpc.coordinator.rl_state import Sample
from pivot_hpc.data.problem import Problem
from pivot_hpc.engines.base import SeqResult
from pivot_hpc.rl.rewards import GenRMStats
from pivot_hpc.runtime.checkpointing import RANKS, RL_STATE, coordinator_rng
from pivot_hpc.runtime.live_payload import LivePayload
from tests.unit.test_checkpoint_store import TINY, tiny_config

VOCAB = 128  # configs/tiny.yaml's models (ModelConfig.vocab_size)


def genuine_state(traj_ids: list[int] | None = None, **response: object) -> dict:
    """An RL state shaped like a live run's: a rewarded sample with a tool trajectory
    waiting for training, and a partial rollout."""
    res = SeqResult(7, [1, 2], [3, 4], [-0.5, -1.25], "stop", version=2)
    for k, v in response.items():
        setattr(res, k, v)
    traj = Trajectory(7, [1, 2], segments=[Segment("gen", traj_ids or [3, 4], [-0.5, -1.25], 2)])
    payload = LivePayload(Problem("p", "4"), [1, 2], res, [5, 6], "score: 1", traj)
    s = Sample(7, 1, 3, 0, 2, payload, version_start=1, response_len=2, rolled_out=True)
    s.rewarded, s.reward_verifiable, s.reward_genrm = True, 1.0, 0.5
    partial = SeqResult(9, [1, 2], [8], [-0.1], "abort", version=2)
    rl = {
        "version": 1,
        "released": 2,
        "data_cursor": 8,
        "next_sample_id": 10,
        "batches": {1: [s]},
        "rewarded_count": {1: 1},
        "filtered": {},
        "resampled": {},
    }
    return {
        "rl": rl,
        "partials": {("rollout", 9): partial},
        "rewards": [1.5],
        "genrm_stats": GenRMStats(judged=1),
    }


def write_resumable(run_dir: Path, state: dict | bytes, ranks: dict | None = None) -> Path:
    """A complete checkpoint of configs/tiny.yaml holding `state` as rl_state.json."""
    tmp = store.begin(run_dir)
    (tmp / "policy").mkdir()
    (tmp / "policy" / "model.safetensors").write_bytes(b"w" * 100)
    raw = state if isinstance(state, bytes) else codec.dumps(state)
    (tmp / RL_STATE).write_bytes(raw)
    (tmp / RANKS).write_bytes(codec.dumps(ranks if ranks is not None else {0: coordinator_rng()}))
    return store.commit(tmp, {"step": 1, "reason": "periodic"}, tiny_config(), 2)


def refused(run_dir: Path, capsys, monkeypatch) -> str:
    monkeypatch.setenv("PATH", str(run_dir / "no-mpirun-here"))  # a launch fails loudly
    code = main(["run", TINY, "--run-dir", str(run_dir)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, (code, err)
    assert "Traceback" not in err and "mpirun" not in err, err
    return err


def test_a_genuine_state_passes(tmp_path: Path) -> None:
    from pivot_hpc.job.config import load_config
    from pivot_hpc.runtime.resume_check import find_resume

    ckpt = write_resumable(tmp_path, genuine_state())
    found = find_resume(tmp_path, load_config(TINY))
    assert found is not None and found[0] == ckpt


def test_the_reviewers_trajectory_is_refused_as_it_is_decoded() -> None:
    """What from_dict refuses, the codec now refuses: a string id, token ids below zero, of
    the wrong type or too large, a segment kind of its own, a parked state with a bad call."""
    bad = {
        "__dataclass__": "Trajectory",
        "fields": {
            "traj_id": "not-an-int",
            "prompt_ids": [1, -5, "x", 2**80],
            "segments": [],
            "calls": [],
            "state": "parked",
            "end_reason": None,
        },
    }
    with pytest.raises(codec.CodecError, match="rl_state.json: Trajectory: trajectory"):
        codec.loads(json.dumps(bad).encode(), RL_STATE)


@pytest.mark.parametrize(
    "record, says",
    [
        (Segment("gen", [3, -5], [0.0, 0.0]), "segment token_ids"),
        (Segment("weird", [3]), "segment kind"),
        (Segment("gen", [3], [1.0, 2.0, 3.0]), "segment logprobs"),
        (CallRecord(None, 42, {"not": "a string"}, "yes", 0), "call call_id"),  # type: ignore[arg-type]
        (CallRecord(1, "calculator", "1" * 5000, True, True), "characters, over 4096"),
        (SeqResult(1, [1], [-5], [0.0], "stop"), "sequence token_ids"),
        (SeqResult(1, [1], [5], [0.0], "exploded"), "finish_reason"),
        (Problem("p", 4), "problem answer"),  # type: ignore[arg-type]
        (GenRMStats(judged=-1), "genrm_stats judged"),
        (Sample(1, 1, 1, 0, 2, payload="x"), "not one of"),
    ],
    ids=lambda v: v if isinstance(v, str) else type(v).__name__,
)
def test_each_record_type_is_checked_on_decode(record: object, says: str) -> None:
    with pytest.raises(codec.CodecError, match=says) as info:
        codec.loads(codec.dumps(record), RL_STATE)
    assert "\n" not in str(info.value) and len(str(info.value)) < 600


@pytest.mark.parametrize(
    "state, says",
    [
        (genuine_state(traj_ids=[3, -5]), "segment token_ids"),
        (genuine_state(token_ids=[3, -5]), "sequence token_ids"),
        (genuine_state(token_ids=[3, VOCAB]), f"token id {VOCAB}, outside the policy's"),
        (genuine_state(traj_ids=[3, 10**6]), "trajectory: token id 1000000"),
        (genuine_state(token_ids=[3] * 600, logprobs=[0.0] * 600), "602 tokens, more than"),
    ],
    ids=["traj -5", "response -5", "response = vocab", "traj huge", "too long"],
)
def test_a_resume_with_bad_tokens_is_one_line_before_any_rank(
    tmp_path: Path, capsys, monkeypatch, state: dict, says: str
) -> None:
    write_resumable(tmp_path, state)
    err = refused(tmp_path, capsys, monkeypatch)
    assert RL_STATE in err and says in err, err


def test_the_state_shape_and_the_judge_tokens_are_checked(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    state = genuine_state()
    state["rl"]["batches"][1][0].payload.judge_ids = [VOCAB + 3]
    write_resumable(tmp_path, state)
    assert "outside the genrm's vocabulary" in refused(tmp_path, capsys, monkeypatch)
    state = genuine_state()
    state["rl"]["version"] = "one"
    write_resumable(tmp_path, state)
    assert "rl.version" in refused(tmp_path, capsys, monkeypatch)


@pytest.mark.parametrize(
    "ranks, says",
    [
        ({0: {"python": (3, (1, 2), None), "numpy": None, "torch": None}}, "rank 0 python"),
        ({0: coordinator_rng(), 1: {"torch": torch.zeros(3, dtype=torch.uint8), "engines": {}}}, "rank 1 torch"),
        ({0: coordinator_rng(), 2: {"torch": torch.get_rng_state(), "engines": {"rollout": 5}}}, "rank 2 rollout engine"),
    ],
    ids=["python", "torch", "engine"],
)  # fmt: skip
def test_rng_states_that_would_not_load_are_one_line(
    tmp_path: Path, capsys, monkeypatch, ranks: dict, says: str
) -> None:
    write_resumable(tmp_path, genuine_state(), ranks)
    err = refused(tmp_path, capsys, monkeypatch)
    assert RANKS in err and says in err, err
