"""Metrics over a run's telemetry, shared by `pivot-hpc report` and the analysis scripts.

Definitions (also in analysis/README.md):
- end-to-end throughput (paper §8.1): Σ over `steps` rows of (rollout_tokens + reward_tokens)
  ÷ (last step end − first step start). Training tokens are not added: they are the same
  tokens the rollout generated, trained on. A step logged twice (redone after a resume from
  an older checkpoint) counts once, with its last row.
- steady-state throughput: the tokens the engines made while the pipeline runs full ÷
  the time they were made in: from the end of step `staleness` (the fill is over) to the
  end of step N − staleness − 2 (the last batch is released then: after it the pipeline
  drains), the difference of the steps' cumulative `made_*_tokens` over that window
  (`full_pipeline_window`). Only work done inside the window counts: crediting each
  step's tokens to the window its step ends in (older builds; still the fallback for rows
  without made tokens) counted tokens made during the fill and could pass the
  work-conserving bound, and a window running to the last step's end measured the drain.
  None with fewer than 2·staleness + 3 completed steps (7 at the default staleness 2).
- processed tokens (`processed_tokens_per_s`, `…_steady`, `…_bound`): the paper's §8.1
  "total tokens processed": per step the rollout's prompts and responses plus the GenRM's
  whole input (prompt + response) and its judgements, 2·train_tokens + reward_tokens (exact
  when every generated sample is trained; with dynamic sampling the dropped samples' prompts
  and GenRM inputs are left out). `tokens_per_s` stays generated tokens only. The steady
  and bound twins are the generated-token rates times the processed/generated ratio of the
  steps they cover (the steps after the fill, all steps).
- work-conserving bound: tokens ÷ (GPU-seconds the run's work needs at each role's best
  per-GPU rate, no shift cost, ÷ GPUs): rollout tokens / best rollout tokens/s per GPU +
  reward tokens / best reward tokens/s per GPU + trained tokens × training GPU-seconds per
  token, with the rates from the run's `bound_*` attributes (written by the simulator from
  the lengths of the run's own samples, job/sim_bound.py; None for runs without them).
- critical-path bound: the run's `bound_critical_path` attribute (simulated runs: each
  step's longest sample alone plus its training on every GPU, job/sim_bound.py).
- steady work share: the work done while the pipeline runs full (tokens the engines made,
  from the steps' `made_*_tokens`, and steps trained) at the bound's rates ÷ GPU time; the
  steady made rate is that share × the bound (`steady_work_share`, `steady_made_rate`).
- utilisation of a role: GPU-seconds it held ÷ all GPU-seconds, with the `allocation` series
  read as piecewise constant (a row holds until the next; the last until the run's end time).
- shifts: `shifts` rows of kind "up" (one per replica joining a role); per step = ÷ steps.
- Eq. 1 overall throughput: (N_ro + N_rm) / (N_ro/T_ro + N_rm/T_rm), N = n_seq (running +
  queued), T = tokens_per_s; a role without work adds no latency, a role with work and
  T = 0 makes it 0.
- tool calls (`tool_calls` rows, schema 5): `tool_calls` answered, `tool_call_trajectory_share`
  (trained trajectories with at least one call), `tool_wait_s_mean` (the mean parked wait),
  and `tool_latency` per tool (names and statuses made printable): calls, statuses
  {status: calls}, the parked wait's p50/p90/max (`wait_s_*`, linear-interpolated
  percentiles) and the mean seconds in the sandbox (`tool_s_mean`); {} without calls.
- turns (`turns` rows, schema 6; tools runs only): `turns` finished, and their mean seconds
  queued for a slot (`turn_queued_s_mean`) and generating (`turn_gen_s_mean`, migrations
  included); None without rows. The parked wait between turns is `tool_wait_s_mean`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from pivot_hpc.telemetry.errors import printable
from pivot_hpc.telemetry.reader import Run

ALLOC_ROLES = ("rollout", "reward", "training", "idle", "transition")
PLANNER_PHASES = ("preprocess", "construct", "simulate", "total")
MIGRATION_PHASES = ("abort", "dispatch", "reprefill", "total")


def completed_steps(steps: np.ndarray) -> np.ndarray:
    """One row per step number, the last one logged, by step. A step logged twice was
    redone after a resume from an older checkpoint: its first tokens were thrown away
    (their time still counts in the run's duration)."""
    if len(steps) == 0:
        return steps
    # np.unique sorts the step numbers; on the reversed rows it finds each one's last row.
    last = len(steps) - 1 - np.unique(steps["step"][::-1], return_index=True)[1]
    return steps[last]


def end_to_end(steps: np.ndarray) -> dict[str, float]:
    """Tokens, duration and end-to-end tokens/s over the completed steps."""
    if len(steps) == 0:
        return {"tokens": 0, "duration_s": 0.0, "tokens_per_s": 0.0}
    tokens = int(steps["rollout_tokens"].sum() + steps["reward_tokens"].sum())
    duration = float(steps["end"].max() - steps["start"].min())
    return {
        "tokens": tokens,
        "duration_s": duration,
        "tokens_per_s": tokens / duration if duration > 0 else 0.0,
    }


STEP_FIELDS = [
    ("step", "i8"),
    ("start", "f8"),
    ("end", "f8"),
    ("rollout_tokens", "i8"),
    ("reward_tokens", "i8"),
    ("train_tokens", "i8"),
    ("made_rollout_tokens", "f8"),
    ("made_reward_tokens", "f8"),
]


def step_table(rows: list[tuple]) -> np.ndarray:
    """(step, start, end, rollout, reward, train tokens[, made rollout, made reward
    tokens]) rows as a `steps`-like array (made tokens NaN where a row has none)."""
    pad = (math.nan,) * len(STEP_FIELDS)
    return np.array([tuple(r) + pad[len(r) :] for r in rows], dtype=STEP_FIELDS)


def full_pipeline_window(n_steps: int, staleness: int) -> tuple[int, int] | None:
    """Positions (in step order) of the steps whose ends bound the time the pipeline runs
    full: from the end of step `staleness` (the fill is over) to the end of step
    N − staleness − 2 (the last batch is released then; after it the pipeline drains).
    None with fewer than 2·staleness + 3 completed steps."""
    first, last = staleness, n_steps - staleness - 2
    return (first, last) if last > first else None


def steady_state(steps: np.ndarray, staleness: int) -> float | None:
    """Tokens/s made while the pipeline runs full (see the module docstring)."""
    window = full_pipeline_window(len(steps), staleness)
    if window is None:
        return None
    by_step = steps[np.argsort(steps["step"], kind="stable")]
    first, last = by_step[window[0]], by_step[window[1]]
    span = float(last["end"]) - float(first["end"])
    if span <= 0:
        return None
    made = float(
        last["made_rollout_tokens"]
        + last["made_reward_tokens"]
        - first["made_rollout_tokens"]
        - first["made_reward_tokens"]
    )
    if math.isfinite(made) and made >= 0:  # counters restart with a resumed process
        return made / span
    inside = by_step[window[0] + 1 : window[1] + 1]  # older rows: the steps ended inside
    return float(inside["rollout_tokens"].sum() + inside["reward_tokens"].sum()) / span


def processed_tokens(steps: np.ndarray) -> float:
    """§8.1's tokens processed: prompts + responses (rollout) + the GenRM's inputs
    (prompt + response) + judgements = 2·train_tokens + reward_tokens."""
    return float(2 * steps["train_tokens"].sum() + steps["reward_tokens"].sum())


def processed_ratio(steps: np.ndarray) -> float | None:
    """Processed over generated tokens of these steps (None without tokens)."""
    generated = float(steps["rollout_tokens"].sum() + steps["reward_tokens"].sum())
    return processed_tokens(steps) / generated if generated > 0 else None


def processed_rates(
    steps: np.ndarray,
    staleness: int,
    tokens_per_s: float,
    steady: float | None,
    bound: float | None,
) -> dict[str, float | None]:
    """The processed-token twins of the generated-token rates (module docstring)."""
    by_step = steps[np.argsort(steps["step"], kind="stable")] if len(steps) else steps
    whole = processed_ratio(by_step) if len(by_step) else None
    window = full_pipeline_window(len(by_step), staleness)
    after_fill = processed_ratio(by_step[window[0] + 1 : window[1] + 1]) if window else None
    return {
        "processed_tokens_per_s": tokens_per_s * whole if whole else 0.0,
        "processed_tokens_per_s_steady": steady * after_fill
        if steady is not None and after_fill
        else None,
        "processed_tokens_per_s_bound": bound * whole if bound is not None and whole else None,
    }


def bound_gpu_s(rollout: float, reward: float, trained: float, attr: Any) -> float | None:
    """GPU-seconds of that much work at the bound's rates (the run's `bound_*`
    attributes; None without them)."""
    rates = [attr(k) for k in ("bound_rollout_per_gpu", "bound_reward_per_gpu")]
    train = attr("bound_train_gpu_s_per_token")
    if None in rates or train is None or min(rates) <= 0:
        return None
    return rollout / rates[0] + reward / rates[1] + trained * train


def work_conserving_bound(steps: np.ndarray, attr: Any, gpus: int | None) -> float | None:
    """Tokens/s if every GPU ran its role's best per-GPU rate with no shift cost."""
    if not len(steps) or not gpus:
        return None
    ro, rm = float(steps["rollout_tokens"].sum()), float(steps["reward_tokens"].sum())
    gpu_s = bound_gpu_s(ro, rm, float(steps["train_tokens"].sum()), attr)
    return (ro + rm) / (gpu_s / gpus) if gpu_s else None


def steady_work_share(
    steps: np.ndarray, staleness: int, attr: Any, gpus: int | None
) -> float | None:
    """The share of GPU time spent on work at the bound's rates while the pipeline runs
    full: from the end of step `staleness` (the fill is over) to the end of step
    N − staleness − 2 (the last batch is released then; after it the pipeline drains), the
    rollout and reward tokens the engines made in it (the steps' `made_*_tokens`) and the
    training of the steps trained in it, in GPU-seconds at the work-conserving bound's
    rates, over GPUs × time. The steady-state throughput credits each step's tokens to the
    window its step ends in, some of them made during the fill, and a window's tokens alone
    miss the training done in it; this counts all work where it happened. None with fewer
    than 2·staleness + 3 completed steps, without the bound's rates or made tokens."""
    window = full_pipeline_window(len(steps), staleness)
    if window is None or not gpus:
        return None
    staleness, closed = window
    by_step = steps[np.argsort(steps["step"], kind="stable")]
    first, last = by_step[staleness], by_step[closed]
    made = [float(last[k] - first[k]) for k in ("made_rollout_tokens", "made_reward_tokens")]
    if not all(math.isfinite(m) for m in made):
        return None
    trained = float(by_step["train_tokens"][staleness + 1 : closed + 1].sum())
    gpu_s = bound_gpu_s(made[0], made[1], trained, attr)
    span = float(last["end"]) - float(first["end"])
    return gpu_s / (gpus * span) if gpu_s is not None and span > 0 else None


def steady_made_rate(share: float | None, bound: float | None) -> float | None:
    """The steady work share as tokens/s at the run's mix of work (share × bound)."""
    return share * bound if share is not None and bound else None


def utilisation(alloc: np.ndarray, end_time: float) -> dict[str, float]:
    """Fraction of GPU-seconds each role held (keys ALLOC_ROLES) plus "gpu_seconds"."""
    out = dict.fromkeys(ALLOC_ROLES, 0.0)
    out["gpu_seconds"] = 0.0
    if len(alloc) == 0:
        return out
    a = alloc[np.argsort(alloc["t"], kind="stable")]
    t = a["t"]
    dt = np.diff(np.append(t, max(end_time, float(t[-1]))))
    held = {r: float((a[f"{r}_gpus"] * dt).sum()) for r in ALLOC_ROLES}
    total = sum(held.values())
    out["gpu_seconds"] = total
    if total > 0:
        for r in ALLOC_ROLES:
            out[r] = held[r] / total
    return out


def eq1(n_ro: np.ndarray, t_ro: np.ndarray, n_rm: np.ndarray, t_rm: np.ndarray) -> np.ndarray:
    """Eq. 1 overall throughput, elementwise (same rules as planner.plan.overall_throughput)."""
    n_ro, t_ro, n_rm, t_rm = (np.asarray(x, dtype=np.float64) for x in (n_ro, t_ro, n_rm, t_rm))
    total = n_ro + n_rm
    starved = ((n_ro > 0) & (t_ro <= 0)) | ((n_rm > 0) & (t_rm <= 0))
    with np.errstate(divide="ignore", invalid="ignore"):
        latency = np.where(n_ro > 0, n_ro / t_ro, 0.0) + np.where(n_rm > 0, n_rm / t_rm, 0.0)
        out = np.where((total > 0) & ~starved & (latency > 0), total / latency, 0.0)
    return out


def role_timeline(run: Run, value: str = "tokens_per_s") -> dict[str, np.ndarray]:
    """Rollout and reward series on the union of their sample times, each forward-filled
    (0 before a role's first sample): keys t, rollout, reward, rollout_n, reward_n, overall."""
    ro, rm = run.role("rollout"), run.role("reward")
    grid = np.unique(np.concatenate([ro["t"], rm["t"]]))
    out: dict[str, np.ndarray] = {"t": grid}
    for name, rows in (("rollout", ro), ("reward", rm)):
        idx = np.searchsorted(rows["t"], grid, side="right") - 1
        ok = idx >= 0
        safe = np.clip(idx, 0, None)
        if len(rows):
            out[name] = np.where(ok, rows[value][safe], 0.0).astype(np.float64)
            out[f"{name}_n"] = np.where(ok, rows["n_seq"][safe], 0).astype(np.float64)
        else:
            out[name] = np.zeros(len(grid))
            out[f"{name}_n"] = np.zeros(len(grid))
    out["overall"] = eq1(out["rollout_n"], out["rollout"], out["reward_n"], out["reward"])
    return out


def _stats(x: np.ndarray) -> dict[str, float]:
    if len(x) == 0:
        nan = math.nan
        return {"mean": nan, "std": nan, "median": nan, "p90": nan, "max": nan}
    return {
        "mean": float(x.mean()),
        "std": float(x.std()),
        "median": float(np.median(x)),
        "p90": float(np.percentile(x, 90)),
        "max": float(x.max()),
    }


def planner_stats(planner: np.ndarray) -> dict[str, dict[str, float]]:
    """mean/std/median/p90/max seconds of each planner phase and of their total."""
    cols = {p: planner[f"{p}_s"].astype(np.float64) for p in PLANNER_PHASES[:-1]}
    cols["total"] = sum(cols.values(), np.zeros(len(planner)))
    return {p: _stats(cols[p]) for p in PLANNER_PHASES}


def migration_stats(migrations: np.ndarray) -> dict[str, dict[str, float]]:
    """Per-sequence migration phase seconds (Table 3), each event weighted by its
    sequence count; events that moved no sequence are left out."""
    m = migrations[migrations["sequences"] > 0]
    w = m["sequences"].astype(np.float64)
    out: dict[str, dict[str, float]] = {}
    total = np.zeros(len(m))
    for p in MIGRATION_PHASES[:-1]:
        x = m[f"{p}_s"].astype(np.float64)
        total = total + x
        out[p] = _weighted(x, w)
    out["total"] = _weighted(total, w)
    return out


def _weighted(x: np.ndarray, w: np.ndarray) -> dict[str, float]:
    if len(x) == 0 or w.sum() <= 0:
        return {"mean": math.nan, "std": math.nan}
    mean = float(np.average(x, weights=w))
    return {"mean": mean, "std": float(math.sqrt(np.average((x - mean) ** 2, weights=w)))}


def shift_counts(shifts: np.ndarray, steps: int) -> dict[str, Any]:
    up = shifts[shifts["kind"] == "up"]
    return {
        "shifts": len(up),
        "shifts_down": int((shifts["kind"] == "down").sum()),
        "shift_plans": len(np.unique(shifts["plan_id"][shifts["plan_id"] > 0])),
        "shifts_per_step": len(up) / steps if steps else 0.0,
        "shift_up_s_mean": float(up["total_s"].mean()) if len(up) else math.nan,
    }


def summarise(run: Run) -> dict[str, Any]:
    """The report as one JSON-able dict. Contract keys: mode, steps, tokens_per_s, shifts,
    reward_mean_first, reward_mean_last."""
    steps = completed_steps(run["steps"])
    e2e = end_to_end(steps)
    util = utilisation(run["allocation"], run.end_time)
    plan = planner_stats(run["planner"])
    mig = migration_stats(run["migrations"])
    gpus, staleness = run.attr("gpus"), int(run.attr("staleness", 0) or 0)
    bound = work_conserving_bound(steps, run.attr, gpus)
    share = steady_work_share(steps, staleness, run.attr, gpus)
    out: dict[str, Any] = {
        "run_dir": str(run.path),
        "files": len(run.files),
        "mode": run.mode,
        "strategy": run.attr("strategy"),
        "label": run.label,
        "gpus": run.attr("gpus"),
        "horizon_s": run.attr("horizon_s"),
        "simulated": run.attr("simulated"),
        "steps": len(steps),
        "tokens": e2e["tokens"],
        "train_tokens": int(steps["train_tokens"].sum()) if len(steps) else 0,
        "duration_s": e2e["duration_s"],
        "tokens_per_s": e2e["tokens_per_s"],
        "tokens_per_s_steady": steady_state(steps, staleness),
        "tokens_per_s_bound": bound,
        # simulated runs: no schedule passes the pipeline's critical path (job/sim_bound.py)
        "tokens_per_s_critical_path": run.attr("bound_critical_path"),
        "steady_work_share": share,
        "tokens_per_s_steady_made": steady_made_rate(share, bound),
        **processed_rates(
            steps, staleness, e2e["tokens_per_s"], steady_state(steps, staleness), bound
        ),
        "end_time_s": run.end_time,
        "reward_mean_first": float(steps["reward_mean"][0]) if len(steps) else None,
        "reward_mean_last": float(steps["reward_mean"][-1]) if len(steps) else None,
        "staleness_max": int(steps["staleness_max"].max()) if len(steps) else None,
        "steps_skipped_nonfinite": int(steps["skipped_nonfinite"].sum()) if len(steps) else 0,
        "utilisation": {r: util[r] for r in ALLOC_ROLES},
        "gpu_seconds": util["gpu_seconds"],
        **shift_counts(run["shifts"], len(steps)),
        "planner_calls": len(run["planner"]),
        "planner_total_median_s": plan["total"]["median"],
        "planner_total_p90_s": plan["total"]["p90"],
        "planner": {p: {"mean": s["mean"], "std": s["std"]} for p, s in plan.items()},
        "migration_events": len(run["migrations"]),
        "migration_sequences": int(run["migrations"]["sequences"].sum()),
        "migration_per_seq": mig,
        **failure_counts(run["failures"]),
        **tool_counts(run["tool_calls"], run["trained"]),
        **turn_splits(run["turns"]),
    }
    return _json_safe(out)


def tool_counts(calls: np.ndarray, trained: np.ndarray) -> dict[str, Any]:
    """Tool calls answered, the share of trained trajectories that made at least one,
    and the mean seconds a trajectory waited (parked) on a call (None without any)."""
    return {
        "tool_calls": len(calls),
        "tool_call_trajectory_share": float((trained["tool_calls"] > 0).mean())
        if len(trained)
        else None,
        "tool_wait_s_mean": float(calls["wait_s"].mean()) if len(calls) else None,
        "tool_latency": tool_latency(calls),
    }


def turn_splits(turns: np.ndarray) -> dict[str, Any]:
    """Generation turns of tool-using runs finished, and their mean seconds queued for a
    slot and generating (None without any; NaN rows left out)."""

    def mean(x: np.ndarray) -> float | None:
        x = x.astype(np.float64)
        x = x[np.isfinite(x)]
        return float(x.mean()) if len(x) else None

    return {
        "turns": len(turns),
        "turn_queued_s_mean": mean(turns["queued_s"]),
        "turn_gen_s_mean": mean(turns["gen_s"]),
    }


def tool_latency(calls: np.ndarray) -> dict[str, dict[str, Any]]:
    """Per tool: calls answered, their statuses, the parked wait's median, p90 and max
    and the mean seconds in the sandbox ({} without calls). Tool names and statuses are
    the file's text, made printable (names that differ only in control characters count
    as one)."""
    if len(calls) == 0:
        return {}
    tools = np.array([printable(str(x)) for x in calls["tool"]], dtype=object)
    statuses = [printable(str(x)) for x in calls["status"]]
    out: dict[str, dict[str, Any]] = {}
    for tool in sorted(set(tools)):
        mine = np.flatnonzero(tools == tool)
        wait = calls["wait_s"][mine].astype(np.float64)
        counts: dict[str, int] = {}
        for i in mine:
            counts[statuses[i]] = counts.get(statuses[i], 0) + 1
        out[tool] = {
            "calls": len(mine),
            "wait_s_p50": float(np.percentile(wait, 50)),
            "wait_s_p90": float(np.percentile(wait, 90)),
            "wait_s_max": float(wait.max()),
            "tool_s_mean": float(calls["tool_s"][mine].astype(np.float64).mean()),
            "statuses": dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))),
        }
    return out


