"""`pivot-hpc` / `python -m pivot_hpc`: the command-line entry point.

Subcommands live in their own modules and are imported only when used, so `pivot-hpc
bench planner` does not pay for torch or MPI imports. Add one by listing it in COMMANDS:
the module must define `add_arguments(parser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys

from pivot_hpc import __version__
from pivot_hpc.errors import PivotError

OVERRIDE = re.compile(r"^[A-Za-z_][\w.]*=")

COMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("pivot_hpc.cli.bench", "benchmarks of pivot_hpc's own parts (JSON with --json)"),
    "profile": ("pivot_hpc.cli.profile", "fit the throughput model (A, B, C, D) of an engine"),
    "run": ("pivot_hpc.cli.run", "the main job: RL post-training in one MPI world"),
    "simulate": ("pivot_hpc.cli.simulate", "run a deployment on a simulated cluster"),
    "calibration": (
        "pivot_hpc.cli.calibration",
        "the simulator's calibration table: every cost with its source",
    ),
    "report": ("pivot_hpc.cli.report", "summarise a run directory's telemetry"),
    "config": ("pivot_hpc.cli.config", "show a resolved config with every key's documentation"),
    "plan": ("pivot_hpc.cli.plan", "will it fit: memory per GPU and role, host memory per node"),
    "trace": ("pivot_hpc.cli.trace", "write a run's telemetry as a Perfetto/Chrome trace"),
    "submit": ("pivot_hpc.cli.submit", "submit the main job to Slurm (submitit; requeues itself)"),
    "export": (
        "pivot_hpc.cli.export",
        "a checkpoint's policy as a Hugging Face directory (transformers, vLLM)",
    ),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser; with `only`, just that subcommand's module is imported (fast, robust)."""
    parser = argparse.ArgumentParser(
        prog="pivot-hpc",
        description="Slurm-native RL post-training with generative rewards and GPU role shifting.",
    )
    parser.add_argument("--version", action="version", version=f"pivot-hpc {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == only:
            importlib.import_module(module).add_arguments(p)
            p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    only = argv[0] if argv and argv[0] in COMMANDS else None
    parser = build_parser(only)
    # Dotted overrides (`planner.horizon_s=120`) may stand anywhere after the command.
    args, extra = parser.parse_known_args(argv)
    mod = importlib.import_module(args._module)
    if extra:
        bad = [a for a in extra if not OVERRIDE.match(a)]
        if bad or not hasattr(args, "overrides"):
            parser.error(f"unrecognized arguments: {' '.join(bad or extra)}")
        args.overrides = list(args.overrides or []) + extra
    try:
        return int(mod.run(args) or 0)
    except PivotError as exc:
        print(f"pivot-hpc: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `pivot-hpc … | head`: the reader left; that is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
