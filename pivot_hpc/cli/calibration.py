"""`pivot-hpc calibration [--hardware H] [--json]`: the simulator's calibration table.

Prints the per-hardware factors (each with its source), every catalog (model, tp) pair's
A, B, C, D, KV capacity, prefill and shift times with the provenance of each, and the
catalog's predictions next to the engine-level measurements it was calibrated on.
"""

from __future__ import annotations

import argparse
import json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hardware", default="h20", choices=["h20", "h100", "h200"])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--sources", action="store_true", help="show each pair value's provenance")


def _fmt(v: float) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def run(args: argparse.Namespace) -> int:
    from pivot_hpc.sim.table import table

    t = table(args.hardware)
    if args.json:
        print(json.dumps(t, sort_keys=True))
        return 0
    print(f"calibration for {args.hardware}: factors")
    for f in t["factors"]:
        print(f"  {f['name']:<34} {_fmt(f['value']):>10}  {f['source']}")
    print("\npairs (scheduler A-D fitted to the engine; s, tokens)")
    cols = ["A", "B", "C", "D", "kv_capacity_tokens", "max_running", "prefill_s_per_token"]
    cols += ["shift_up.read_s", "shift_up.reload_s", "shift_down.discard_s"]
    print("  " + " ".join(f"{c:>12}" for c in ["model", "tp", *cols]))
    for row in t["pairs"]:
        v = row["values"]
        cells = [row["model"][:12], str(row["tp"])] + [_fmt(v[c]) for c in cols]
        print("  " + " ".join(f"{c:>12}" for c in cells))
        if args.sources:
            for key, src in row["sources"].items():
                print(f"      {key}: {src}")
    print("\nchecks: per-iteration latency predicted vs measured (fit: a calibration input;")
    print("held out: an out-of-sample check, its miss reported, never fitted)")
    for c in t["checks"]:
        kind = "fit" if c["fitted"] else "held out"
        print(
            f"  {c['name']:<30} {kind:<8} {c['predicted_s'] * 1e3:7.2f} ms vs "
            f"{c['measured_s'] * 1e3:7.2f} ms  ({c['ratio']:.2f}x)  {c['source']}"
        )
    print("\nreferences")
    for k, v in t["references"].items():
        print(f"  [{k}] {v}")
    return 0
