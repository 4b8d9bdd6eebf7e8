"""Live checkpoints: what the coordinator gathers from GPS, the workers and its own state.

save (coordinator, between events, never while a training step runs):
  1. policy weights at the current version, read from GPS → policy/model.safetensors, with
     the policy directory's config and tokenizer files (a loadable HF model directory);
  2. every worker's RNG states; the training ranks write train/ (megatron dist checkpoint);
  3. the RL state: step, data cursor, batches (replay buffer of rewarded samples, queued
     and in-flight samples) and the tokens every unfinished sequence generated so far —
     queued ones from their last abort, running ones peeked without disturbing them.
Then `store.commit` renames the directory into place. Resume reverses the three parts.

RL state (rl_state.json) and RNG states (ranks.json) are tagged JSON (checkpoint/codec.py):
nothing read from a run directory is unpickled, so a checkpoint from someone else can be
wrong, never executable.
"""

from __future__ import annotations

import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pivot_hpc.agentic.trajectory import CallRecord, Segment, Trajectory, TrajectoryLimits
from pivot_hpc.checkpoint import codec, store
from pivot_hpc.coordinator.rl_state import Sample
from pivot_hpc.data.problem import Problem
from pivot_hpc.engines.base import SeqResult
from pivot_hpc.rl.rewards import GenRMStats
from pivot_hpc.runtime.checkpoint_records import RECORD_CHECKS
from pivot_hpc.runtime.live_payload import LivePayload
from pivot_hpc.safe_files import open_for_read, open_for_write

RL_STATE = "rl_state.json"
RANKS = "ranks.json"
# The records a checkpoint holds (with tools.enabled a sample's trajectory too, as data:
# agentic/trajectory.py), each checked as input when it is decoded (checkpoint_records.py).
_RECORDS = (Sample, LivePayload, Problem, SeqResult, GenRMStats)
for _cls in (*_RECORDS, Trajectory, Segment, CallRecord, TrajectoryLimits):
    codec.register(_cls, check=RECORD_CHECKS[_cls])


def coordinator_rng() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }


def restore_coordinator_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


class LiveCheckpointer:
    def __init__(
        self, *, run_dir: Path, cfg, config_dict: dict, gps, cluster, samples, policy_dir: str
    ) -> None:
        self.run_dir = run_dir
        self.cfg = cfg
        self.config_dict = config_dict
        self.gps = gps
        self.cluster = cluster
        self.samples = samples
        self.policy_dir = Path(policy_dir)
        self.last_step = -1

    def due(self, version: int) -> bool:
        every = self.cfg.checkpoint.interval_steps
        return every > 0 and version % every == 0 and version != self.last_step

    def save(self, coord, reason: str) -> Path:
        t0 = time.perf_counter()
        rl = coord.rl
        # 0. the tokens of unfinished sequences first (the rest takes seconds, in which
        # they would finish and their results could not be kept); only those unfinished in
        # the coordinator's view, which does not change while it saves
        partials = {}
        for (role, sid), res in self.cluster.partials().items():
            s = coord.samples.get(sid)
            if s is None or s.rewarded or (role == "rollout") == s.rolled_out:
                continue
            partials[(role, sid)] = res
        tmp = store.begin(self.run_dir)
        # 1. policy weights (GPS holds version rl.version: training wrote it before reporting)
        from safetensors.torch import save_file

        from pivot_hpc.gps import Parallelism

        # the whole policy (tp = pp = dp = 1) onto the coordinator
        tensors, version = self.gps.read("policy", [0], Parallelism(), device="cpu")
        if version != rl.version:
            raise RuntimeError(f"checkpoint: GPS holds policy v{version}, RL state v{rl.version}")
        (tmp / "policy").mkdir()
        save_file(
            {k: v.detach().contiguous().clone() for k, v in tensors.items()},
            str(tmp / "policy" / "model.safetensors"),
            metadata={"format": "pt", "pivot_hpc_version": str(version)},
        )
        for f in self.policy_dir.iterdir():
            if f.is_file() and f.suffix != ".safetensors" and not f.name.endswith(".index.json"):
                shutil.copyfile(f, tmp / "policy" / f.name)  # mode from the umask
        policy_s = time.perf_counter() - t0
        # 2. ranks: RNG states; training state on the training ranks
        ranks, train_s = self.cluster.save_ranks(str(tmp))
        ranks[0] = coordinator_rng()
        with open_for_write(tmp / RANKS, "wb", private=False) as f:
            f.write(codec.dumps(ranks))
        # 3. RL state
        state = {
            "rl": rl.state(),
            "partials": partials,
            "rewards": list(coord.stats.rewards),
            "genrm_stats": self.samples.genrm_stats,
        }
        with open_for_write(tmp / RL_STATE, "wb", private=False) as f:
            f.write(codec.dumps(state))
        partial_tokens = sum(len(r.token_ids) for r in partials.values())
        replay = len(rl.replay_buffer())
        # generated work the checkpoint keeps: finished rollouts and judgements not yet
        # trained on, plus the partial sequences' tokens
        kept = sum(
            s.response_len * s.rolled_out + s.judgement_len * s.rewarded
            for b in rl.batches.values()
            for s in b
        )
        info = {
            "step": version,
            "reason": reason,
            "partial_sequences": len(partials),
            "partial_tokens": partial_tokens,
            "replay_samples": replay,
            "generated_tokens_kept": kept + partial_tokens,
            "save_s": time.perf_counter() - t0,
        }
        final = store.commit(tmp, info, self.config_dict, self.cfg.checkpoint.keep)
        save_s = time.perf_counter() - t0
        nbytes = sum(p.stat().st_size for p in final.rglob("*") if p.is_file())
        index = int(final.name.split("-")[1])
        coord.telemetry.checkpoint(
            coord.cluster.now(),
            index=index,
            step=version,
            reason=reason,
            bytes=nbytes,
            save_s=save_s,
            policy_s=policy_s,
            train_s=train_s,
            partial_sequences=len(partials),
            partial_tokens=partial_tokens,
            replay_samples=replay,
        )
        coord.telemetry.flush()
        self.last_step = version
        print(
            f"pivot-hpc: checkpoint {final} ({reason}): step {version}, "
            f"{nbytes / 2**20:.1f} MiB in {save_s:.2f}s, {len(partials)} partial sequences "
            f"({partial_tokens} tokens), {replay} rewarded samples waiting; "
            f"{kept + partial_tokens} generated tokens kept",
            flush=True,
        )
        return final


