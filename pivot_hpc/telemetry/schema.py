"""The HDF5 telemetry schema: one compound dataset per event kind, fields with units.

This table is the single source of the on-disk layout: the writer builds its numpy dtypes
from it, the reader checks files against it, and `analysis/README.md` documents it (a test
keeps the two in step). Bump SCHEMA_VERSION on any change a reader must know about.
"""

from __future__ import annotations

import numpy as np

# 2: + `trained`, `checkpoints`, `evals`; 3: + steps' `made_*_tokens`; 4: + `failures`;
# 5: + `tool_calls`, trained's `tool_calls`, throughput's `n_parked`; later in 5, the
# optional `tool_calls.node` (files without it read -1); 6: + `turns`
SCHEMA_VERSION = 6

# Fixed-length byte strings keep the datasets readable by plain h5py/numpy (no vlen types).
ROLE = "S16"
KIND = "S16"
REPLICA = "S48"

# dataset -> [(field, numpy dtype, unit, meaning)]
FIELDS: dict[str, list[tuple[str, str, str, str]]] = {
    "throughput": [
        ("t", "f8", "s", "time since run start"),
        ("role", ROLE, "", "'rollout' or 'reward'"),
        ("replicas", "i4", "", "replicas the role holds"),
        ("gpus", "i4", "", "GPUs the role holds"),
        ("n_seq", "i8", "sequences", "running + queued sequences of the role (Eq. 1's N)"),
        ("n_queued", "i8", "sequences", "of n_seq, those waiting in the scheduler's queue"),
        ("n_tok", "i8", "tokens", "tokens held in the KV caches of the role's replicas"),
        ("tokens_per_s", "f8", "tokens/s", "measured generation throughput of the role"),
        ("est_tokens_per_s", "f8", "tokens/s", "throughput model's estimate (§6.1)"),
        (
            "n_parked",
            "i8",
            "trajectories",
            "rollout: parked on a tool call, not in n_seq (reward: 0)",
        ),
    ],
    "allocation": [
        ("t", "f8", "s", "time since run start; holds until the next row"),
        ("rollout_gpus", "i4", "", "GPUs serving rollout"),
        ("reward_gpus", "i4", "", "GPUs serving reward (GenRM)"),
        ("training_gpus", "i4", "", "GPUs training"),
        ("idle_gpus", "i4", "", "GPUs holding no role"),
        ("transition_gpus", "i4", "", "GPUs in the middle of a shift"),
    ],
    "shifts": [
        ("t", "f8", "s", "time the shift finished (it started at t - total_s)"),
        ("kind", KIND, "", "'up' (GPUs join the role) or 'down' (GPUs leave it)"),
        ("role", ROLE, "", "'rollout', 'reward' or 'training'"),
        ("replica", REPLICA, "", "replica id (training: the training group's id)"),
        ("gpus", "i4", "", "GPUs shifted"),
        (
            "plan_id",
            "i8",
            "",
            "planner decision it belongs to (planner.plan_id); 0: not the planner's",
        ),
        ("penalty", "f8", "tokens", "shift penalty φ of the pair (§7.2)"),
        ("benefit", "f8", "tokens", "benefit B of the plan (§7.3)"),
        ("discard_s", "f8", "s", "shift down: discarding temporary state and parameters"),
        ("read_s", "f8", "s", "shift up: GPS.read of the parameters"),
        ("offload_s", "f8", "s", "shift down: offloading stateful context to host"),
        ("reload_s", "f8", "s", "shift up: reloading offloaded context"),
        ("total_s", "f8", "s", "wall time of the whole shift"),
    ],
    "planner": [
        ("t", "f8", "s", "time the planner took its snapshot"),
        ("plan_id", "i8", "", "id of this decision, from 1 (matches shifts.plan_id)"),
        ("strategy", KIND, "", "'pivot', 'static', 'rule', 'vanilla', ..."),
        ("up_role", ROLE, "", "role chosen to shift up ('' if none)"),
        ("n_up", "i4", "", "replicas the chosen plan shifts up (0: no shift)"),
        ("n_down", "i4", "", "replicas the chosen plan shifts down"),
        ("candidates", "i4", "", "candidate plans evaluated"),
        ("preprocess_s", "f8", "s", "step 1-2: snapshot analysis and shift pairs"),
        ("construct_s", "f8", "s", "step 3: candidate construction (Alg. 1)"),
        ("simulate_s", "f8", "s", "step 4: migration simulation of the candidates"),
        ("benefit", "f8", "tokens", "B of the chosen plan (<= 0: nothing executed)"),
        ("throughput_current", "f8", "tokens/s", "Eq. 1 throughput now"),
        ("throughput_expected", "f8", "tokens/s", "Eq. 1 throughput after the chosen plan"),
    ],
    "migrations": [
        ("t", "f8", "s", "time the migration was carried out"),
        ("role", ROLE, "", "'rollout' or 'reward'"),
        ("kind", KIND, "", "'up' or 'down': the shift that caused it"),
        ("sequences", "i8", "sequences", "sequences migrated"),
        ("abort_s", "f8", "s", "abort phase: time each migrated sequence waited for it"),
        ("dispatch_s", "f8", "s", "dispatch phase incl. queue wait (likewise)"),
        ("reprefill_s", "f8", "s", "re-prefill phase: recomputing the KV cache (likewise)"),
    ],
    "steps": [
        ("step", "i8", "", "RL step number"),
        ("start", "f8", "s", "time the step's first rollout started"),
        ("end", "f8", "s", "time the step's training (and GPS write) finished"),
        ("rollout_tokens", "i8", "tokens", "response tokens the policy generated"),
        ("reward_tokens", "i8", "tokens", "tokens the GenRM generated"),
        ("train_tokens", "i8", "tokens", "tokens trained on"),
        ("samples", "i8", "trajectories", "trajectories in the training batch"),
        ("reward_mean", "f8", "", "mean total reward R = R_verifiable + R_GenRM"),
        ("reward_verifiable_mean", "f8", "", "mean verifiable reward"),
        ("reward_genrm_mean", "f8", "", "mean GenRM reward"),
        ("loss", "f8", "", "training loss"),
        ("staleness_max", "i8", "versions", "max policy-version lag of the batch"),
        ("staleness_mean", "f8", "versions", "mean policy-version lag of the batch"),
        ("version", "i8", "", "policy version after the step"),
        (
            "made_rollout_tokens",
            "f8",
            "tokens",
            "response tokens the engines had made in all when the step ended, unfinished "
            "ones included (NaN: not counted; live runs)",
        ),
        ("made_reward_tokens", "f8", "tokens", "the same of GenRM tokens"),
        (
            "skipped_nonfinite",
            "i1",
            "",
            "1: the gradient norm was not finite, no optimizer step was taken (weights "
            "unchanged; files without the field read 0)",
        ),
    ],
    "trained": [
        ("step", "i8", "", "RL step that trained on the sample"),
        ("sample_id", "i8", "", "sample id (unique within a run, also across resumes)"),
        ("prompt_index", "i8", "", "data cursor position of its prompt"),
        ("group", "i4", "", "sample index within its prompt's group"),
        ("version_start", "i8", "", "policy version its rollout started with"),
        ("response_tokens", "i8", "tokens", "response length"),
        ("reward", "f8", "", "total reward R"),
        ("tool_calls", "i8", "calls", "tool calls its trajectory made (0: none, or no tools)"),
    ],
    "checkpoints": [
        ("t", "f8", "s", "time the checkpoint was complete"),
        ("index", "i8", "", "N of checkpoints/ckpt-N"),
        ("step", "i8", "", "policy version (= RL steps trained) it holds"),
        ("reason", KIND, "", "'periodic', or the signal: 'SIGUSR1', 'SIGTERM'"),
        ("bytes", "i8", "bytes", "size on disk"),
        ("save_s", "f8", "s", "wall time of the whole save"),
        ("policy_s", "f8", "s", "of which: policy weights from GPS to safetensors"),
        ("train_s", "f8", "s", "of which: megatron checkpoint on the training ranks"),
        ("partial_sequences", "i8", "sequences", "unfinished sequences saved with tokens"),
        ("partial_tokens", "i8", "tokens", "generated tokens those sequences carry"),
        ("replay_samples", "i8", "samples", "rewarded samples waiting for training"),
    ],
    "evals": [
        ("t", "f8", "s", "time the evaluation finished"),
        ("version", "i8", "", "policy version evaluated (= RL steps trained)"),
        ("accuracy", "f8", "", "greedy accuracy on the held-out validation problems"),
        ("reward_verifiable_mean", "f8", "", "mean verifiable reward of those responses"),
        ("problems", "i8", "", "validation problems"),
        ("seconds", "f8", "s", "wall time of the evaluation"),
    ],
    "failures": [
        ("t", "f8", "s", "time the coordinator heard of the death"),
        ("replica", REPLICA, "", "inference replica whose engine process died"),
        ("role", ROLE, "", "'rollout' or 'reward'"),
        (
            "action",
            KIND,
            "",
            "'restart' (serving: shifted down, started again), 'replaced' (an idle role's engine), 'excluded'",
        ),
        ("sequences", "i8", "sequences", "unfinished sequences recovered with their tokens"),
        ("tokens_kept", "i8", "tokens", "generated tokens they kept (as last streamed)"),
        ("tokens_lost", "i8", "tokens", "decoded after the last refresh: generated again"),
        ("cause", "S200", "", "the process's exit as the worker saw it"),
    ],
    "tool_calls": [
        ("t", "f8", "s", "time the coordinator had the call's result"),
        ("sample_id", "i8", "", "the trajectory (sample) that made the call"),
        ("call_id", "i8", "", "the call's id (unique within an allocation)"),
        ("turn", "i4", "turns", "generation turns of the trajectory before the call's result"),
        ("tool", ROLE, "", "the tool called"),
        (
            "status",
            ROLE,
            "",
            "'ok', 'error', 'timeout', 'memory', 'output_limit', 'crash', 'unavailable'",
        ),
        ("wait_s", "f8", "s", "from the call's issue to its result: the trajectory's parked time"),
        ("tool_s", "f8", "s", "of which: the call's run in the sandbox (simulated: its latency)"),
        (
            "node",
            "i4",
            "",
            "index of the node whose sandbox service answered (-1: simulated, or not recorded)",
        ),
    ],
    "turns": [
        ("t", "f8", "s", "time the turn finished"),
        ("sample_id", "i8", "", "the trajectory (sample) the turn belongs to"),
        (
            "turn",
            "i4",
            "turns",
            "the turn's index in its trajectory, from 0 (= tool_calls.turn of the call "
            "whose wait preceded it)",
        ),
        ("replica", REPLICA, "", "rollout replica the turn finished on"),
        (
            "queued_s",
            "f8",
            "s",
            "from its sequence's submit (release, or the previous turn's end or call "
            "result) to its first dispatch",
        ),
        ("gen_s", "f8", "s", "from its first dispatch to its finish, migrations included"),
        ("tokens", "i8", "tokens", "tokens the turn generated"),
        ("context", "i8", "tokens", "its prompt: the trajectory's context when it started"),
    ],
}
# Datasets added after schema version 1: a file of an older version reads them as empty.
ADDED_IN = {"trained": 2, "checkpoints": 2, "evals": 2, "failures": 4, "tool_calls": 5, "turns": 6}
# Optional fields: a writer may leave them out and a file of an older version lacks them;
# both read as this value.
OPTIONAL: dict[str, dict[str, float]] = {
    "steps": {
        "made_rollout_tokens": float("nan"),
        "made_reward_tokens": float("nan"),
        "skipped_nonfinite": 0,
    },
    "trained": {"tool_calls": 0},
    "throughput": {"n_parked": 0},
    "tool_calls": {"node": -1},
}

