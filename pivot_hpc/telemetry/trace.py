"""A run's telemetry as a Chrome/Perfetto trace (`traceEvents`, times in microseconds).

Tracks: one process per node and one thread per GPU, whose slices show the role the GPU
holds (rollout, reward, training) and its shift phases; a "control plane" process with
the RL steps as slices, planner decisions that shifted and migrations as instant events,
and per-role throughput and allocation as counters; and, for runs with tool calls (schema
5), a "tool calls" process with one slice per answered call over the time its trajectory
waited parked (named tool: status), packed onto at most MAX_TOOL_LANES lanes, and a
counter of the parked trajectories. Open the file at ui.perfetto.dev or chrome://tracing.

Where each replica's GPUs are comes from the caller (`gpus_of`): the telemetry names
replicas, the run's topology maps them to GPUs.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import numpy as np

from pivot_hpc.telemetry.errors import TelemetryError, printable
from pivot_hpc.telemetry.reader import Run

US = 1e6  # trace timestamps are microseconds
CONTROL_PID = 1_000_000  # the control-plane "process" (above any node index)
TOOLS_PID = CONTROL_PID + 1  # the tool-calls "process"
# Tool calls are drawn on lanes (threads) of the tools process, a lane reused once its last
# call has ended; a run can have thousands of calls parked at once, and a trace viewer
# with a thread per call is unusable. Calls that find every lane busy are counted
# (otherData "tool_calls_not_drawn"), not drawn: the parked counter shows how many wait.
MAX_TOOL_LANES = 256
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
    max_tool_lanes: int = MAX_TOOL_LANES,
) -> dict[str, Any]:
    """The trace of `run`. `gpus_of(replica, gpus)` gives the GPU ids of a replica (the
    shift row's GPU count is passed along); tool calls take at most `max_tool_lanes`
    lanes."""
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
    not_drawn = _tool_events(run, events, max_tool_lanes)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "mode": _text(run.meta.get("mode", "")),
            "strategy": _text(run.meta.get("strategy", "")),
            "simulated": bool(run.meta.get("simulated", False)),
            "allocations": len(run.files),
            "tool_calls_not_drawn": not_drawn,
        },
    }


def _tool_events(run: Run, events: list[dict[str, Any]], max_lanes: int) -> int:
    """The tools process: a slice per answered call from its issue (t − wait_s) to its
    result (t) on the lowest free lane, and the rollout's parked trajectories as a
    counter. Added only for runs with calls or parked trajectories (files older than
    schema 5 read as neither). Returns the calls not drawn (every lane busy, or a time
    that is not a number)."""
    calls = run["tool_calls"]
    tp = run["throughput"]
    parked = tp[tp["role"] == "rollout"]
    parked = parked[np.argsort(parked["t"], kind="stable")]
    show_parked = bool(len(parked)) and bool((parked["n_parked"] != 0).any())
    if not len(calls) and not show_parked:
        return 0
    lane_meta = 2 * min(max_lanes, len(calls))  # a name and a sort index per lane
    _check_size(events, 2 + len(calls) + lane_meta + (len(parked) if show_parked else 0))
    events.append(_meta("process_name", TOOLS_PID, 0, name="tool calls"))
    events.append(_meta("process_sort_index", TOOLS_PID, 0, sort_index=TOOLS_PID))

    t_end = calls["t"].astype(np.float64)
    wait = np.nan_to_num(calls["wait_s"].astype(np.float64), nan=0.0, posinf=0.0, neginf=0.0)
    wait = np.clip(wait, 0.0, None)
    ok = np.isfinite(t_end)
    t0 = np.where(ok, np.maximum(0.0, t_end - wait), 0.0)
    busy: list[tuple[float, int]] = []  # (end in µs, lane) of lanes with a call running
    free: list[int] = []  # lanes whose last call has ended, lowest first
    lanes = 0
    not_drawn = int((~ok).sum())
    for i in np.flatnonzero(ok)[np.argsort(t0[ok], kind="stable")]:
        row = calls[i]
        ts, end = _us(t0[i]), _us(max(t_end[i], t0[i]))
        while busy and busy[0][0] <= ts:
            heapq.heappush(free, heapq.heappop(busy)[1])
        if free:
            lane = heapq.heappop(free)
        elif lanes < max_lanes:
            lane, lanes = lanes, lanes + 1
        else:
            not_drawn += 1
            continue
        heapq.heappush(busy, (end, lane))
        tool, status = _text(row["tool"]), _text(row["status"])
        tool_s = float(row["tool_s"])
        events.append(
            {
                "name": f"{tool}: {status}",
                "cat": "tool",
                "ph": "X",
                "pid": TOOLS_PID,
                "tid": lane,
                "ts": ts,
                "dur": round(end - ts, 3),
                "cname": "good" if status == "ok" else "bad",
                "args": {
                    "tool": tool,
                    "status": status,
                    "sample_id": int(row["sample_id"]),
                    "call_id": int(row["call_id"]),
                    "turn": int(row["turn"]),
                    "node": int(row["node"]),  # whose sandbox answered (-1: not recorded)
                    "wait_s": float(wait[i]),
                    "tool_s": tool_s if math.isfinite(tool_s) else None,
                },
            }
        )
    for lane in range(lanes):
        events.append(_meta("thread_name", TOOLS_PID, lane, name=f"calls {lane}"))
        events.append(_meta("thread_sort_index", TOOLS_PID, lane, sort_index=lane))
    if show_parked:
        for row in parked:
            events.append(
                {
                    "name": "parked trajectories",
                    "cat": "parked",
                    "ph": "C",
                    "pid": TOOLS_PID,
                    "ts": _us(row["t"]),
                    "args": {"parked": int(row["n_parked"])},
                }
            )
    return not_drawn


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
    for name, col in (
        ("throughput", "t"),
        ("allocation", "t"),
        ("shifts", "t"),
        ("steps", "end"),
        ("tool_calls", "t"),
    ):
        rows = run[name]
        if len(rows):
            ends.append(float(rows[col].max()))
    return max(ends)
