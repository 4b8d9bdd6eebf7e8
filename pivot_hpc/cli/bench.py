"""`pivot-hpc bench NAME …`: rerunnable benchmarks; `--json` prints one JSON object.

Each benchmark is a module in `pivot_hpc.bench` with `add_arguments(parser)` and
`run(args) -> dict` (the JSON object; its human-readable table goes to stdout otherwise).
Only the chosen benchmark's module is imported.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

BENCHES: dict[str, tuple[str, str]] = {
    "planner": ("pivot_hpc.bench.planner_bench", "full five-step planner decision time"),
    "migration": ("pivot_hpc.bench.migration_bench", "shift-up / shift-down migration time"),
    "engine": ("pivot_hpc.bench.engine_bench", "hf engine tokens/s vs transformers generate"),
    "gps": ("pivot_hpc.bench.gps_bench", "GPS Read throughput vs memcpy, plan time (mpirun)"),
    "sim": ("pivot_hpc.bench.sim_bench", "simulator wall time at scale (paper group 4, N GPUs)"),
    "failures": (
        "pivot_hpc.bench.failures_bench",
        "throughput lost to engine deaths, pivot+ vs the static modes (simulated, N GPUs)",
    ),
    "groups": (
        "pivot_hpc.bench.groups_bench",
        "paper groups in every mode and strategy, simulated: Figures 9, 11, 14",
    ),
    "paper": (
        "pivot_hpc.bench.paper_bench",
        "Figure 9's sixteen cells simulated beside the paper's; batch-size sensitivity",
    ),
    "live": (
        "pivot_hpc.bench.live_bench",
        "live tiny run: pivot vs the static modes, side by side",
    ),
    "convergence": (
        "pivot_hpc.bench.convergence_bench",
        "held-out accuracy per mode over seeds, and Figure 15 from the runs",
    ),
}


def _chosen(argv: list[str]) -> str | None:
    try:
        return next(a for a in argv[argv.index("bench") + 1 :] if not a.startswith("-"))
    except (ValueError, StopIteration):
        return None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="BENCH")
    sub.required = True
    chosen = _chosen(sys.argv)  # None (import all) when called as a library
    for name, (module, help_text) in BENCHES.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--json", action="store_true", help="print one JSON object only")
        if chosen in (name, None):
            importlib.import_module(module).add_arguments(p)
        p.set_defaults(_bench_module=module)


def run(args: argparse.Namespace) -> int:
    mod = importlib.import_module(args._bench_module)
    result = mod.run(args)
    if args.json:
        print(json.dumps(result, sort_keys=True))
    return 0