def load_rl_state(path: Path) -> dict[str, Any]:
    """The RL state a checkpoint holds (rl_state.json)."""
    return load_state(path, RL_STATE)


def load_state(path: Path, name: str) -> Any:
    """A checkpoint's JSON state file, decoded into registered types only."""
    fix = f"delete {path} to resume from the previous checkpoint, or start a new --run-dir"
    try:
        with open_for_read(path / name) as f:  # a regular file: never a FIFO or a link
            return codec.loads(f.read(), name)
    except OSError as exc:
        raise store.CheckpointError(f"checkpoint {path}: cannot read {name} ({exc})") from None
    except codec.CodecError as exc:
        raise store.CheckpointError(f"checkpoint {path}: {exc}; {fix}") from None


def restore(path: Path, step: int, cluster, rl, samples) -> tuple[dict[str, Any], dict]:
    """Resume from checkpoint `path` (of policy version `step`; GPS already holds it):
    the workers' RNG and training state, the coordinator's RNG, the RL state. Returns the
    saved state and the telemetry metadata of the resume."""
    t0 = time.monotonic()
    manifest = store.verify(path)
    workers_s = cluster.restore_ranks(str(path))  # RNG; training ranks: model + optimizer
    coordinator = load_state(path, RANKS).get(0)
    if coordinator is not None:
        restore_coordinator_rng(coordinator)
    state = load_rl_state(path)
    rl.restore(state["rl"])
    samples.genrm_stats = state["genrm_stats"]
    meta = {
        "resumed_from": path.name,
        "resume_step": step,
        "restore_s": workers_s,  # the slowest worker's own restore
        "resume_wait_s": time.monotonic() - t0,  # incl. waiting for workers to start
        "resume_gap_s": _since(manifest.get("created_unix")),  # since the save
    }
    partials = state["partials"]
    print(
        f"pivot-hpc: resuming from {path} at step {step}: {len(partials)} partial sequences "
        f"({sum(len(r.token_ids) for r in partials.values())} tokens), "
        f"{len(rl.replay_buffer())} rewarded samples waiting; restored in {workers_s:.2f}s",
        flush=True,
    )
    return state, meta


def requeue_restored(coord, cluster, state: dict[str, Any]) -> None:
    """Hand a restored checkpoint's unfinished work to the coordinator and the cluster:
    partial sequences continue from their saved tokens when next dispatched."""
    partials = state["partials"]
    cluster.set_partials(partials)
    coord.restore(coord.rl.batches, {k: len(r.token_ids) for k, r in partials.items()})
    coord.stats.rewards = list(state["rewards"])


def _since(created_unix) -> float:
    """Seconds since a manifest's save time (NaN when it does not say)."""
    if isinstance(created_unix, int | float) and not isinstance(created_unix, bool):
        return time.time() - created_unix
    return float("nan")
