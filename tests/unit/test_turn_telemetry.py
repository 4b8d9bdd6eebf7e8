"""Per-turn time splits (issue 37 §7): the turn loop writes a `turns` row per finished turn
of a tool-using trajectory — queued (submit to first dispatch), generating (first dispatch
to finish, a migration's restart included), tokens, context, replica — joinable with
`tool_calls` by sample and turn; it keeps two times per turn in flight and none after.
The report gives the mean splits; files older than schema 6 read `turns` as empty."""

from __future__ import annotations

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
from pivot_hpc.telemetry.schema import ADDED_IN, DTYPES, SCHEMA_VERSION, decoded_dtype
from pivot_hpc.telemetry.summary import format_summary, summarise, turn_splits
from tests.unit.test_tool_telemetry import write_tool_run
from tests.unit.test_turn_loop import Script, finished, loop


def _three_turns(tmp_path: Path):
    """Turn 0 calls (answered at 3.5), turn 1 is refused, turn 2 ends the trajectory."""
    calc = Turn("call", tool="calculator", args_json="{}")
    turns, coord, _ = loop(Script([calc, Turn("again", context=130), Turn("done")], [150]))
    clock = coord.clock
    s = Sample(1, 0, 0, 0, prompt_len=100)
    with TelemetryWriter(tmp_path, meta={"mode": "pivot"}) as w:
        coord.telemetry = w
        turns.queued(s.sample_id)  # the coordinator's release, at 0
        clock.t = 0.5
        turns.dispatched(s.sample_id)
        clock.t = 0.75
        turns.dispatched(s.sample_id)  # migrated: started again elsewhere, not re-queued
        clock.t = 2.0
        assert not turns.on_turn(s, finished(s, 2.0))  # parked: nothing held for it
        assert turns._turn_t == {}
        clock.t = 3.5
        turns.on_result(ToolReturned(3.5, ToolResult(coord.calls[0].call_id, "ok", "2", 0.1)))
        clock.t = 4.0
        turns.dispatched(s.sample_id)
        clock.t = 6.0
        sched = coord.schedulers["rollout"]
        sched.cancel(s.sample_id)  # what the coordinator's finish does (scheduler.finish)
        assert not turns.on_turn(s, finished(s, 6.0))  # refused: queued again at once
        clock.t = 6.25
        turns.dispatched(s.sample_id)
        clock.t = 7.0
        sched.cancel(s.sample_id)
        assert turns.on_turn(s, finished(s, 7.0))
        assert turns._turn_t == {}  # dropped with the trajectory
    return open_run(tmp_path)


def test_each_turn_has_its_queued_and_generating_time(tmp_path: Path) -> None:
    run = _three_turns(tmp_path)
    rows = run["turns"]
    assert [int(r["turn"]) for r in rows] == [0, 1, 2]
    assert all(int(r["sample_id"]) == 1 and r["replica"] == "rollout:0" for r in rows)
    assert rows["t"].tolist() == [2.0, 6.0, 7.0]
    assert rows["queued_s"].tolist() == pytest.approx([0.5, 0.5, 0.25])
    assert rows["gen_s"].tolist() == pytest.approx([1.5, 2.0, 0.75])  # from the 1st start
    assert rows["tokens"].tolist() == [20, 20, 20]
    assert rows["context"].tolist() == [100, 150, 130]  # prompt; + observation; refused
    # the join: the call turn 0 made is tool_calls.turn 1, issued at turn 0's finish; the
    # turn after its result has the same turn and was submitted at the result's time
    (call,) = run["tool_calls"]
    assert int(call["turn"]) == 1
    assert float(call["t"] - call["wait_s"]) == pytest.approx(float(rows["t"][0]))
    nxt = rows[rows["turn"] == call["turn"]][0]
    assert float(nxt["t"] - nxt["gen_s"] - nxt["queued_s"]) == pytest.approx(float(call["t"]))


def test_a_turn_whose_start_went_unseen_writes_no_row(tmp_path: Path) -> None:
    turns, coord, _ = loop(Script([Turn("done"), Turn("done")], []))
    with TelemetryWriter(tmp_path, meta={"mode": "pivot"}) as w:
        coord.telemetry = w
        s = Sample(1, 0, 0, 0, prompt_len=100)
        turns.on_turn(s, finished(s))  # never queued through the loop or the coordinator
        q = Sample(2, 0, 0, 0, prompt_len=100)
        turns.queued(q.sample_id)
        turns.on_turn(q, finished(q))  # queued, never dispatched
    assert len(open_run(tmp_path)["turns"]) == 0 and turns._turn_t == {}


def test_the_report_gives_the_mean_splits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _three_turns(tmp_path)
    s = summarise(open_run(tmp_path))
    assert s["turns"] == 3
    assert s["turn_queued_s_mean"] == pytest.approx(1.25 / 3)
    assert s["turn_gen_s_mean"] == pytest.approx(4.25 / 3)
    lines = format_summary(s).splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("tools "))
    assert lines[i + 1].startswith("turns      3 finished   mean queued 0.417 s")
    assert "mean generating 1.417 s" in lines[i + 1]
    assert main(["report", str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["turns"] == 3 and data["turn_gen_s_mean"] == pytest.approx(4.25 / 3)


def test_without_turn_rows_the_means_are_none() -> None:
    empty = np.empty(0, dtype=decoded_dtype(DTYPES["turns"]))
    assert turn_splits(empty) == {"turns": 0, "turn_queued_s_mean": None, "turn_gen_s_mean": None}


def test_files_before_schema_6_read_turns_as_empty(tmp_path: Path) -> None:
    assert SCHEMA_VERSION == ADDED_IN["turns"] == 6
    path = write_tool_run(tmp_path)
    with h5py.File(path, "r+") as f:  # rewrite it as a schema-5 file
        del f["turns"]
        f.attrs["schema_version"] = 5
    run = open_run(tmp_path)
    assert len(run["turns"]) == 0 and run["turns"].dtype.names == DTYPES["turns"].names
    assert len(run["tool_calls"]) == 5
    s = summarise(run)
    assert s["turns"] == 0 and s["turn_queued_s_mean"] is None and s["turn_gen_s_mean"] is None
    text = format_summary(s)
    assert "tools      5 calls" in text and "turns " not in text