DATASETS: tuple[str, ...] = tuple(FIELDS)

DTYPES: dict[str, np.dtype] = {
    name: np.dtype([(f, d) for f, d, _, _ in fields]) for name, fields in FIELDS.items()
}

# Fields holding seconds since run start: the writer adds its time offset to these.
TIME_FIELDS: dict[str, tuple[str, ...]] = {
    name: tuple(f for f, *_ in fields if f in ("t", "start", "end"))
    for name, fields in FIELDS.items()
}

# Rows per HDF5 chunk: throughput is the high-rate series; the others are sparse.
CHUNK_ROWS: dict[str, int] = {name: 256 for name in DATASETS} | {"throughput": 4096}

# Root attributes the writer sets itself; `meta` may not use these names.
RESERVED_ATTRS: tuple[str, ...] = (
    "schema_version",
    "pivot_hpc_version",
    "created_unix",
    "hostname",
    "alloc_index",
    "time_offset_s",
    "json_keys",
    "slurm_job_id",
    "slurm_array_job_id",
    "slurm_restart_count",
    "slurm_nnodes",
    "slurm_ntasks",
)

SLURM_ENV: dict[str, str] = {
    "SLURM_JOB_ID": "slurm_job_id",
    "SLURM_ARRAY_JOB_ID": "slurm_array_job_id",
    "SLURM_RESTART_COUNT": "slurm_restart_count",
    "SLURM_NNODES": "slurm_nnodes",
    "SLURM_NTASKS": "slurm_ntasks",
}


def decoded_dtype(dt: np.dtype) -> np.dtype:
    """`dt` with fixed-length byte fields turned into str fields of the same length."""
    assert dt.names is not None
    return np.dtype([(n, f"U{dt[n].itemsize}" if dt[n].kind == "S" else dt[n]) for n in dt.names])
