"""`pivot-hpc trace`: a simulated run's telemetry as a valid Chrome/Perfetto trace in which
every shift appears on the tracks of its GPUs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pivot_hpc.cli.main import main
from pivot_hpc.telemetry import open_run

REPO = Path(__file__).resolve().parents[2]
PHASES = {"X", "i", "C", "M"}


def check_trace_format(trace: dict) -> None:
    """The subset of the Trace Event Format the viewers need (and that we write)."""
    assert isinstance(trace["traceEvents"], list) and trace["traceEvents"]
    for ev in trace["traceEvents"]:
        assert isinstance(ev["name"], str) and ev["ph"] in PHASES, ev
        assert isinstance(ev["pid"], int), ev
        if ev["ph"] == "M":
            assert ev["name"] in (
                "process_name",
                "thread_name",
                "process_sort_index",
                "thread_sort_index",
            )
            continue
        assert isinstance(ev["ts"], int | float) and ev["ts"] >= 0, ev
        if ev["ph"] == "X":
            assert ev["dur"] >= 0 and isinstance(ev["tid"], int), ev
        if ev["ph"] == "i":
            assert ev["s"] in ("t", "p", "g"), ev
        if ev["ph"] == "C":
            assert all(isinstance(v, int | float) for v in ev["args"].values()), ev


@pytest.mark.parametrize("mode", ["pivot", "colocated"])
def test_trace_of_a_simulated_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: str
) -> None:
    run_dir = tmp_path / "run"
    argv = ["simulate", str(REPO / "configs/groups/group1-qwen1.5b-glm9b.yaml"), "--mode", mode]
    argv += ["--steps", "2", "--gpus", "16", "--out", str(run_dir), "loop.batch_prompts=8"]
    assert main(argv) == 0
    capsys.readouterr()
    assert main(["trace", str(run_dir), "--out", str(tmp_path / "t.json")]) == 0
    assert "open it at" in capsys.readouterr().out
    trace = json.loads((tmp_path / "t.json").read_text())
    check_trace_format(trace)
    shifts = open_run(run_dir)["shifts"]
    assert len(shifts)
    ends: dict[str, list[float]] = {}
    for ev in trace["traceEvents"]:
        if ev.get("cat") == "shift":
            ends.setdefault(ev["args"]["replica"], []).append(ev["ts"] + ev["dur"])
    for row in shifts:  # every shift, on its GPUs' tracks, ending when it ended
        t_us = float(row["t"]) * 1e6
        assert any(abs(e - t_us) < 2 for e in ends.get(str(row["replica"]), [])), row
    roles = {ev["name"] for ev in trace["traceEvents"] if ev.get("cat") == "role"}
    assert "training" in roles and roles <= {"rollout", "reward", "training"}
    steps = [ev for ev in trace["traceEvents"] if ev.get("cat") == "step"]
    assert len(steps) == 2


def test_trace_of_a_directory_without_telemetry_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["trace", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no telemetry files" in err
