"""Before a resume: is the checkpoint's state usable by this run? (runtime/main.py and the
launcher, before any rank starts): its state files decoded whole — each record checked as
it is decoded (runtime/checkpoint_records.py) — then every token id within its model's
vocabulary and every sequence within its positions."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pivot_hpc.checkpoint import store
from pivot_hpc.checkpoint.store import CheckpointError
from pivot_hpc.coordinator.rl_state import RLState, Sample
from pivot_hpc.engines.base import SeqResult
from pivot_hpc.job.config import Config
from pivot_hpc.rl.rewards import GenRMStats
from pivot_hpc.runtime.checkpoint_records import (
    ROLES,
    _int,
    _number,
    _short,
)
from pivot_hpc.runtime.checkpointing import RANKS, RL_STATE, load_state


def find_resume(run_dir: Path, cfg: Config) -> tuple[Path, dict[str, Any]] | None:
    """(path, manifest) of the checkpoint `cfg` resumes in `run_dir` (store.find_resume:
    complete, same config), its records checked (`check_resume`); None for a fresh run."""
    from pivot_hpc.config import to_dict
    from pivot_hpc.job.config import default_dict

    found = store.find_resume(
        run_dir, to_dict(cfg), allowed=cfg.checkpoint.resume, defaults=default_dict()
    )
    if found is not None:
        check_resume(found[0], cfg)
    return found


def check_resume(path: Path, cfg: Config) -> None:
    """CheckpointError (one line) unless checkpoint `path`'s state files hold records this
    run can use: decoded whole, every token id and sequence length within its model."""
    fix = f"delete {path} to resume from the previous checkpoint, or start a new --run-dir"
    state = load_state(path, RL_STATE)  # each record checked as it is decoded
    try:
        sequences = _rl_shape(state)
        for kind, what, ids in sequences:
            _within(kind, what, ids, _model_bounds(cfg, kind))
    except ValueError as exc:
        raise CheckpointError(f"checkpoint {path}: {RL_STATE}: {exc}; {fix}") from None
    ranks = load_state(path, RANKS)
    try:
        _ranks_shape(ranks)
    except ValueError as exc:
        raise CheckpointError(f"checkpoint {path}: {RANKS}: {exc}; {fix}") from None


Sequences = list[tuple[str, str, list[int]]]  # (model kind, what it is, token ids)


def _rl_shape(state: Any) -> Sequences:
    if type(state) is not dict or not {"rl", "partials", "rewards", "genrm_stats"} <= set(state):
        raise ValueError("expected the keys rl, partials, rewards and genrm_stats")
    rl = state["rl"]
    if type(rl) is not dict:
        raise ValueError("rl: expected a mapping")
    for key in RLState.SAVED:
        if key not in rl and key not in RLState.ADDED_LATER:
            raise ValueError(f"rl.{key}: missing")
    for key in ("version", "released", "data_cursor", "next_sample_id"):
        _int(f"rl.{key}", rl[key])
    for key in ("rewarded_count", "filtered", "resampled"):
        counts = rl.get(key, {})
        if type(counts) is not dict or not all(
            type(k) is int and type(v) is int for k, v in counts.items()
        ):
            raise ValueError(f"rl.{key}: expected a mapping of step to count")
    batches = rl["batches"]
    if type(batches) is not dict:
        raise ValueError("rl.batches: expected a mapping of step to samples")
    out: Sequences = []
    for step, samples in batches.items():
        _int("rl.batches step", step)
        if type(samples) is not list or not all(isinstance(s, Sample) for s in samples):
            raise ValueError(f"rl.batches[{step}]: expected a list of samples")
        for s in samples:
            out += _payload_sequences(s)
    partials = state["partials"]
    if type(partials) is not dict:
        raise ValueError("partials: expected a mapping")
    for key, res in partials.items():
        if not (type(key) is tuple and len(key) == 2 and key[0] in ROLES and type(key[1]) is int):
            raise ValueError(f"partials: key {_short(key)}, expected (role, sequence id)")
        if not isinstance(res, SeqResult):
            raise ValueError(f"partials[{key}]: a {type(res).__name__}, not a sequence")
        out.append((ROLES[key[0]], f"partial {key[0]} sequence {key[1]}", _seq(res)))
    if type(state["rewards"]) is not list:
        raise ValueError("rewards: expected a list of numbers")
    for r in state["rewards"]:
        _number("rewards", r)
    if not isinstance(state["genrm_stats"], GenRMStats):
        raise ValueError("genrm_stats: expected the GenRM's counts")
    return out


def _seq(r: SeqResult) -> list[int]:
    return [*r.prompt_ids, *r.token_ids]


def _payload_sequences(s: Sample) -> Sequences:
    p = s.payload
    if p is None:
        return []
    where = f"sample {s.sample_id}"
    out = [("policy", f"{where} prompt", p.prompt_ids), ("genrm", f"{where} judge", p.judge_ids)]
    if p.response is not None:
        out.append(("policy", f"{where} response", _seq(p.response)))
    if p.traj is not None:
        out.append(("policy", f"{where} trajectory", p.traj.context_ids()))
    return out


def _within(kind: str, what: str, ids: list[int], bounds: tuple[int, int]) -> None:
    vocab, positions = bounds
    high = max(ids, default=-1)
    if high >= vocab:
        raise ValueError(f"{what}: token id {high}, outside the {kind}'s vocabulary of {vocab}")
    if len(ids) > positions:
        raise ValueError(f"{what}: {len(ids)} tokens, more than the {kind}'s {positions}")


_BOUNDS: dict[tuple[int, str], tuple[int, int]] = {}


def _model_bounds(cfg: Config, kind: str) -> tuple[int, int]:
    """(vocabulary size, positions) of model `kind`: the tiny model's architecture, or the
    configured directory's config.json."""
    key = (id(cfg), kind)
    if key not in _BOUNDS:
        real = getattr(cfg.models, f"{kind}_path")
        if real is None:
            arch = getattr(cfg.models, kind).arch
            _BOUNDS[key] = (arch.vocab_size, arch.max_position_embeddings)
        else:
            try:
                c = json.loads((Path(real) / "config.json").read_text(encoding="utf-8"))
                c = c.get("text_config", c)  # multimodal configs nest the language model's
                _BOUNDS[key] = (int(c["vocab_size"]), int(c.get("max_position_embeddings", 2**31)))
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                _BOUNDS[key] = (2**31, 2**31)  # unreadable: the model's own load says why
    return _BOUNDS[key]


