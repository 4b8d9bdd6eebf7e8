"""`pivot-hpc bench groups [--admission all|pipeline] --json`: Figures 9, 11 and 14 from
the simulator, side by side.

Simulates each paper model group (`configs/groups/group*.yaml`, or --configs) in every static
mode (colocated, disaggregated, rr_colocated) and in pivot mode with each planner strategy
(--strategies: the paper's `pivot`, our `pivot+`, the §8.4 ablations static, rule,
vanilla), with and without elastic training for pivot and pivot+ (`+elastic`), and — with
--horizons — pivot+ elastic over several H (Figure 14). Every run of one invocation uses
the same `scheduler.admission` and overrides, so the ratios compare planners, not
settings (colocated always runs at staleness 0: it is synchronous; a `deployment.staleness`
override applies to the other modes). The simulator is deterministic for a seed: the
numbers are simulated throughput, not timings of this machine.

JSON keys (a contract): `groups` → config stem → {`runs` → label → {`tokens_per_s`,
`tokens_per_s_steady`, `tokens_per_s_bound`, `processed_tokens_per_s`,
`processed_tokens_per_s_steady`, `processed_tokens_per_s_bound` (the same rates counting
prompts and the GenRM's inputs, §8.1), `steady_over_bound`, `shifts`,
`training_prewarms`, `tokens_per_s_critical_path`, `end_to_end_over_bounds`},
`best_static` (label), `ranked_by` (`steady`, or `end_to_end` when a run is too short for a
full-pipeline window: 2·staleness + 3 steps), `ratios` → pivot label →
{`over_disaggregated`, `over_colocated`, `over_best_static`} (throughput ratios of that
kind; with enough steps also `made_over_…`, the same of
`tokens_per_s_steady_made`), and with enough steps `ratio_ceiling` →
{`over_disaggregated`, `over_colocated`, `over_best_static`}: the work-conserving bound over
each static mode's made rate, the highest `made_over_…` ratio any schedule of these GPUs
could reach (a ratio goal above it is out of reach whatever the planner does)}; also
`admission`, `steps`.
Each run also reports `tokens_per_s_steady_made`: the work done while the pipeline runs
full (tokens made and steps trained in that window, in GPU-seconds at the bound's rates)
as tokens/s at the run's mix of work, see `telemetry.summary.steady_work_share`; `steady_over_bound`
is that over the work-conserving bound, the share of GPU time doing work at the bound's
rates. `tokens_per_s_critical_path` is the second bound (job/sim_bound.py): no schedule runs
faster than each step's longest sample alone plus its training on every GPU allow, at the
run's staleness; `end_to_end_over_bounds` is the run's end-to-end throughput over the
lower of the two bounds — how much of what is possible the run reached.
"""

from __future__ import annotations

import argparse
import math
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from pivot_hpc.bench.stats import table

ROOT = Path(__file__).resolve().parents[2]
STATIC = ("colocated", "disaggregated", "rr_colocated")
STRATEGIES = ("pivot", "pivot+", "static", "rule", "vanilla")
ELASTIC = ("pivot", "pivot+")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--configs",
        type=Path,
        nargs="*",
        default=None,
        help="deployment configs (default: configs/groups/group*.yaml)",
    )
    p.add_argument("--admission", default="pipeline", choices=["all", "pipeline"])
    p.add_argument("--steps", type=int, default=None, help="RL steps (default: the config's)")
    p.add_argument(
        "--strategies",
        default=",".join(STRATEGIES),
        help=f"pivot-mode strategies, comma-separated (default {','.join(STRATEGIES)})",
    )
    p.add_argument("--horizons", default="", help="H values for pivot+ +elastic, e.g. 10,60,600")
    p.add_argument("--jobs", type=int, default=1, help="simulations run in parallel")
    p.add_argument("overrides", nargs="*", help="dotted config overrides for every run")


def _label(mode: str, strategy: str, elastic: bool, horizon: float | None) -> str:
    name = mode if mode != "pivot" else strategy
    if elastic:
        name += "/elastic"
    if horizon is not None:
        name += f"@H={horizon:g}"
    return name


def _one(job: tuple[str, list[str]]) -> dict:
    from pivot_hpc.bench.sim_rates import simulate_rates
    from pivot_hpc.config import validate_tree
    from pivot_hpc.job.config import load_config

    config, overrides = job
    cfg = load_config(config, overrides, files=False)
    validate_tree(cfg)
    s = simulate_rates(cfg)
    bound = s["tokens_per_s_bound"]
    return {
        "tokens_per_s": s["tokens_per_s"],
        "tokens_per_s_steady": s["tokens_per_s_steady"],
        "tokens_per_s_bound": bound,
        # §8.1's count: prompts and the GenRM's inputs too (telemetry/summary.py)
        "processed_tokens_per_s": s["processed_tokens_per_s"],
        "processed_tokens_per_s_steady": s["processed_tokens_per_s_steady"],
        "processed_tokens_per_s_bound": s["processed_tokens_per_s_bound"],
        "tokens_per_s_steady_made": s["tokens_per_s_steady_made"],
        # the work done while the pipeline runs full, not the steps' tokens: part of those
        # was made during the fill, and the bound is a rate of work
        "steady_over_bound": s["steady_work_share"] or 0.0,
        "shifts": s["shifts"],
        "training_prewarms": s["training_prewarms"],
        "tokens_per_s_critical_path": s["tokens_per_s_critical_path"],
        # both bounds hold end to end (fill and drain included), so this share is <= 1
        "end_to_end_over_bounds": s["tokens_per_s"]
        / min(bound or math.inf, s["tokens_per_s_critical_path"]),
    }


