"""The analysis scripts run on synthetic traces, print the right tables and write PNGs."""

from __future__ import annotations

import re
import runpy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pivot_hpc.telemetry import TelemetryWriter, open_run
from pivot_hpc.telemetry.convergence import curves, moving_average
from tests.unit.test_telemetry import EXPECTED_TOKENS_PER_S, META, REPO, write_synthetic_run

ANALYSIS = REPO / "analysis"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Synthetic runs whose throughput is a known multiple of EXPECTED_TOKENS_PER_S."""
    base = tmp_path_factory.mktemp("runs")
    specs = {  # name: (scale, meta)
        "disagg": (1, {"mode": "disaggregated", "strategy": "", "horizon_s": 60.0}),
        "colocated": (1, {"mode": "colocated", "strategy": "", "gpus": 16}),
        "static": (2, {"strategy": "static", "horizon_s": 60.0}),
        "pivot_a": (3, {"horizon_s": 60.0}),
        "pivot_b": (5, {"horizon_s": 60.0}),  # a repeat of pivot_a: averaged to 4x
        "pivot_h1": (2, {"horizon_s": 1.0, "gpus": 16}),
        # H only inside a config given as JSON text
        "pivot_h5": (1, {"horizon_s": None, "config": '{"planner": {"horizon_s": 5}}'}),
    }
    return {
        name: write_synthetic_run(base / name, scale=scale, **meta)
        for name, (scale, meta) in specs.items()
    }


def script(name: str, *args: object) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ANALYSIS / name), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


def script_here(
    name: str, *args: object, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> tuple[int, str, str]:
    """Run a script in this process (no interpreter start-up): for its error paths."""
    path = str(ANALYSIS / name)
    monkeypatch.setattr(sys, "argv", [path, *map(str, args)])
    monkeypatch.syspath_prepend(str(ANALYSIS))
    try:
        runpy.run_path(path, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_png(path: Path) -> None:
    assert path.stat().st_size > 1000 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_modes(runs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "fig9.png"
    dirs = [runs[n] for n in ("disagg", "colocated", "pivot_a", "pivot_b")]
    res = script("compare_modes.py", *dirs, "--out", out)
    assert res.returncode == 0, res.stderr
    assert_png(out)
    lines = {ln.split()[0]: ln.split() for ln in res.stdout.splitlines()[1:] if ln.strip()}
    base = EXPECTED_TOKENS_PER_S
    assert float(lines["pivot"][2]) == pytest.approx(4 * base, abs=0.05)
    assert lines["pivot"][1] == "2" and lines["pivot"][3] == f"{base:.1f}"  # std of 3x, 5x
    assert lines["disaggregated"][4] == "4.00x" and lines["colocated"][4] == "4.00x"


def test_script_errors_are_one_line(
    runs: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    png = tmp_path / "x.png"
    run = {"monkeypatch": monkeypatch, "capsys": capsys}
    code, _, err = script_here(
        "compare_modes.py", runs["disagg"], "--labels", "a,b", "--out", png, **run
    )
    assert code == 2 and "--labels has 2 names for 1 run" in err
    code, _, err = script_here("ablation.py", runs["static"], "--out", png, **run)
    assert code == 2 and "--baseline 'disaggregated': no run has that label" in err
    code, _, err = script_here("timeline.py", tmp_path / "absent", "--out", png, **run)
    assert (
        code == 2
        and err.strip() == f"timeline.py: error: run directory {tmp_path / 'absent'} does not exist"
    )
    assert not png.exists()
    code, out, _ = script_here("planner_overhead.py", runs["pivot_a"], "--unit", "ms", **run)
    assert code == 0 and "Total (ms)" in out and "120.000 ±48.990" in out


@pytest.mark.slow  # a figure (about 1 s)
def test_timeline(runs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "fig10.png"
    res = script("timeline.py", runs["pivot_a"], "--out", out, "--estimated")
    assert res.returncode == 0, res.stderr
    assert_png(out)


@pytest.mark.slow  # a figure (about 1 s)
def test_ablation(runs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "fig11.png"
    dirs = [runs[n] for n in ("disagg", "static", "pivot_a", "pivot_b")]
    res = script("ablation.py", *dirs, "--out", out)
    assert res.returncode == 0, res.stderr
    assert_png(out)
    norm = {ln.split()[0]: ln.split()[-1] for ln in res.stdout.splitlines()[1:] if ln.strip()}
    assert norm["disaggregated"] == "1.00" and norm["static"] == "2.00"
    assert norm["pivot"] == "4.00"


@pytest.mark.slow  # a figure (about 1 s)
def test_h_sensitivity(runs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "fig14.png"
    dirs = [runs[n] for n in ("pivot_h1", "pivot_a", "pivot_b", "pivot_h5")]
    res = script("h_sensitivity.py", *dirs, "--out", out)
    assert res.returncode == 0, res.stderr
    assert_png(out)
    rows = [ln.split() for ln in res.stdout.splitlines()[1:4]]
    assert [r[0] for r in rows] == ["1", "5", "60"] and [r[1] for r in rows] == ["1", "1", "2"]
    assert float(rows[2][2]) == pytest.approx(4 * EXPECTED_TOKENS_PER_S, abs=0.05)
    assert rows[0][4] == "1.50"  # 3 up-shifts over 2 steps


@pytest.mark.slow  # a figure (about 1 s)
def test_planner_overhead(runs: dict[str, Path], tmp_path: Path) -> None:
    out, csv = tmp_path / "t2.png", tmp_path / "t2.csv"
    dirs = [runs["pivot_a"], runs["colocated"]]
    res = script("planner_overhead.py", *dirs, "--out", out, "--csv", csv, "--unit", "s")
    assert res.returncode == 0, res.stderr
    assert_png(out)
    rows = [ln for ln in res.stdout.splitlines() if re.match(r"\s*\d+\s", ln)]
    assert [r.split()[0] for r in rows] == ["8", "16"]
    # planner totals 0.06, 0.12, 0.18 s per decision: mean 0.12, population std 0.049
    assert "0.120 ±0.049" in rows[0] and "0.020 ±0.008" in rows[0]
    assert csv.read_text().splitlines()[0].startswith("gpus,decisions,preprocess_mean")


@pytest.mark.slow  # a figure (about 1 s)
def test_migration_overhead(runs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "t3.png"
    res = script("migration_overhead.py", runs["pivot_a"], "--out", out)
    assert res.returncode == 0, res.stderr
    assert_png(out)
    assert "0.260 ±0.000" in res.stdout


def test_readme_h5py_snippet_runs(runs: dict[str, Path]) -> None:
    readme = (ANALYSIS / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    plain = next(b for b in blocks if "import glob, h5py" in b)
    code = plain.replace("runs/pivot-7b", str(runs["disagg"]))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert f"tokens/s {EXPECTED_TOKENS_PER_S}" in res.stdout


def test_timeline_groups_shifts_into_decisions(monkeypatch: pytest.MonkeyPatch) -> None:
    from pivot_hpc.telemetry.schema import DTYPES

    monkeypatch.syspath_prepend(str(ANALYSIS))
    shift_events = runpy.run_path(str(ANALYSIS / "timeline.py"))["shift_events"]
    rows = [  # (t finished, plan_id, total_s)
        (10.0, 0, 1.0),  # a baseline's stage switch: down [9, 10] then up [10, 12] ...
        (12.0, 0, 2.0),
        (50.0, 0, 1.0),  # ... and a later, separate one
        (30.0, 7, 1.0),  # planner decision 7: two shifts
        (31.0, 7, 0.5),
    ]
    shifts = np.zeros(len(rows), dtype=DTYPES["shifts"])
    shifts["t"], shifts["plan_id"], shifts["total_s"] = (
        np.array(c) for c in zip(*rows, strict=True)
    )
    events = shift_events(shifts)
    assert [sorted(e["t"].tolist()) for e in events] == [[10.0, 12.0], [30.0, 31.0], [50.0]]


def write_learning_run(run_dir: Path, mode: str, seed: int, accuracy: list[float]) -> Path:
    """A run of 4 steps (2 s each, rewards 0, 1, 2, 3) with held-out evaluations at
    versions 0, 2, 4 (`accuracy`)."""
    meta = {"mode": mode, "strategy": "", "config": {"rl": {"trainer": {"seed": seed}}}}
    with TelemetryWriter(run_dir, meta=META | meta) as w:
        for i in range(4):
            w.step(
                i,
                start=2.0 * i,
                end=2.0 * i + 2,
                rollout_tokens=100,
                reward_tokens=50,
                train_tokens=100,
                samples=8,
                reward_mean=float(i),
                reward_verifiable_mean=0.0,
                reward_genrm_mean=0.0,
                loss=0.1,
                staleness_max=0,
                staleness_mean=0.0,
                version=i + 1,
            )
        for v, acc in zip((0, 2, 4), accuracy, strict=True):
            w.evaluation(
                2.0 * v,
                version=v,
                accuracy=acc,
                reward_verifiable_mean=2 * acc - 1,
                problems=64,
                seconds=0.5,
            )
    return run_dir


@pytest.mark.slow  # a figure (about 1 s)
def test_convergence_curves_and_figure(tmp_path: Path) -> None:
    a = write_learning_run(tmp_path / "pivot", "pivot", 0, [0.5, 0.6, 0.8])
    b = write_learning_run(tmp_path / "colocated", "colocated", 1, [0.5, 0.7, 0.75])
    c = curves(open_run(a), window=2)
    assert c.label == "pivot" and c.seed == 0
    assert list(c.eval_version) == [0, 2, 4] and list(c.eval_t) == [0.0, 4.0, 8.0]
    assert (c.accuracy_first, c.accuracy_last, c.wall_s) == (0.5, 0.8, 8.0)
    assert list(c.step) == [1, 2, 3, 4]
    assert list(c.reward_ma) == [0.0, 0.5, 1.5, 2.5]  # trailing window of 2
    out = tmp_path / "fig15.png"
    res = script("convergence.py", a, b, "--out", out, "--window", "2")
    assert res.returncode == 0, res.stderr
    assert_png(out)
    rows = {ln.split()[1]: ln.split() for ln in res.stdout.splitlines()[1:] if ln.strip()}
    assert rows["pivot"][3:6] == ["0.500", "0.800", "2.500"]
    assert rows["colocated"][2:5] == ["1", "0.500", "0.750"]


def test_convergence_without_evaluations_is_one_line(
    runs: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = (runs["pivot_a"], "--out", tmp_path / "x.png")
    code, _, err = script_here("convergence.py", *args, monkeypatch=monkeypatch, capsys=capsys)
    assert code != 0 and "no run has held-out evaluations" in err and "Traceback" not in err


def test_moving_average() -> None:
    x = np.array([1.0, 3.0, 5.0, 7.0])
    assert list(moving_average(x, 3)) == [1.0, 2.0, 3.0, 5.0]
    assert list(moving_average(x, 1)) == list(x)
    assert len(moving_average(np.array([]), 4)) == 0
