"""`pivot-hpc bench live`: the live tiny run in pivot mode beside a static mode, with the
JSON keys other tools read (tokens_per_s by mode, ratio_vs_best_static,
transition_share)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from live import ROOT

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs OpenMPI (mpirun)")


@pytest.mark.timeout(600)
def test_bench_live_json(tmp_path: Path) -> None:
    args = ["--steps", "2", "--modes", "pivot,disaggregated", "--out", str(tmp_path), "--json"]
    out = subprocess.run(
        [sys.executable, "-m", "pivot_hpc", "bench", "live", *args, "loop.batch_prompts=4"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=560,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(res["tokens_per_s"]) == {"pivot", "disaggregated"}
    assert all(v > 0 for v in res["tokens_per_s"].values())
    assert res["best_static"] == "disaggregated"
    ratio = res["tokens_per_s"]["pivot"] / res["tokens_per_s"]["disaggregated"]
    assert res["ratio_vs_best_static"] == pytest.approx(ratio)
    assert 0.0 <= res["transition_share"] < 1.0
    assert res["runs"]["pivot"]["strategy"] == "pivot+"  # the tiny config's planner
    for mode in ("pivot", "disaggregated"):
        assert (tmp_path / mode / "telemetry").is_dir() and (tmp_path / f"{mode}.log").is_file()


def test_bench_live_refuses_bad_modes() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pivot_hpc", "bench", "live", "--modes", "pivot,nope"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0
    assert "--modes: unknown ['nope']" in out.stderr and "Traceback" not in out.stderr
