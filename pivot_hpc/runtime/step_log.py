"""What a finished RL step reports: the console line's extras and the trackers' scalars."""

from __future__ import annotations

from collections.abc import Mapping

# metrics of the training step passed through to the trackers as `train/<name>`
TRAIN_METRICS = (
    "loss",
    "pg_loss",
    "kl",
    "clip",
    "ratio",
    "approx_kl",
    "grad_norm",
    "skipped_nonfinite",
    "lr",
    "staleness",
    "mismatch_abs_logp",
    "is_ratio_p05",
    "is_ratio_p50",
    "is_ratio_p95",
    "is_truncated_frac",
    "is_masked_frac",
)


def mismatch_summary(m: dict) -> str:
    """The rollout/trainer mismatch of a step (when the trainer recomputes old logprobs)."""
    if "mismatch_abs_logp" not in m:
        return ""
    out = f"  |Δlogp|={m['mismatch_abs_logp']:.4f} IS p95={m.get('is_ratio_p95', 1.0):.3f}"
    for key, name in (("is_truncated_frac", "capped"), ("is_masked_frac", "masked")):
        if key in m:
            out += f" {name}={m[key]:.1%}"
    return out


def skipped_summary(m: Mapping[str, float]) -> str:
    """A step whose gradient was not finite: no optimizer step (nothing otherwise)."""
    return "  SKIPPED: gradient not finite" if m.get("skipped_nonfinite") else ""


def filtered_summary(m: Mapping[str, float]) -> str:
    """Groups dynamic sampling dropped from the step's batch (nothing when none)."""
    n = int(m.get("filtered_groups", 0))
    return f" filtered={n}" if n else ""


def step_scalars(
    m: Mapping[str, float], allocation: Mapping[str, int], shifts_up: int, queued: Mapping[str, int]
) -> dict[str, float]:
    """The trackers' scalars of one step (names "section/name")."""
    span = max(m["t"] - m["start"], 1e-9)
    out = {
        "reward/mean": m["reward"],
        "throughput/rollout_tokens_per_s": m["rollout_tokens"] / span,
        "throughput/reward_tokens_per_s": m["reward_tokens"] / span,
        "time/step_end_s": m["t"],
        "planner/shifts_up_total": float(shifts_up),
        "reward/filtered_groups": m.get("filtered_groups", 0.0),
    }
    out |= {f"alloc/{role}_gpus": float(n) for role, n in allocation.items()}
    out |= {f"queue/{role}": float(n) for role, n in queued.items()}
    out |= {f"train/{k}": float(m[k]) for k in TRAIN_METRICS if k in m}
    return out


def monitor_summary(coord) -> str:
    """What the monitor measured: τ_shift per role the planner used at the end, and how
    often the throughput constants were refitted from the engines' decode steps."""
    parts = []
    if coord.shift_clock is not None and coord.shift_clock.measured:
        t = coord.topology.shift_time
        parts.append(
            f"τ_shift measured rollout {t.rollout:.3f}s reward {t.reward:.3f}s "
            f"training {t.training:.3f}s"
        )
    if coord.fits:
        parts.append(f"A–D refitted {coord.stats.refits}×")
    return f"; {', '.join(parts)}" if parts else ""
