"""A run's telemetry as a Chrome/Perfetto trace (`traceEvents`, times in microseconds).

Tracks: one process per node and one thread per GPU, whose slices show the role the GPU
holds (rollout, reward, training) and its shift phases; a "control plane" process with
the RL steps as slices, planner decisions that shifted and migrations as instant events,
and per-role throughput and allocation as counters. Open the file at ui.perfetto.dev or
chrome://tracing.

Where each replica's GPUs are comes from the caller (`gpus_of`): the telemetry names
replicas, the run's topology maps them to GPUs.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Any

import numpy as np

from pivot_hpc.telemetry.errors import TelemetryError, printable
from pivot_hpc.telemetry.reader import Run

US = 1e6  # trace timestamps are microseconds
CONTROL_PID = 1_000_000  # the control-plane "process" (above any node index)
ROLE_COLOURS = {"rollout": "good", "reward": "olive", "training": "terrible"}
SHIFT_PHASES = {
    "up": ("read_s", "reload_s"),
    "down": ("discard_s", "offload_s"),
}
# Past this many events the trace is not worth writing (the JSON is gigabytes; the Perfetto
# UI does not load it), and the events held in memory alone take several GB. A shift row
# adds one event per GPU it moved, so a small hostile file could otherwise ask for billions.
MAX_EVENTS = 5_000_000


@lru_cache(maxsize=4096)
def _text(value: object) -> str:
    """A string from the telemetry as it may appear in the trace: the file may be someone
    else's, and its text is shown by trace viewers (and terminals that print the JSON).
    Cached: roles, kinds and replica ids repeat on every row."""
    return printable(str(value))


def _check_size(events: list[dict[str, Any]], more: int = 0) -> None:
    """Refuse before `more` events would take the trace past MAX_EVENTS."""
    if len(events) + more > MAX_EVENTS:
        raise TelemetryError(
            f"the trace would have more than {MAX_EVENTS} events, more than a trace viewer "
            "loads; trace a shorter run or fewer GPUs"
        )


def _us(t: float) -> float:
    return round(float(t) * US, 3)


def build(
    run: Run,
    gpus_of: Callable[[str, int], tuple[int, ...]],
    num_gpus: int,
    gpus_per_node: int,
) -> dict[str, Any]:
    """The trace of `run`. `gpus_of(replica, gpus)` gives the GPU ids of a replica (the
    shift row's GPU count is passed along)."""
    events: list[dict[str, Any]] = []
    nodes = max(1, -(-num_gpus // gpus_per_node))
    _check_size(events, 2 * (nodes + num_gpus))  # two metadata events per node and GPU
    for node in range(nodes):
        events.append(_meta("process_name", node, 0, name=f"node {node}"))
        events.append(_meta("process_sort_index", node, 0, sort_index=node))
    for gpu in range(num_gpus):
        node = gpu // gpus_per_node
        events.append(_meta("thread_name", node, gpu, name=f"GPU {gpu}"))
        events.append(_meta("thread_sort_index", node, gpu, sort_index=gpu))
    events.append(_meta("process_name", CONTROL_PID, 0, name="control plane"))
    for tid, name in enumerate(("RL steps", "planner", "migrations")):
        events.append(_meta("thread_name", CONTROL_PID, tid, name=name))
    end = _end_time(run)

    # roles per GPU, from the shifts: a role starts when its shift up finishes and ends
    # when its shift down starts
    holding: dict[int, tuple[str, float, str]] = {}  # gpu -> (role, since, replica)
    shifts = run["shifts"]
    for row in shifts[np.argsort(shifts["t"], kind="stable")]:
        _check_size(events)
        kind, role, rid = _text(row["kind"]), _text(row["role"]), str(row["replica"])
        t_end, total = float(row["t"]), float(row["total_s"])
        t0 = max(0.0, t_end - total)
        gpus = gpus_of(rid, int(row["gpus"]))
        phases = {k: float(row[k]) for k in SHIFT_PHASES.get(kind, ())}
        for gpu in gpus:
            pid = gpu // gpus_per_node
            if kind == "down" and gpu in holding:
                held, since, held_rid = holding.pop(gpu)
                events.append(_role_slice(pid, gpu, held, held_rid, since, t0))
            events.append(
                {
                    "name": f"shift {kind}: {role}",
                    "cat": "shift",
                    "ph": "X",
                    "pid": pid,
                    "tid": gpu,
                    "ts": _us(t0),
                    "dur": _us(t_end - t0),
                    "cname": "grey",
                    "args": {
                        "replica": _text(rid),
                        "plan_id": int(row["plan_id"]),
                        "penalty": float(row["penalty"]),
                        "benefit": float(row["benefit"]),
                        **phases,
                        "total_s": total,
                    },
                }
            )
            if kind == "up":
                holding[gpu] = (role, t_end, rid)
    for gpu, (role, since, rid) in holding.items():
        events.append(_role_slice(gpu // gpus_per_node, gpu, role, rid, since, end))

    _check_size(events, len(run["steps"]))
    for row in run["steps"]:
        events.append(
            {
                "name": f"step {int(row['step']) + 1}",
                "cat": "step",
                "ph": "X",
                "pid": CONTROL_PID,
                "tid": 0,
                "ts": _us(row["start"]),
                "dur": _us(max(0.0, float(row["end"]) - float(row["start"]))),
                "args": {
                    k: float(row[k])
                    for k in ("reward_mean", "loss", "rollout_tokens", "reward_tokens")
                },
            }
        )
    _check_size(events, len(run["planner"]))
    for row in run["planner"]:
        if int(row["n_up"]) == 0 and int(row["n_down"]) == 0:
            continue  # decisions that kept the allocation: too many to show
        events.append(
            _instant(
                f"plan {int(row['plan_id'])}: {_text(row['up_role']) or '-'} +{int(row['n_up'])}",
                "planner",
                row["t"],
                1,
                {
                    "n_down": int(row["n_down"]),
                    "benefit": float(row["benefit"]),
                    "throughput_current": float(row["throughput_current"]),
                    "throughput_expected": float(row["throughput_expected"]),
                    "candidates": int(row["candidates"]),
                },
            )
        )
    _check_size(events, len(run["migrations"]))
    for row in run["migrations"]:
        events.append(
            _instant(
                f"migrate {int(row['sequences'])} {_text(row['role'])} ({_text(row['kind'])})",
                "migration",
                row["t"],
                2,
                {k: float(row[k]) for k in ("abort_s", "dispatch_s", "reprefill_s")},
            )
        )
    _check_size(events, len(run["throughput"]))
    for row in run["throughput"]:
        events.append(
            {
                "name": f"{_text(row['role'])} tokens/s",
                "cat": "throughput",
                "ph": "C",
                "pid": CONTROL_PID,
                "ts": _us(row["t"]),
                "args": {
                    "measured": float(row["tokens_per_s"]),
                    "model": float(row["est_tokens_per_s"]),
                },
            }
        )
    _check_size(events, len(run["allocation"]))
    for row in run["allocation"]:
        events.append(
            {
                "name": "GPUs by role",
                "cat": "allocation",
                "ph": "C",
                "pid": CONTROL_PID,
                "ts": _us(row["t"]),
                "args": {
                    k.removesuffix("_gpus"): int(row[k])
                    for k in (
                        "rollout_gpus",
                        "reward_gpus",
                        "training_gpus",
                        "transition_gpus",
                        "idle_gpus",
                    )
                },
            }
        )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "mode": _text(run.meta.get("mode", "")),
            "strategy": _text(run.meta.get("strategy", "")),
            "simulated": bool(run.meta.get("simulated", False)),
            "allocations": len(run.files),
        },
    }


def _meta(kind: str, pid: int, tid: int, **args: Any) -> dict[str, Any]:
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": args}


def _instant(name: str, cat: str, t: float, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": name,
        "cat": cat,
        "ph": "i",
        "s": "t",
        "pid": CONTROL_PID,
        "tid": tid,
        "ts": _us(t),
        "args": args,
    }


def _role_slice(pid: int, gpu: int, role: str, rid: str, t0: float, t1: float) -> dict:
    return {
        "name": _text(role),
        "cat": "role",
        "ph": "X",
        "pid": pid,
        "tid": gpu,
        "ts": _us(t0),
        "dur": _us(max(0.0, t1 - t0)),
        "cname": ROLE_COLOURS.get(role, "generic_work"),
        "args": {"replica": _text(rid)},
    }


def _end_time(run: Run) -> float:
    ends = [0.0]
    for name, col in (("throughput", "t"), ("allocation", "t"), ("shifts", "t"), ("steps", "end")):
        rows = run[name]
        if len(rows):
            ends.append(float(rows[col].max()))
    return max(ends)
