"""Per-turn time splits in a simulated tools run (issue 37 §7): every trajectory's `turns`
rows are its turns 0..k, each queued for a slot (>= 0) then generating (> 0), and they join
`tool_calls` exactly: a trained trajectory has tool_calls + 1 turns (the simulator refuses
no call and every observation leaves room), the call turn k made is answered as
tool_calls.turn k + 1 and was issued at turn k's finish, and turn k + 1 was submitted at
that result. A run without tools writes no rows."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from pivot_hpc.job.simulate import simulate
from pivot_hpc.telemetry import open_run
from pivot_hpc.telemetry.summary import summarise
from tests.sim.test_simulator import tiny
from tests.sim.test_tool_turns import TOOLS


def test_a_tools_run_writes_each_turns_split(tmp_path: Path) -> None:
    simulate(tiny("pivot", *TOOLS), tmp_path, progress=False)
    run = open_run(tmp_path)
    rows, calls, trained = run["turns"], run["tool_calls"], run["trained"]
    assert len(rows) > 0 and len(calls) > 0
    assert (rows["queued_s"] >= 0).all() and (rows["gen_s"] > 0).all()
    assert (rows["tokens"] > 0).all() and (rows["context"] > 0).all()
    assert all(str(r).startswith("rollout") for r in set(rows["replica"]))
    assert (rows["queued_s"] > 0).any()  # some turns waited for a slot
    by_sample: dict[int, dict[int, np.void]] = defaultdict(dict)
    for r in rows:
        by_sample[int(r["sample_id"])][int(r["turn"])] = r
    n_rows = sum(len(v) for v in by_sample.values())
    assert n_rows == len(rows)  # no turn twice
    for turns in by_sample.values():
        assert sorted(turns) == list(range(len(turns)))  # 0..k, none missing
        starts = [float(r["t"] - r["gen_s"] - r["queued_s"]) for _, r in sorted(turns.items())]
        ends = [float(r["t"]) for _, r in sorted(turns.items())]
        assert all(e <= s + 1e-9 for e, s in zip(ends, starts[1:], strict=False))
    answered: dict[int, int] = defaultdict(int)
    for c in calls:
        sid, k = int(c["sample_id"]), int(c["turn"])
        answered[sid] += 1
        made = by_sample[sid][k - 1]  # the turn that made the call
        assert float(c["t"] - c["wait_s"]) == pytest.approx(float(made["t"]), abs=1e-6)
        nxt = by_sample[sid].get(k)  # the turn after it, unless it is still queued
        if nxt is not None:
            submitted = float(nxt["t"] - nxt["gen_s"] - nxt["queued_s"])
            assert submitted == pytest.approx(float(c["t"]), abs=1e-6)
    for t in trained:
        sid = int(t["sample_id"])
        assert len(by_sample[sid]) == int(t["tool_calls"]) + 1 == answered[sid] + 1
    for sid, turns in by_sample.items():  # in flight at the end: running, or parked
        assert answered[sid] <= len(turns) <= answered[sid] + 1
    s = summarise(run)
    assert s["turns"] == len(rows)
    assert s["turn_queued_s_mean"] == pytest.approx(float(rows["queued_s"].mean()))
    assert s["turn_gen_s_mean"] == pytest.approx(float(rows["gen_s"].mean()))


def test_without_tools_no_turn_rows(tmp_path: Path) -> None:
    simulate(tiny("pivot"), tmp_path, progress=False)
    s = summarise(open_run(tmp_path))
    assert s["turns"] == 0 and s["turn_queued_s_mean"] is None and s["turn_gen_s_mean"] is None
