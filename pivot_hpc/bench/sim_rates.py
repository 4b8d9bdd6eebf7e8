"""One simulated run's rates, both token counts, for the simulator benches.

The keys of `pivot_hpc.job.simulate.simulate`'s summary a bench reports: generated-token rates
and their processed-token twins (telemetry/summary.py: prompts and the GenRM's inputs
counted as the paper's §8.1 does), computed with the summary's functions, so a bench,
`pivot-hpc simulate --json` and `pivot-hpc report` agree.
"""

from __future__ import annotations

from typing import Any

from pivot_hpc.job.config import Config

# the summary keys of `simulate` a bench reports
KEYS = (
    "tokens_per_s",
    "tokens_per_s_steady",
    "tokens_per_s_bound",
    "tokens_per_s_critical_path",
    "steady_work_share",
    "tokens_per_s_steady_made",
    "processed_tokens_per_s",
    "processed_tokens_per_s_steady",
    "processed_tokens_per_s_bound",
    "end_to_end_over_bound",
    "shifts",
    "shifts_per_step",
    "plans",
    "plans_per_step",
    "training_prewarms",
    "preempted_sequences",
    "sim_time_s",
    "steps",
)


def simulate_rates(cfg: Config) -> dict[str, Any]:
    """Run `cfg` to completion; its rates (generated and processed), bounds and shifts."""
    from pivot_hpc.job.simulate import simulate

    summary = simulate(cfg, None, progress=False)
    return {k: summary[k] for k in KEYS}
