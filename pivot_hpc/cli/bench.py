"""`pivot-hpc bench NAME …`: rerunnable benchmarks; `--json` prints one JSON object.

Each benchmark is a module in `pivot_hpc.bench` with `add_arguments(parser)` and
`run(args) -> dict` (the JSON object; its human-readable table goes to stdout otherwise).
"""

from __future__ import annotations

import argparse
import importlib
import json

BENCHES: dict[str, tuple[str, str]] = {
    "planner": ("pivot_hpc.bench.planner_bench", "full five-step planner decision time"),
    "migration": ("pivot_hpc.bench.migration_bench", "shift-up / shift-down migration time"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="BENCH")
    sub.required = True
    for name, (module, help_text) in BENCHES.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--json", action="store_true", help="print one JSON object only")
        importlib.import_module(module).add_arguments(p)
        p.set_defaults(_bench_module=module)


def run(args: argparse.Namespace) -> int:
    mod = importlib.import_module(args._bench_module)
    result = mod.run(args)
    if args.json:
        print(json.dumps(result, sort_keys=True))
    return 0