# ---------------------------------------------------------------------- RNG states
def _ranks_shape(ranks: Any) -> None:
    if type(ranks) is not dict or not all(type(k) is int and k >= 0 for k in ranks):
        raise ValueError("expected a mapping of world rank to RNG states")
    for rank, state in ranks.items():
        if type(state) is not dict:
            raise ValueError(f"rank {rank}: expected a mapping of RNG states")
        if rank == 0:
            _loads("rank 0 python", lambda s=state: random.Random().setstate(s["python"]))
            _loads("rank 0 numpy", lambda s=state: _numpy_state(s["numpy"]))
        else:
            engines = state.get("engines")
            if type(engines) is not dict:
                raise ValueError(f"rank {rank}: engines: expected a mapping of role to state")
            for role, s in engines.items():
                _loads(f"rank {rank} {role} engine", lambda s=s: _engine_state(s))
        _loads(f"rank {rank} torch", lambda s=state: _torch_state(s["torch"]))


def _loads(what: str, load: Callable[[], None]) -> None:
    try:
        load()
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, RuntimeError) as exc:
        raise ValueError(f"{what} RNG state does not load ({exc!s:.80})") from None


def _numpy_state(state: Any) -> None:
    import numpy as np

    np.random.RandomState().set_state(state)


def _torch_state(state: Any) -> None:
    import torch

    if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8:
        raise TypeError("not a byte tensor")
    torch.Generator().set_state(state)


def _engine_state(state: Any) -> None:
    """An hf engine's generator state, or a vllm engine's seed and request count."""
    if type(state) is dict:
        for key in ("seed", "requests"):
            if type(state.get(key)) is not int:
                raise TypeError(f"{key}: expected a whole number")
        return
    _torch_state(state)
