"""Tool calls in the trace and the report (issue 37 §7): a slice per answered call over
its trajectory's parked wait, on a bounded number of lanes; the parked trajectories as a
counter; `report --json`'s `tool_latency` per tool; files older than schema 5 still
trace and report, without any of it. Each row names the node whose sandbox service
answered (`node`: live, the node the call was routed to; -1 simulated or not recorded)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import h5py
import numpy as np
import pytest

from pivot_hpc.agentic.messages import ToolResult
from pivot_hpc.cli.main import main
from pivot_hpc.coordinator.events import ToolReturned
from pivot_hpc.coordinator.rl_state import Sample
from pivot_hpc.coordinator.turns import Turn
from pivot_hpc.telemetry import TelemetryWriter, open_run
from pivot_hpc.telemetry.errors import printable
from pivot_hpc.telemetry.summary import format_summary, summarise, tool_latency
from pivot_hpc.telemetry.trace import MAX_TOOL_LANES, TOOLS_PID, build
from tests.unit import test_live_tool_routing as routing
from tests.unit.test_turn_loop import Script, finished, loop

live = routing.live  # the fixture: runtime/live_cluster.py over a fake mpi4py.MPI
CONFIG = {"cluster": {"nodes": 2, "gpus_per_node": 4}}  # `trace` lays it out: 8 GPUs
# t (result), sample_id, call_id, turn, tool, status, wait_s, tool_s
CALLS = [
    (2.0, 7, 1, 1, "calculator", "ok", 1.0, 0.25),  # [1, 2]    lane 0
    (3.0, 8, 2, 1, "calculator", "ok", 1.5, 0.5),  # [1.5, 3]  lane 1
    (4.0, 7, 3, 2, "calculator", "error", 2.0, 0.75),  # [2, 4]    lane 0 again
    (3.5, 9, 4, 1, "search", "timeout", 1.0, 1.0),  # [2.5, 3.5] lane 2 (0 and 1 busy)
    (6.0, 9, 5, 2, "search", "ok", 0.5, 0.25),  # [5.5, 6]  lane 0 (all free)
]
PARKED = [(0.0, 0), (1.0, 1), (2.0, 2), (3.0, 3), (5.0, 0), (6.0, 1)]  # rollout rows


def _throughput(w: TelemetryWriter, t: float, role: str, **extra: int) -> None:
    w.throughput(t, role=role, replicas=1, gpus=2, n_seq=4, n_queued=0, n_tok=100,
                 tokens_per_s=50.0, est_tokens_per_s=55.0, **extra)  # fmt: skip


def write_tool_run(run_dir: Path, calls: list[tuple] = CALLS) -> Path:
    """A small run with tool calls and parked counts; returns its file."""
    meta = {"mode": "pivot", "strategy": "pivot", "gpus": 8, "config": CONFIG}
    with TelemetryWriter(run_dir, meta=meta) as w:
        w.allocation(0.0, rollout_gpus=6, reward_gpus=2, training_gpus=0, idle_gpus=0,
                     transition_gpus=0)  # fmt: skip
        for t, n in PARKED:
            _throughput(w, t, "rollout", n_parked=n)
            _throughput(w, t, "reward")  # n_parked left out: 0
        w.step(0, start=0.0, end=7.0, rollout_tokens=100, reward_tokens=50, train_tokens=100,
               samples=4, reward_mean=0.5, reward_verifiable_mean=0.5, reward_genrm_mean=0.0,
               loss=0.1, staleness_max=0, staleness_mean=0.0, version=1)  # fmt: skip
        for sid, calls_made in ((7, 2), (8, 1), (9, 2), (10, 0)):
            w.trained(0, sample_id=sid, prompt_index=sid, group=0, version_start=0,
                      response_tokens=10, reward=0.5, tool_calls=calls_made)  # fmt: skip
        for t, sid, cid, turn, tool, status, wait_s, tool_s in calls:
            w.tool_call(t, sample_id=sid, call_id=cid, turn=turn, tool=tool, status=status,
                        wait_s=wait_s, tool_s=tool_s)  # fmt: skip
    return run_dir / "telemetry" / "alloc-001.h5"


def _trace(run_dir: Path, **kw: int) -> dict:
    return build(open_run(run_dir), lambda rid, n: tuple(range(n)), 8, 4, **kw)


def _cat(trace: dict, cat: str) -> list[dict]:
    return [ev for ev in trace["traceEvents"] if ev.get("cat") == cat]


def test_trace_has_a_slice_per_call_on_reused_lanes(tmp_path: Path) -> None:
    write_tool_run(tmp_path)
    trace = _trace(tmp_path)
    slices = sorted(_cat(trace, "tool"), key=lambda ev: ev["args"]["call_id"])
    assert len(slices) == len(CALLS) and trace["otherData"]["tool_calls_not_drawn"] == 0
    for ev, (t, sid, cid, turn, tool, status, wait_s, tool_s) in zip(slices, CALLS, strict=True):
        assert ev["ph"] == "X" and ev["pid"] == TOOLS_PID
        assert ev["name"] == f"{tool}: {status}"
        assert ev["ts"] == pytest.approx((t - wait_s) * 1e6)
        assert ev["dur"] == pytest.approx(wait_s * 1e6)
        assert ev["args"] == {"tool": tool, "status": status, "sample_id": sid,
                              "call_id": cid, "turn": turn, "node": -1,
                              "wait_s": wait_s, "tool_s": tool_s}  # fmt: skip
    assert [ev["tid"] for ev in slices] == [0, 1, 0, 2, 0]
    for lane in {ev["tid"] for ev in slices}:  # no two calls overlap on a lane
        mine = sorted((ev["ts"], ev["ts"] + ev["dur"]) for ev in slices if ev["tid"] == lane)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(mine))
    meta = [ev for ev in trace["traceEvents"] if ev["ph"] == "M" and ev["pid"] == TOOLS_PID]
    names = {ev["args"]["name"] for ev in meta if ev["name"].endswith("_name")}
    assert names == {"tool calls", "calls 0", "calls 1", "calls 2"}


def test_trace_counts_the_parked_trajectories(tmp_path: Path) -> None:
    write_tool_run(tmp_path)
    counter = _cat(_trace(tmp_path), "parked")
    assert all(ev["ph"] == "C" and ev["pid"] == TOOLS_PID for ev in counter)
    assert [(ev["ts"] / 1e6, ev["args"]["parked"]) for ev in counter] == PARKED  # rollout only


def test_lanes_are_bounded(tmp_path: Path) -> None:
    # 1000 calls parked at once: MAX_TOOL_LANES lanes, the rest counted, not drawn;
    # then 1000 one after another: one lane.
    at_once = [(10.0 + i * 1e-3, i, i, 1, "calculator", "ok", 9.0, 0.1) for i in range(1000)]
    serial = [(100.0 + i, i, 1000 + i, 1, "calculator", "ok", 0.5, 0.1) for i in range(1000)]
    write_tool_run(tmp_path / "a", at_once)
    write_tool_run(tmp_path / "s", serial)
    trace = _trace(tmp_path / "a")
    slices = _cat(trace, "tool")
    assert len(slices) == MAX_TOOL_LANES
    assert {ev["tid"] for ev in slices} == set(range(MAX_TOOL_LANES))
    assert trace["otherData"]["tool_calls_not_drawn"] == 1000 - MAX_TOOL_LANES
    small = _trace(tmp_path / "a", max_tool_lanes=3)
    assert len(_cat(small, "tool")) == 3 and small["otherData"]["tool_calls_not_drawn"] == 997
    slices = _cat(_trace(tmp_path / "s"), "tool")
    assert len(slices) == 1000 and {ev["tid"] for ev in slices} == {0}


def test_the_files_text_is_made_printable(tmp_path: Path) -> None:
    path = write_tool_run(tmp_path, CALLS[:1])
    with h5py.File(path, "r+") as f:  # the writer refuses such text; a hostile file has it
        rows = f["tool_calls"][...]
        rows["tool"], rows["status"] = b"\x1b[2Jcalc\x1b]52;c;", b"o\x07k\x7f"
        f["tool_calls"][...] = rows
    (ev,) = _cat(_trace(tmp_path), "tool")
    assert ev["name"] == "calc: ok" and ev["args"]["tool"] == "calc"
    s = summarise(open_run(tmp_path))
    assert list(s["tool_latency"]) == ["calc"]
    assert s["tool_latency"]["calc"]["statuses"] == {"ok": 1}
    text = format_summary(s)
    assert all(c not in text for c in "\x1b\x07\x7f") and "calc" in text


def test_report_gives_the_latency_of_each_tool(tmp_path: Path) -> None:
    write_tool_run(tmp_path)
    s = summarise(open_run(tmp_path))
    assert s["tool_calls"] == 5
    assert s["tool_call_trajectory_share"] == pytest.approx(0.75)
    assert s["tool_wait_s_mean"] == pytest.approx(6.0 / 5)
    lat = json.loads(json.dumps(s))["tool_latency"]  # JSON-able as `report --json` prints
    assert lat == {
        "calculator": {
            "calls": 3,
            "wait_s_p50": pytest.approx(1.5),
            "wait_s_p90": pytest.approx(1.9),  # 1.5 + 0.8 × (2.0 − 1.5)
            "wait_s_max": 2.0,
            "tool_s_mean": pytest.approx(0.5),
            "statuses": {"ok": 2, "error": 1},
        },
        "search": {
            "calls": 2,
            "wait_s_p50": pytest.approx(0.75),
            "wait_s_p90": pytest.approx(0.95),
            "wait_s_max": 1.0,
            "tool_s_mean": pytest.approx(0.625),
            "statuses": {"ok": 1, "timeout": 1},
        },
    }
    text = format_summary(s)
    assert "tools      5 calls" in text
    row = next(line for line in text.splitlines() if line.strip().startswith("calculator"))
    assert row.split()[:5] == ["calculator", "3", "1.500", "1.900", "2.000"]
    assert "ok 2, error 1" in row


def test_report_cli_json_has_tool_latency(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_tool_run(tmp_path)
    assert main(["report", str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {"tool_calls", "tool_call_trajectory_share", "tool_wait_s_mean"} <= set(data)
    assert data["tool_latency"]["search"]["statuses"] == {"ok": 1, "timeout": 1}


def test_trace_cli_writes_the_tool_slices(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_tool_run(tmp_path)
    assert main(["trace", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "5 tool" in out and "6 parked" in out and "not drawn" not in out
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert len([ev for ev in events if ev.get("cat") == "tool"]) == 5
    assert all(printable(ev["name"]) == ev["name"] for ev in events)


def test_files_before_schema_5_trace_without_tool_calls(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_tool_run(tmp_path)
    with h5py.File(path, "r+") as f:  # rewrite it as a schema-4 file
        del f["tool_calls"]
        old = f["throughput"][...]
        del f["throughput"]
        keep = [n for n in old.dtype.names if n != "n_parked"]
        f.create_dataset("throughput", data=old[keep], maxshape=(None,), chunks=True)
        f.attrs["schema_version"] = 4
    trace = _trace(tmp_path)
    assert not _cat(trace, "tool") and not _cat(trace, "parked")
    assert all(ev["pid"] != TOOLS_PID for ev in trace["traceEvents"])
    assert _cat(trace, "step") and trace["otherData"]["tool_calls_not_drawn"] == 0
    s = summarise(open_run(tmp_path))
    assert s["tool_calls"] == 0 and s["tool_wait_s_mean"] is None and s["tool_latency"] == {}
    assert "tools " not in format_summary(s)
    assert main(["trace", str(tmp_path)]) == 0
    assert "tool" not in capsys.readouterr().out


def test_tool_latency_of_no_calls_is_empty() -> None:
    from pivot_hpc.telemetry.schema import DTYPES, decoded_dtype

    assert tool_latency(np.empty(0, dtype=decoded_dtype(DTYPES["tool_calls"]))) == {}


def test_rows_without_a_time_are_not_drawn(tmp_path: Path) -> None:
    bad = [
        (float("nan"), 1, 1, 1, "calculator", "ok", 1.0, 0.5),  # no time: counted, not drawn
        (2.0, 2, 2, 1, "calculator", "ok", -5.0, float("nan")),  # a negative wait: 0 long
        (3.0, 3, 3, 1, "calculator", "ok", float("inf"), 0.5),  # no wait: 0 long
    ]
    write_tool_run(tmp_path, bad)
    trace = _trace(tmp_path)
    slices = sorted(_cat(trace, "tool"), key=lambda ev: ev["ts"])
    assert trace["otherData"]["tool_calls_not_drawn"] == 1
    assert [(ev["ts"], ev["dur"]) for ev in slices] == [(2e6, 0.0), (3e6, 0.0)]
    assert slices[0]["args"]["tool_s"] is None
    json.dumps(trace, allow_nan=False)  # strict JSON: no NaN reaches the file


def test_each_call_names_the_node_that_answered_it(tmp_path: Path, live) -> None:
    """Live: the node a call was routed to is on its `ToolReturned` and, through the turn
    loop, on its telemetry row; the simulator's events (no node) write -1."""
    c, sent, _ = routing.cluster(live, nodes=3)
    for i in range(3):
        c.call_tool(routing.call(i))  # node 0 in-process, 1 and 2 over MPI
    for _rank, cmd in sent:
        c._tool_result(ToolResult(cmd.call_id, "ok", "2", 0.01))
    c._poll_local_tools()
    assert sorted((e.result.call_id, e.node) for e in c._pending) == [(0, 0), (1, 1), (2, 2)]

    calc = Turn("call", tool="calculator", args_json="{}")
    turns, coord, _ = loop(Script([calc, calc], [150, 160]))
    with TelemetryWriter(tmp_path, meta={"mode": "pivot"}) as w:
        coord.telemetry = w
        for sid, node in ((1, 1), (2, -1)):
            s = Sample(sid, 0, 0, 0, prompt_len=100)
            turns.on_turn(s, finished(s))
            res = ToolResult(coord.calls[-1].call_id, "ok", "2", 0.1)
            ev = ToolReturned(2.0, res) if node == -1 else ToolReturned(2.0, res, node)
            turns.on_result(ev)  # -1: the simulator's event, which names no node
    rows = open_run(tmp_path)["tool_calls"]
    assert [(int(r["sample_id"]), int(r["node"])) for r in rows] == [(1, 1), (2, -1)]


def test_rows_without_a_node_read_minus_one(tmp_path: Path) -> None:
    """A writer that leaves `node` out writes -1; a schema-5 file written before the field
    existed reads -1 too, and still reports and traces."""
    path = write_tool_run(tmp_path)
    assert (open_run(tmp_path)["tool_calls"]["node"] == -1).all()
    with h5py.File(path, "r+") as f:  # rewrite its calls as the first schema-5 files had them
        old = f["tool_calls"][...]
        del f["tool_calls"]
        keep = [n for n in old.dtype.names if n != "node"]
        f.create_dataset("tool_calls", data=old[keep], maxshape=(None,), chunks=True)
    calls = open_run(tmp_path)["tool_calls"]
    assert len(calls) == len(CALLS) and (calls["node"] == -1).all()
    assert summarise(open_run(tmp_path))["tool_calls"] == len(CALLS)
    assert len(_cat(_trace(tmp_path), "tool")) == len(CALLS)