def _over_static(rate: dict[str, float], label: str, prefix: str) -> dict[str, float]:
    """`label`'s rate over disaggregated, colocated and the best static mode."""
    best = max(STATIC, key=lambda m: rate[m])
    return {
        f"{prefix}over_disaggregated": rate[label] / rate["disaggregated"],
        f"{prefix}over_colocated": rate[label] / rate["colocated"],
        f"{prefix}over_best_static": rate[label] / rate[best],
    }


def run(args: argparse.Namespace) -> dict:
    from pivot_hpc.errors import UsageError

    configs = args.configs or sorted((ROOT / "configs/groups").glob("group*.yaml"))
    for c in configs:
        if not Path(c).is_file():
            raise UsageError(f"--configs {c}: no such file")
    strategies = [s for s in args.strategies.split(",") if s]
    bad = [s for s in strategies if s not in STRATEGIES]
    if bad:
        raise UsageError(f"--strategies {','.join(bad)}: choose from {', '.join(STRATEGIES)}")
    try:
        horizons = [float(h) for h in args.horizons.split(",") if h]
    except ValueError:
        raise UsageError(f"--horizons {args.horizons}: comma-separated seconds") from None
    common = [f"scheduler.admission={args.admission}", *args.overrides]
    if args.steps is not None:
        common.append(f"loop.steps={args.steps}")
    variants: list[tuple[str, str, bool, float | None]] = [
        (m, "pivot", False, None) for m in STATIC
    ]
    variants += [("pivot", s, False, None) for s in strategies]
    variants += [("pivot", s, True, None) for s in strategies if s in ELASTIC]
    variants += [("pivot", "pivot+", True, h) for h in horizons]
    jobs, keys = [], []
    for c in configs:
        for mode, strategy, elastic, horizon in variants:
            over = [
                *common,
                f"deployment.mode={mode}",
                f"planner.strategy={strategy}",
                f"planner.elastic_training={str(elastic).lower()}",
            ]
            if horizon is not None:
                over.append(f"planner.horizon_s={horizon}")
            if mode == "colocated":  # synchronous by definition, whatever the others run at
                over.append("deployment.staleness=0")
            jobs.append((str(c), over))
            keys.append((Path(c).stem, _label(mode, strategy, elastic, horizon)))
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            results = list(pool.map(_one, jobs))
    else:
        results = [_one(j) for j in jobs]
    groups: dict[str, dict] = {}
    for (group, label), res in zip(keys, results, strict=True):
        groups.setdefault(group, {"runs": {}})["runs"][label] = res
    for g in groups.values():
        runs = g["runs"]
        # steady state where every run has a full-pipeline window (2·staleness + 3 steps
        # or more), else end to end: a shorter run's late window would measure the drain
        steady = {k: v["tokens_per_s_steady"] for k, v in runs.items()}
        g["ranked_by"] = "steady" if all(steady.values()) else "end_to_end"
        if g["ranked_by"] == "end_to_end":
            steady = {k: v["tokens_per_s"] for k, v in runs.items()}
        g["best_static"] = max(STATIC, key=lambda m: steady[m])
        g["ratios"] = {k: _over_static(steady, k, "") for k in runs if k not in STATIC}
        made = {k: v["tokens_per_s_steady_made"] or 0.0 for k, v in runs.items()}
        if all(made[m] for m in STATIC):  # None with too few steps
            for k, r in g["ratios"].items():
                r.update(_over_static(made, k, "made_"))
            # every run of a group draws the same samples, so one bound serves them all
            bound = runs["disaggregated"]["tokens_per_s_bound"]
            g["ratio_ceiling"] = _over_static({**made, "bound": bound}, "bound", "")
    out = {"groups": groups, "admission": args.admission, "steps": args.steps}
    if not args.json:
        for name, g in groups.items():
            print(
                f"{name} (admission {args.admission}; best static: {g['best_static']}; "
                f"ratios of {g['ranked_by'].replace('_', '-')} throughput)"
            )
            rows = [
                [
                    "run",
                    "tok/s",
                    "processed",
                    "steady",
                    "made",
                    "bound",
                    "made/bound",
                    "crit. path",
                    "tok/s÷bounds",
                    "shifts",
                    "÷best static",
                ]
            ]
            for k, v in g["runs"].items():
                ratio = g["ratios"].get(k, {}).get("over_best_static")
                rows.append(
                    [
                        k,
                        f"{v['tokens_per_s']:.0f}",
                        f"{v['processed_tokens_per_s']:.0f}",
                        "-"
                        if v["tokens_per_s_steady"] is None
                        else f"{v['tokens_per_s_steady']:.0f}",
                        f"{v['tokens_per_s_steady_made'] or 0:.0f}",
                        f"{v['tokens_per_s_bound']:.0f}",
                        f"{v['steady_over_bound']:.2f}",
                        f"{v['tokens_per_s_critical_path']:.0f}",
                        f"{v['end_to_end_over_bounds']:.2f}",
                        str(v["shifts"]),
                        "" if ratio is None else f"{ratio:.2f}",
                    ]
                )
            print(table(rows))
            if "ratio_ceiling" in g:
                c = g["ratio_ceiling"]
                print(
                    "ceiling (bound ÷ a static mode's made rate, the most any planner can "
                    f"show): ÷disaggregated {c['over_disaggregated']:.2f}, "
                    f"÷colocated {c['over_colocated']:.2f}, "
                    f"÷best static {c['over_best_static']:.2f}"
                )
    return out
