"""`pivot-hpc bench groups --json` on a small simulated deployment: the contract keys, and
the steady window's made rate against the work-conserving bound for every run."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from pivot_hpc.cli.main import main
from tests.sim.test_sim_workload import SMALL


def _small_config(path: Path) -> Path:
    tree: dict = {}
    for item in SMALL:
        key, value = item.split("=", 1)
        *parents, leaf = key.split(".")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(value)
    path.write_text(yaml.safe_dump(tree))
    return path


def test_bench_groups_json_keys_and_made_rates(tmp_path: Path, capsys) -> None:
    config = _small_config(tmp_path / "small.yaml")
    rc = main(
        [
            "bench",
            "groups",
            "--configs",
            str(config),
            "--steps",
            "7",
            "--strategies",
            "pivot",
            "--json",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    group = out["groups"]["small"]
    assert set(group["runs"]) == {
        "colocated",
        "disaggregated",
        "rr_colocated",
        "pivot",
        "pivot/elastic",
    }
    for label, run in group["runs"].items():
        assert {
            "tokens_per_s",
            "tokens_per_s_steady",
            "tokens_per_s_bound",
            "processed_tokens_per_s",
            "processed_tokens_per_s_steady",
            "processed_tokens_per_s_bound",
            "steady_over_bound",
            "shifts",
            "training_prewarms",
            "tokens_per_s_steady_made",
            "tokens_per_s_critical_path",
            "end_to_end_over_bounds",
        } <= set(run), label
        assert 0 < run["steady_over_bound"] <= 1, (label, run)
        assert 0 < run["end_to_end_over_bounds"] <= 1, (label, run)
        assert run["processed_tokens_per_s"] > run["tokens_per_s"], label
        steady = run["tokens_per_s_steady"]
        assert steady is None or steady <= run["tokens_per_s_bound"], (label, run)
        assert run["training_prewarms"] == 0, label  # the paper's strategy never pre-warms
    assert group["best_static"] in ("colocated", "disaggregated", "rr_colocated")
    for label in ("pivot", "pivot/elastic"):
        ratios = group["ratios"][label]
        for key in ("over_disaggregated", "over_colocated", "over_best_static"):
            assert ratios[key] > 0 and ratios[f"made_{key}"] > 0, (label, ratios)
            # no run's made rate can pass the bound, so no ratio can pass the ceiling
            assert ratios[f"made_{key}"] <= group["ratio_ceiling"][key] * (1 + 1e-9), (label, key)
    for key in ("over_disaggregated", "over_colocated", "over_best_static"):
        assert group["ratio_ceiling"][key] >= 1.0, (key, group["ratio_ceiling"])


def test_bench_groups_runs_colocated_synchronously_under_a_staleness_override(
    tmp_path: Path, capsys
) -> None:
    """`deployment.staleness=1` applies to the asynchronous modes; colocated, which only
    runs at 0, still runs (it used to stop the whole benchmark with a config error)."""
    config = _small_config(tmp_path / "small.yaml")
    argv = ["bench", "groups", "--configs", str(config), "--steps", "4", "--strategies"]
    rc = main([*argv, "pivot", "--json", "deployment.staleness=1"])
    assert rc == 0
    runs = json.loads(capsys.readouterr().out)["groups"]["small"]["runs"]
    assert {"colocated", "disaggregated", "pivot"} <= set(runs)
    assert all(r["tokens_per_s"] > 0 for r in runs.values())
