"""`pivot-hpc report DIR [--json]`: summarise a run directory's telemetry.

Definitions of every number are in pivot_hpc/telemetry/summary.py and analysis/README.md.
"""

from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", metavar="DIR", help="run directory (holds telemetry/alloc-*.h5)")
    parser.add_argument("--json", action="store_true", help="print one JSON object only")


def run(args: argparse.Namespace) -> int:
    # Imported here: `pivot-hpc --help` should not pay for h5py.
    from pivot_hpc.telemetry import open_run
    from pivot_hpc.telemetry.summary import format_summary, summarise

    summary = summarise(open_run(args.dir))
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    else:
        print(format_summary(summary))
    return 0