def failure_counts(failures: np.ndarray) -> dict[str, Any]:
    """Engine processes that died while serving, and what their replicas lost (the
    sequences kept their streamed tokens; `tokens_regenerated` is an upper bound)."""
    action = failures["action"] if len(failures) else np.array([], dtype="U16")
    return {
        "engine_failures": len(failures),
        # started again: a serving replica at once, an idle role's engine at its next shift-up
        "engine_restarts": int(((action == "restart") | (action == "replaced")).sum()),
        "engines_excluded": sorted({str(r) for r in failures["replica"][action == "excluded"]})
        if len(failures)
        else [],
        "sequences_recovered": int(failures["sequences"].sum()) if len(failures) else 0,
        "tokens_regenerated": int(failures["tokens_lost"].sum()) if len(failures) else 0,
    }


def _json_safe(x: Any) -> Any:
    """NaN/inf → None so that `json.dumps` output is strict JSON."""
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _num(x: Any, fmt: str = "{:.3g}") -> str:
    return "-" if x is None else fmt.format(x)


TOOL_TABLE_ROWS = 12  # tools shown in the text report (the most called); --json has all


def _tool_table(latency: dict[str, dict[str, Any]]) -> list[str]:
    """The text report's per-tool lines: calls, statuses, parked wait p50/p90/max (s) and
    the mean seconds in the sandbox."""
    if not latency:
        return []
    rows = sorted(latency.items(), key=lambda kv: (-kv[1]["calls"], kv[0]))
    lines = [
        f"  {'tool':<16} {'calls':>7}  {'wait p50':>9} {'p90':>9} {'max':>9}  "
        f"{'run mean':>9}  statuses"
    ]
    for tool, t in rows[:TOOL_TABLE_ROWS]:
        statuses = ", ".join(f"{printable(str(k))} {v}" for k, v in t["statuses"].items())
        lines.append(
            f"  {printable(str(tool)):<16} {t['calls']:>7}  "
            + " ".join(
                f"{_num(t[k], '{:.3f}'):>9}" for k in ("wait_s_p50", "wait_s_p90", "wait_s_max")
            )
            + f"  {_num(t['tool_s_mean'], '{:.3f}'):>9}  {statuses}"
        )
    if len(rows) > TOOL_TABLE_ROWS:
        lines.append(f"  … {len(rows) - TOOL_TABLE_ROWS} more tools (report --json lists all)")
    return lines


