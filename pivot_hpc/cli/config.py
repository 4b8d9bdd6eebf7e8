"""`pivot-hpc config show CONFIG [overrides] [--json]`: the resolved config, every key with
its documentation, and its default where the value differs.

The output is YAML (documentation in comments) that `pivot-hpc run` accepts as it is.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import yaml


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION")
    sub.required = True
    show = sub.add_parser("show", help="print the resolved config with each key's doc")
    show.add_argument("config", help="YAML run config (e.g. configs/tiny.yaml)")
    show.add_argument("--json", action="store_true", help="a list of {key, value, default, doc}")
    show.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rl.trainer.lr=1e-6")


def _inline(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("\n...")


def run(args: argparse.Namespace) -> int:
    from pivot_hpc.config.docs import entries
    from pivot_hpc.job.config import load_config

    cfg = load_config(args.config, args.overrides)
    rows = entries(cfg)
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "key": e.key,
                        "value": e.value,
                        "default": None if e.default is dataclasses.MISSING else e.default,
                        "doc": e.doc,
                    }
                    for e in rows
                    if not e.section
                ],
                indent=1,
            )
        )
        return 0
    print(f"# {args.config}{' with ' + ' '.join(args.overrides) if args.overrides else ''}")
    for e in rows:
        depth = e.key.count(".")
        name = e.key.rsplit(".", 1)[-1]
        code = f"{'  ' * depth}{name}:" + ("" if e.section else f" {_inline(e.value)}")
        note = e.doc
        if not e.section and e.default is not dataclasses.MISSING and e.value != e.default:
            note = f"{note} [default: {_inline(e.default)}]".strip()
        print(f"{code:<44} # {note}" if note else code)
    return 0
