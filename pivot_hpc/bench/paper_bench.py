"""`pivot-hpc bench paper --json`: the sixteen Figure 9 cells simulated beside the paper's.

Each paper group (`configs/groups/group*.yaml`) runs in the three static modes and PivotRL
(the paper's `pivot` strategy, training "0 or N") for `--steps` steps at `--seed`, and its
end-to-end throughput is set beside Figure 9's. Figure 9 is the test, never an input: no
number below feeds the calibration (sim/calibration.py). The simulated value is
`processed_tokens_per_s` (prompts, the GenRM's inputs and generated tokens, the paper's
"total tokens processed", §8.1; `--count generated` compares generated tokens only).

Also: the batch-size sensitivity the configs promise (colocated and PivotRL at 0.5×, 1×,
2×, 4× `loop.batch_prompts`), and for the planner beyond the paper (pivot+ with elastic
training) its end-to-end share of the work-conserving bound and its shifts per step
(Figure 14 plots 4–6 per step at H = 60).

JSON keys (a contract): `cells` → [{`group`, `mode`, `sim`, `paper`, `ratio`, `generated`,
`processed`, `bound`}], `max_abs_log_ratio` (max |ln(sim/paper)| over the cells; ±35 % is
ln 1.35 = 0.30 above and |ln 0.65| = 0.43 below), `within_35_percent` (cells within
0.65–1.35×), `batch_sensitivity` → group → scale → {`colocated`, `pivot`,
`pivot_over_colocated`}, `pivot_plus_elastic` → group → {`tokens_per_s`,
`processed_tokens_per_s`, `tokens_per_s_bound`, `end_to_end_over_bound`,
`tokens_per_s_steady`, `tokens_per_s_critical_path`, `shifts_per_step` (replica shift-ups),
`plans_per_step`}, `count`, `steps`, `seed`, `batch_scale`.
`--quick` (3 steps, batches at 1/8, for CI) keeps the keys; its numbers are not Figure 9's
setting.
"""

from __future__ import annotations

import argparse
import math
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from pivot_hpc.bench.stats import table

ROOT = Path(__file__).resolve().parents[2]
MODES = ("colocated", "disaggregated", "rr_colocated", "pivot")
# Figure 9 (tokens/s, the mean of three runs): the test, never a calibration input.
FIGURE9: dict[int, dict[str, float]] = {
    1: {"colocated": 27184, "disaggregated": 31176, "rr_colocated": 25405, "pivot": 50077},
    2: {"colocated": 11545, "disaggregated": 14189, "rr_colocated": 11711, "pivot": 22822},
    3: {"colocated": 9998, "disaggregated": 13681, "rr_colocated": 11343, "pivot": 20503},
    4: {"colocated": 6915, "disaggregated": 7954, "rr_colocated": 7530, "pivot": 12503},
}
SCALES = (0.5, 1.0, 2.0, 4.0)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--groups", default="1,2,3,4", help="paper groups, comma-separated")
    p.add_argument("--steps", type=int, default=6, help="RL steps per run (default 6)")
    p.add_argument("--seed", type=int, default=7, help="workload seed (default 7)")
    p.add_argument("--count", default="processed", choices=["processed", "generated"])
    p.add_argument(
        "--scales",
        default=",".join(f"{s:g}" for s in SCALES),
        help="batch-size multiples for the sensitivity ('' to skip)",
    )
    p.add_argument("--quick", action="store_true", help="3 steps, batches at 1/8 (CI)")
    p.add_argument("--jobs", type=int, default=1, help="simulations run in parallel")
    p.add_argument("overrides", nargs="*", help="dotted config overrides for every run")


def group_config(group: int) -> Path:
    """The paper group's config (configs/groups/groupN-…)."""
    for pattern in (f"configs/groups/group{group}-*.yaml", f"configs/**/group{group}-*.yaml"):
        found = sorted(ROOT.glob(pattern))
        if found:
            return found[0]
    from pivot_hpc.errors import UsageError

    raise UsageError(f"no config for paper group {group} under {ROOT / 'configs'}")


def _one(job: tuple[str, list[str], float]) -> dict:
    from pivot_hpc.bench.sim_rates import simulate_rates
    from pivot_hpc.config import validate_tree
    from pivot_hpc.job.config import load_config

    config, overrides, scale = job
    cfg = load_config(config, overrides, files=False)
    if scale != 1.0:
        prompts = max(1, round(cfg.loop.batch_prompts * scale))
        cfg = load_config(config, [*overrides, f"loop.batch_prompts={prompts}"], files=False)
    validate_tree(cfg)
    return simulate_rates(cfg)


def _overrides(mode: str, strategy: str, elastic: bool, common: list[str]) -> list[str]:
    over = [
        *common,
        f"deployment.mode={mode}",
        f"planner.strategy={strategy}",
        f"planner.elastic_training={str(elastic).lower()}",
    ]
    if mode == "colocated":  # synchronous by definition
        over.append("deployment.staleness=0")
    return over


