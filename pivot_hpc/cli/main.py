"""`pivot-hpc` / `python -m pivot_hpc`: the command-line entry point.

Subcommands live in their own modules and are imported only when used, so `pivot-hpc
bench planner` does not pay for torch or MPI imports. Add one by listing it in COMMANDS:
the module must define `add_arguments(parser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from pivot_hpc import __version__
from pivot_hpc.errors import PivotError

COMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("pivot_hpc.cli.bench", "benchmarks of pivot_hpc's own parts (JSON with --json)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pivot-hpc",
        description="Slurm-native RL post-training with generative rewards and GPU role shifting.",
    )
    parser.add_argument("--version", action="version", version=f"pivot-hpc {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod = importlib.import_module(module)
        mod.add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    mod = importlib.import_module(args._module)
    try:
        return int(mod.run(args) or 0)
    except PivotError as exc:
        print(f"pivot-hpc: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
