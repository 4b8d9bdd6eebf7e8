"""`pivot-hpc bench paper --json` (issue 39): Figure 9's cells beside the simulator's, with
the contract keys; `--quick` keeps a CI run short (one group, 3 steps, batches at 1/8)."""

from __future__ import annotations

import json
import math

import pytest

from pivot_hpc.bench.paper_bench import FIGURE9
from pivot_hpc.cli.main import main


@pytest.mark.slow  # a benchmark (1.5-3 s)
def test_bench_paper_quick_json_keys(capsys) -> None:
    rc = main(["bench", "paper", "--quick", "--groups", "1", "--scales", "0.5,1", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert {"cells", "max_abs_log_ratio", "batch_sensitivity", "pivot_plus_elastic"} <= set(out)
    cells = out["cells"]
    assert [c["mode"] for c in cells] == ["colocated", "disaggregated", "rr_colocated", "pivot"]
    for c in cells:
        assert {"group", "mode", "sim", "paper", "ratio"} <= set(c)
        assert c["paper"] == FIGURE9[1][c["mode"]]
        assert c["ratio"] == c["sim"] / c["paper"]
        assert c["processed"] > c["generated"] > 0  # prompts and GenRM inputs counted
    assert out["max_abs_log_ratio"] == max(abs(math.log(c["ratio"])) for c in cells)
    sens = out["batch_sensitivity"]["group1"]
    assert set(sens) == {"0.5", "1"}
    for r in sens.values():
        assert r["pivot_over_colocated"] == r["pivot"] / r["colocated"]
    plus = out["pivot_plus_elastic"]["group1"]
    assert 0 < plus["end_to_end_over_bound"] <= 1