def run(args: argparse.Namespace) -> dict:
    from pivot_hpc.errors import UsageError

    try:
        groups = [int(g) for g in args.groups.split(",") if g]
        scales = [float(s) for s in args.scales.split(",") if s]
    except ValueError:
        raise UsageError("--groups and --scales take comma-separated numbers") from None
    if bad := [g for g in groups if g not in FIGURE9]:
        raise UsageError(f"--groups {bad}: the paper has groups 1-4")
    steps, base = (3, 0.125) if args.quick else (args.steps, 1.0)
    common = [f"loop.steps={steps}", f"sim.seed={args.seed}", *args.overrides]
    jobs: list[tuple[str, list[str], float]] = []
    keys: list[tuple[str, int, object]] = []
    for g in groups:
        config = str(group_config(g))
        for mode in MODES:
            jobs.append((config, _overrides(mode, "pivot", False, common), base))
            keys.append(("cell", g, mode))
        jobs.append((config, _overrides("pivot", "pivot+", True, common), base))
        keys.append(("plus", g, None))
        for s in scales:
            if s == 1.0:
                continue  # the cells themselves
            for mode in ("colocated", "pivot"):
                jobs.append((config, _overrides(mode, "pivot", False, common), base * s))
                keys.append(("scale", g, (s, mode)))
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            results = list(pool.map(_one, jobs))
    else:
        results = [_one(j) for j in jobs]
    key = "processed_tokens_per_s" if args.count == "processed" else "tokens_per_s"
    cells, plus, sens = [], {}, {}
    for (kind, g, what), res in zip(keys, results, strict=True):
        name = f"group{g}"
        if kind == "cell":
            paper = FIGURE9[g][str(what)]
            cells.append(
                {
                    "group": g,
                    "mode": what,
                    "sim": res[key],
                    "paper": paper,
                    "ratio": res[key] / paper,
                    "generated": res["tokens_per_s"],
                    "processed": res["processed_tokens_per_s"],
                    "bound": res["processed_tokens_per_s_bound"]
                    if args.count == "processed"
                    else res["tokens_per_s_bound"],
                    "shifts_per_step": res["shifts_per_step"],
                    "plans_per_step": res["plans_per_step"],
                }
            )
            if 1.0 in scales and what in ("colocated", "pivot"):
                sens.setdefault(name, {}).setdefault("1", {})[str(what)] = res[key]
        elif kind == "plus":
            plus[name] = {
                k: res[k]
                for k in (
                    "tokens_per_s",
                    "processed_tokens_per_s",
                    "tokens_per_s_bound",
                    "end_to_end_over_bound",
                    "tokens_per_s_steady",
                    "tokens_per_s_critical_path",
                    "shifts_per_step",
                    "plans_per_step",
                )
            }
        else:
            s, mode = what  # type: ignore[misc]
            sens.setdefault(name, {}).setdefault(f"{s:g}", {})[mode] = res[key]
    for by_scale in sens.values():
        for r in by_scale.values():
            if r.get("colocated") and r.get("pivot") is not None:
                r["pivot_over_colocated"] = r["pivot"] / r["colocated"]
    logs = [abs(math.log(c["ratio"])) for c in cells if c["ratio"] > 0]
    out = {
        "cells": cells,
        "max_abs_log_ratio": max(logs) if logs else None,
        "within_35_percent": sum(0.65 <= c["ratio"] <= 1.35 for c in cells),
        "batch_sensitivity": sens,
        "pivot_plus_elastic": plus,
        "count": args.count,
        "steps": steps,
        "seed": args.seed,
        "batch_scale": base,
    }
    if not args.json:
        rows = [["group", "mode", f"sim ({args.count})", "paper", "sim/paper", "generated"]]
        for c in cells:
            rows.append(
                [
                    str(c["group"]),
                    str(c["mode"]),
                    f"{c['sim']:.0f}",
                    f"{c['paper']:.0f}",
                    f"{c['ratio']:.2f}",
                    f"{c['generated']:.0f}",
                ]
            )
        print(table(rows))
        print(
            f"max |ln(sim/paper)| {out['max_abs_log_ratio']:.3f}; "
            f"{out['within_35_percent']}/{len(cells)} cells within ±35 %"
        )
        for name, p in plus.items():
            print(
                f"{name} pivot+ elastic: {p['end_to_end_over_bound']:.2f} of the "
                f"work-conserving bound end to end, {p['shifts_per_step']:.1f} shifts/step"
            )
        for name, by_scale in sens.items():
            cells_ = "  ".join(
                f"{s}x: {r.get('pivot', 0):.0f}/{r.get('colocated', 0):.0f}"
                for s, r in sorted(by_scale.items(), key=lambda kv: float(kv[0]))
            )
            print(f"{name} batch sensitivity (pivot/colocated): {cells_}")
    return out