def format_summary(s: dict[str, Any]) -> str:
    """The human-readable report."""
    u = s["utilisation"]
    lines = [
        f"run        {printable(s['run_dir'])}  ({s['files']} allocation file(s))",
        # the label is the file's text (Run.attr strips escapes); stripped again here since
        # summaries also come from elsewhere
        f"mode       {printable(str(s['label']))}   gpus={_num(s['gpus'], '{}')}   "
        f"H={_num(s['horizon_s'], '{:g}')}s   simulated={printable(str(s['simulated']))}",
        f"steps      {s['steps']}   duration {s['duration_s']:.1f} s",
        f"throughput {s['tokens_per_s']:.1f} tokens/s end to end "
        f"({s['tokens']} rollout+reward tokens)   steady state "
        f"{_num(s['tokens_per_s_steady'], '{:.1f}')}   work-conserving bound "
        f"{_num(s['tokens_per_s_bound'], '{:.1f}')}   critical-path bound "
        f"{_num(s['tokens_per_s_critical_path'], '{:.1f}')}",
        f"processed  {_num(s.get('processed_tokens_per_s'), '{:.1f}')} tokens/s end to end "
        "(prompts, GenRM inputs and generated tokens: the paper's §8.1 count)   steady state "
        f"{_num(s.get('processed_tokens_per_s_steady'), '{:.1f}')}   bound "
        f"{_num(s.get('processed_tokens_per_s_bound'), '{:.1f}')}",
        f"work       {_num(s['steady_work_share'], '{:.1%}')} of GPU time at the bound's rates "
        f"while the pipeline runs full ({_num(s['tokens_per_s_steady_made'], '{:.1f}')} "
        "tokens/s of work)",
        f"reward     first step {_num(s['reward_mean_first'], '{:.4f}')}   "
        f"last step {_num(s['reward_mean_last'], '{:.4f}')}",
        "GPU time   " + "   ".join(f"{r} {100 * u[r]:.1f}%" for r in ALLOC_ROLES),
        f"shifts     {s['shifts']} up / {s['shifts_down']} down in {s['shift_plans']} plan(s)"
        f"   {s['shifts_per_step']:.2f} up-shifts per step",
        f"planner    {s['planner_calls']} decisions   total median "
        f"{_num(s['planner_total_median_s'], '{:.3f}')} s   p90 "
        f"{_num(s['planner_total_p90_s'], '{:.3f}')} s",
        f"migration  {s['migration_events']} events, {s['migration_sequences']} sequences, "
        f"{_num(s['migration_per_seq']['total']['mean'], '{:.3f}')} s per sequence",
    ]
    if s.get("tool_calls"):
        lines.append(
            f"tools      {s['tool_calls']} calls   "
            f"{_num(s['tool_call_trajectory_share'], '{:.1%}')} of trained trajectories called   "
            f"mean wait {_num(s['tool_wait_s_mean'], '{:.3f}')} s"
        )
    if s.get("turns"):
        lines.append(
            f"turns      {s['turns']} finished   mean queued "
            f"{_num(s.get('turn_queued_s_mean'), '{:.3f}')} s   mean generating "
            f"{_num(s.get('turn_gen_s_mean'), '{:.3f}')} s"
        )
    if s.get("tool_calls"):
        lines.extend(_tool_table(s.get("tool_latency") or {}))
    if s.get("engine_failures"):
        excluded = ", ".join(s["engines_excluded"]) or "none"
        lines.append(
            f"failures   {s['engine_failures']} engine deaths, {s['engine_restarts']} restarted, "
            f"excluded: {excluded}; {s['sequences_recovered']} sequences recovered, "
            f"≤ {s['tokens_regenerated']} tokens generated again"
        )
    return "\n".join(lines)
