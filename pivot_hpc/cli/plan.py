"""`pivot-hpc plan CONFIG [overrides] [--json]`: will it fit, before anything starts.

Per GPU and role (rollout, reward, training, and the shift moment when one role's memory
is still there while the other runs): weights, gradients, optimizer state, activations,
attention workspace, KV cache, context and reserves, against the GPU's memory; per node:
GPS host memory (full replication vs groups of k nodes, paper App. B.1), pinned buffers,
Read staging, and each role's shift-up Read time. See docs/guide/plan.md.

The plan is arithmetic over the config: model directories and data files need not exist
here (a catalog model is recognised by its directory name).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from pivot_hpc.config import from_dict, validate_tree
from pivot_hpc.config.loader import apply_overrides, load_yaml, migrate_moved
from pivot_hpc.job.config import Config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML run config (configs/groups/*.yaml, configs/tiny.yaml, …)")
    p.add_argument("--json", action="store_true", help="the plan as JSON (keys per role)")
    p.add_argument(
        "--source",
        choices=("auto", "live", "sim"),
        default="auto",
        help="live: as `pivot-hpc run` launches it; sim: the simulator's twin (models and "
        "hardware of its sim: section); auto: sim when the file has a sim: section and no "
        "model directories",
    )
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rl.trainer.recompute=full")


def load_for_plan(path: str, overrides: list[str]) -> tuple[Config, dict]:
    """The config with every rule checked except that its files exist (model directories,
    datasets): a plan is made anywhere. Also returns the raw data (after overrides)."""
    data = load_yaml(path)
    migrate_moved(data, Config)
    apply_overrides(data, overrides, root=Config)
    cfg = from_dict(Config, data)
    probe = dataclasses.replace(
        cfg,
        models=dataclasses.replace(cfg.models, policy_path=None, genrm_path=None),
        rl=dataclasses.replace(
            cfg.rl,
            data=dataclasses.replace(cfg.rl.data, train="synthetic", validation="synthetic"),
        ),
    )
    validate_tree(probe)
    return cfg, data


def make_plan(cfg: Config, data: dict, source: str = "auto"):
    from pivot_hpc.planning import build_plan
    from pivot_hpc.planning.inputs import live_inputs, sim_inputs

    if source == "auto":
        live_models = cfg.models.policy_path is not None or cfg.models.genrm_path is not None
        source = "sim" if "sim" in data and not live_models else "live"
    inputs = sim_inputs(cfg) if source == "sim" else live_inputs(cfg)
    return build_plan(inputs)


# ------------------------------------------------------------------------- output
def _g(x: float | None) -> float | None:
    return None if x is None else round(x / (1 << 30), 6)


def role_json(r) -> dict[str, Any] | None:
    if r is None:
        return None
    out = {
        "model": r.model,
        "tp": r.tp,
        "weights_gib": _g(r.weights),
        "grads_gib": _g(r.grads),
        "optimizer_gib": _g(r.optimizer),
        "activations_gib": _g(r.activations),
        "attention_gib": _g(r.attention),
        "kv_gib": _g(r.kv),
        "kv_tokens": r.kv_tokens,
        "temporaries_gib": _g(r.temporaries),
        "context_gib": _g(r.context),
        "resident_gib": _g(r.resident),
        "total_gib": _g(r.total),
        "capacity_gib": _g(r.capacity),
        "fits": r.fits,
        "seq_len": r.seq_len,
        "detail": r.detail,
    }
    for k, v in r.extras.items():
        out[k] = {kk: round(vv, 3) for kk, vv in v.items()} if isinstance(v, dict) else round(v, 3)
    return out


def plan_json(plan, config: str) -> dict[str, Any]:
    from pivot_hpc.planning.plan import refusal

    p, n = plan.inputs, plan.node
    return {
        "config": config,
        "source": p.source,
        "gpu": p.gpu,
        "capacity_gib": p.capacity_gib,
        "mode": p.mode,
        "fits": plan.fits,
        "roles": {name: role_json(r) for name, r in plan.roles.items()},
        "node": {
            "group_size": n.group_size,
            "gps_replicated_gib": _g(n.gps_replicated),
            "gps_gib": _g(n.gps),
            "gps_by_group_size_gib": {str(k): _g(v) for k, v in n.by_group_size.items()},
            "gps_budget_gib": _g(n.budget),
            "pinned_gib": _g(n.pinned),
            "read_staging_gib": _g(n.staging),
            "total_gib": _g(n.total),
            "fits": n.fits,
            "reads": {
                role: {
                    "gib_per_reader": _g(r.bytes_per_reader),
                    "readers_per_node": r.readers_per_node,
                    "read_s": round(r.seconds, 3),
                    "node_read_s": None if r.node_seconds is None else round(r.node_seconds, 3),
                }
                for role, r in n.reads.items()
            },
        },
        "fixes": {
            name: {"overrides": list(f.overrides), "total_gib": _g(f.total)}
            for name, f in plan.fixes.items()
            if f is not None
        },
        "refusal": refusal(plan),
    }


def _cell(x: float) -> str:
    return "-" if abs(x) < 0.005 * (1 << 30) else f"{x / (1 << 30):.1f}"


def plan_table(plan, config: str) -> str:
    p, n = plan.inputs, plan.node
    gib = 1 << 30
    where = (
        f"{p.gpu.upper() if p.gpu else 'GPU'} {p.capacity_gib:.1f} GiB"
        if p.capacity_gib is not None
        else "GPU memory unknown: set cluster.gpu or cluster.gpu_memory_gib to check"
    )
    lines = [f"memory plan of {config} ({p.source}, mode {p.mode}; {where})"]
    head = ("GiB per GPU", "model", "tp", "weights", "grads", "optim", "activ", "attn", "kv")
    head += ("other", "total", "fits")
    fmt = "{:<12} {:<18} {:>3} {:>8} {:>6} {:>6} {:>6} {:>6} {:>6} {:>6} {:>7} {:>5}"
    lines.append(fmt.format(*head))
    for name, r in plan.roles.items():
        if r is None:
            lines.append(f"{name:<12} (no GPU both trains and serves in mode {p.mode})")
            continue
        fits = {True: "yes", False: "NO", None: "?"}[r.fits]
        lines.append(
            fmt.format(
                name,
                r.model[:18],
                r.tp,
                _cell(r.weights),
                _cell(r.grads),
                _cell(r.optimizer),
                _cell(r.activations),
                _cell(r.attention),
                _cell(r.kv),
                _cell(r.context + r.temporaries + r.resident),
                _cell(r.total),
                fits,
            )
        )
    t = plan.roles["training"]
    tr = p.training
    if t is not None:
        by = t.extras["activations_by_recompute_gib"]
        opt = t.extras["optimizer_by_kind_gib"]
        lines.append(
            f"training: {tr.seq_len}-token sequences x micro-batch {tr.micro_batch}, "
            f"attention {tr.attention}, recompute {tr.recompute}, dp {tr.dp}; activations + "
            f"attention by recompute: none {by['none']:.1f} / selective {by['selective']:.1f}"
            f" / full {by['full']:.1f} GiB; optimizer plain {opt['plain']:.1f} / "
            f"distributed {opt['distributed']:.1f} GiB"
        )
    for role in ("rollout", "reward"):
        r = plan.roles[role]
        e = getattr(p, role)
        if r is None:
            continue
        f = r.extras.get("mem_fraction_static")
        frac = f", mem_fraction_static {f:.2f}" if f is not None else ""
        lines.append(
            f"{role}: {e.engine}, KV pool {r.kv_tokens} tokens (asked {e.kv_capacity_tokens}) "
            f"for {e.max_seq_len}-token sequences{frac}"
        )
    s = plan.roles["shift"]
    if s is not None:
        lines.append(f"shift: {s.detail} ({s.resident / gib:.1f} GiB of it still there)")
    groups = ", ".join(f"k={k} {v / gib:.1f}" for k, v in n.by_group_size.items() if k > 1)
    budget = (
        f"budget {n.budget / gib:.1f} GiB (gps.host_budget_gib)"
        if n.budget is not None
        else "budget: half the node's RAM at run time (set gps.host_budget_gib to check here)"
    )
    lines.append(
        f"per node (host): GPS {n.gps_replicated / gib:.1f} GiB fully replicated"
        f"{f' (groups: {groups})' if groups else ''}, k={n.group_size} -> {n.gps / gib:.1f} GiB; "
        f"{budget}; pinned optimizer offload {n.pinned / gib:.1f} GiB; Read staging up to "
        f"{n.staging / gib:.1f} GiB"
    )
    reads = []
    for role, r in n.reads.items():
        node = (
            f", {r.node_seconds:.1f} s all {r.readers_per_node} of a node" if r.node_seconds else ""
        )
        reads.append(f"{role} {r.bytes_per_reader / gib:.1f} GiB: {r.seconds:.1f} s alone{node}")
    lines.append("Read at shift up (per reader): " + "; ".join(reads))
    from pivot_hpc.planning.plan import refusal

    line = refusal(plan)
    if line is not None:
        lines.append(f"DOES NOT FIT: {line.removeprefix('memory plan: ')}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    cfg, data = load_for_plan(args.config, list(args.overrides or []))
    from pivot_hpc.models.role_check import check_model_dirs

    # a plan is made anywhere: the directories on this machine are checked for their roles
    check_model_dirs(cfg, existing_only=True)
    plan = make_plan(cfg, data, args.source)
    if args.json:
        print(json.dumps(plan_json(plan, args.config), indent=1))
    else:
        print(plan_table(plan, args.config))
    return 1 if plan.fits is False else 0
