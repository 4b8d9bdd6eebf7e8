"""The `pivot-hpc` entry point and the control-plane benches (JSON contracts)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pivot_hpc.cli.main import main


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pivot_hpc", *args], capture_output=True, text=True, timeout=120
    )


def test_help_lists_commands() -> None:
    out = run_cli("--help")
    assert out.returncode == 0 and "bench" in out.stdout


def test_bench_planner_json_contract() -> None:
    out = run_cli("bench", "planner", "--gpus", "16", "--snapshots", "2", "--repeat", "2", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["gpus"] == 16
    assert 0 < data["median_ms"] <= data["p90_ms"]
    assert {"preprocess", "construct", "simulate"} <= set(data)


@pytest.mark.slow  # a benchmark (1.5-2 s)
def test_bench_migration_json_contract() -> None:
    out = run_cli(
        "bench", "migration", "--gpus", "16", "--snapshots", "1", "--repeat", "1", "--json"
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["gpus"] == 16 and data["sequences"] > 0
    assert 0 <= data["median_ms"] <= data["p90_ms"]


def test_bench_bad_gpus_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "planner", "--gpus", "12", "--json"]) == 2
    assert "--gpus 12: use a multiple of 8" in capsys.readouterr().err
