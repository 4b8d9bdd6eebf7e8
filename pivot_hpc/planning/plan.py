"""The whole memory plan of a config, the knob that fixes a role, and the pre-launch check.

Roles: rollout, reward, training (one GPU of each at its peak) and `shift`: the worst
moment on a GPU that both trains and serves (colocated and pivot modes), when one role's
memory is still there while the other runs. Node: GPS host memory, pinned buffers,
Read staging, and each role's Read time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from pivot_hpc.errors import PivotError
from pivot_hpc.job.config import Config
from pivot_hpc.planning.host import NodeMemory, node_memory
from pivot_hpc.planning.inputs import GIB, PlanInputs, live_inputs
from pivot_hpc.planning.memory import (
    RoleMemory,
    engine_residual,
    inference_memory,
    score_buffer,
    training_context,
    training_memory,
)

ROLES = ("rollout", "reward", "training", "shift")


class MemoryPlanError(PivotError, ValueError):
    """The config does not fit its GPUs (or its GPS host budget): one line, with the fix."""


@dataclass
class Fix:
    overrides: tuple[str, ...]  # dotted key=value, as `pivot-hpc run` takes them
    total: float  # the role's bytes with the fix


@dataclass
class Plan:
    inputs: PlanInputs
    roles: dict[str, RoleMemory | None]
    node: NodeMemory
    fixes: dict[str, Fix | None]

    @property
    def fits(self) -> bool | None:
        """False when a role (or the GPS budget, when known) does not fit; None when the
        GPU's memory is unknown; True otherwise (an unknown GPS budget is not checked)."""
        if self.failures():
            return False
        verdicts = [r.fits for r in self.roles.values() if r is not None]
        return None if None in verdicts else True

    def failures(self) -> list[str]:
        out = [name for name, r in self.roles.items() if r is not None and r.fits is False]
        return out + (["node"] if self.node.fits is False else [])


# --------------------------------------------------------------------- the roles
def role_memories(p: PlanInputs) -> dict[str, RoleMemory | None]:
    cap = p.capacity_gib * GIB if p.capacity_gib is not None else None
    out: dict[str, RoleMemory | None] = {
        "rollout": inference_memory(p.rollout, cap),
        "reward": inference_memory(p.reward, cap),
        "training": training_memory(p.training, cap),
        "shift": None,
    }
    if p.shift_roles:
        t = p.training
        trained = training_context(t) + score_buffer(t)
        candidates = []
        for role in p.shift_roles:
            e = getattr(p, role)
            candidates.append(
                inference_memory(
                    e,
                    cap,
                    resident=trained,
                    role="shift",
                    detail=f"{role} engine beside the shifted-down trainer's context",
                )
            )
            candidates.append(
                training_memory(
                    t,
                    cap,
                    resident=engine_residual(e),
                    role="shift",
                    detail=f"training beside the released {role} engine's context",
                )
            )
        # the worst moment: one that does not fit, else the largest
        out["shift"] = max(candidates, key=lambda r: (r.fits is False, r.total))
    return out


def build_plan(p: PlanInputs, *, with_fixes: bool = True) -> Plan:
    roles = role_memories(p)
    plan = Plan(p, roles, node_memory(p), {})
    if with_fixes and p.source == "live":
        for name in plan.failures():
            plan.fixes[name] = find_fix(p, name)
    return plan


# ------------------------------------------------------------------------ fixes
Change = tuple[str, Callable[[PlanInputs], PlanInputs]]


def _train(p: PlanInputs, **kw) -> PlanInputs:
    return dataclasses.replace(p, training=dataclasses.replace(p.training, **kw))


def _engine(p: PlanInputs, role: str, **kw) -> PlanInputs:
    return dataclasses.replace(p, **{role: dataclasses.replace(getattr(p, role), **kw)})


def _training_changes(p: PlanInputs) -> list[Change]:
    t = p.training
    out: list[Change] = []
    if t.attention == "local":
        out.append(("rl.trainer.attention=sdpa", lambda q: _train(q, attention="sdpa")))
    if t.recompute != "full":
        out.append(("rl.trainer.recompute=full", lambda q: _train(q, recompute="full")))
    if not t.distributed_optimizer and t.dp > 1:
        out.append(
            (
                "rl.trainer.distributed_optimizer=true",
                lambda q: _train(q, distributed_optimizer=True),
            )
        )
    if t.micro_batch > 1:
        out.append(("rl.trainer.micro_batch_size=1", lambda q: _train(q, micro_batch=1)))
    tp = t.tp * 2
    while tp <= p.gpus_per_node and t.model.heads % tp == 0 and t.gpus % tp == 0:
        out.append((f"rl.trainer.tp={tp}", lambda q, tp=tp: _train(q, tp=tp)))
        tp *= 2
    return out


def _engine_changes(p: PlanInputs, role: str, r: RoleMemory) -> list[Change]:
    e = getattr(p, role)
    out: list[Change] = []
    key = f"engines.{role}.mem_fraction_static"
    cap = p.capacity_gib * GIB if p.capacity_gib else 0.0
    if r.problem == "total" and cap and e.engine == "sglang":
        # leave the engine's activations, graphs and what else is resident outside it
        outside = r.total - (r.static_budget or r.total) + 1.0 * GIB
        f = int((1.0 - outside / cap) * 100) / 100
        if 0.05 <= f < (e.mem_fraction_static or 1.0):
            out.append((f"{key}={f:.2f}", lambda q, f=f: _engine(q, role, mem_fraction_static=f)))
    if r.problem == "pool" and e.engine == "sglang":
        f = e.mem_fraction_static
        if f is not None and f < 0.9:
            out.append((f"{key}=0.90", lambda q: _engine(q, role, mem_fraction_static=0.9)))
    tp = e.tp * 2
    while tp <= p.gpus_per_node and p.gpus_per_node % tp == 0:
        out.append((f"{role}.tp={tp}", lambda q, tp=tp: _engine(q, role, tp=tp)))
        tp *= 2
    if r.problem == "total" and r.kv_tokens and r.capacity:
        # fewer KV tokens, by the excess
        per_token = r.kv / max(r.kv_tokens, 1)
        tokens = int((r.kv - (r.total - r.capacity) - 1.0 * GIB) / per_token) if per_token else 0
        if 0 < tokens < e.kv_capacity_tokens:
            out.append(
                (
                    f"{role}.kv_capacity_tokens={tokens}",
                    lambda q, n=tokens: _engine(q, role, kv_capacity_tokens=n),
                )
            )
    return out


def _role_after(p: PlanInputs, name: str) -> RoleMemory | None:
    return role_memories(p)[name]


def find_fix(p: PlanInputs, name: str) -> Fix | None:
    """The first knob (cheapest first) that makes role `name` fit, else the shortest
    cumulative run of them that does; None when nothing in reach does."""
    r = role_memories(p).get(name)
    if r is None:  # (the node's GPS budget has its own fix in the refusal line)
        return None
    if name == "training":
        changes = _training_changes(p)
    elif name in ("rollout", "reward"):
        changes = _engine_changes(p, name, r)
    else:  # shift: what keeps each side small
        changes = _training_changes(p)
        for role in p.shift_roles:
            changes += _engine_changes(p, role, r)
    for text, change in changes:
        after = _role_after(change(p), name)
        if after is not None and after.fits:
            return Fix((text,), after.total)
    q, applied = p, []
    for text, change in changes:
        q = change(q)
        applied.append(text)
        after = _role_after(q, name)
        if after is not None and after.fits:
            return Fix(tuple(applied), after.total)
    return None


# ------------------------------------------------------------------ the check
def _gib(x: float) -> str:
    return f"{x / GIB:.1f} GiB"


def refusal(plan: Plan) -> str | None:
    """The one-line refusal of a plan that does not fit (None when it fits or cannot
    be checked)."""
    p = plan.inputs
    gpu = (p.gpu or "GPU").upper()
    for name in plan.failures():
        if name == "node":
            n = plan.node
            return (
                f"memory plan: GPS needs {_gib(n.gps)} of host memory per node even in groups "
                f"of {n.group_size} node(s), over gps.host_budget_gib = {_gib(n.budget or 0)}; "
                "raise gps.host_budget_gib or add nodes (cluster.nodes)"
            )
        r = plan.roles[name]
        assert r is not None
        what = f"{name} ({r.detail})" if r.detail else name
        if r.problem == "pool":
            head = (
                f"memory plan: {what} needs {_gib(r.need)} per GPU for its weights, context "
                f"and one {r.seq_len}-token sequence's KV, but SGLang's static share is "
                f"{_gib(r.have)} "
                f"(mem_fraction_static × {_gib(r.capacity or 0)} of the {gpu})"
            )
        else:
            parts = [
                f"{k} {v / GIB:.1f}"
                for k, v in (
                    ("weights", r.weights),
                    ("grads", r.grads),
                    ("optimizer", r.optimizer),
                    ("activations", r.activations),
                    ("attention", r.attention),
                    ("kv", r.kv),
                    ("resident", r.resident),
                    ("context/reserve", r.context + r.temporaries),
                )
                if v >= 0.05 * GIB
            ]
            head = (
                f"memory plan: {what} needs {_gib(r.need)} per GPU, the {gpu} has "
                f"{_gib(r.have)} ({', '.join(parts)} GiB)"
            )
        fix = plan.fixes.get(name)
        if fix is not None:
            tail = f"; fix: {' '.join(fix.overrides)} (→ {_gib(fix.total)})"
        else:
            tail = "; no single knob fits it: more GPUs per replica, shorter sequences"
        others = [n for n in plan.failures() if n != name]
        also = f"; also too big: {', '.join(others)}" if others else ""
        return head + tail + also + " — details: pivot-hpc plan CONFIG"
    return None


def check_memory(cfg: Config) -> None:
    """Refuse, in one line and before anything starts, a config whose plan does not fit
    its GPUs (only when the config names its GPU: cluster.gpu or cluster.gpu_memory_gib)."""
    if cfg.cluster.gpu is None and not cfg.cluster.gpu_memory_gib:
        return
    line = refusal(build_plan(live_inputs(cfg)))
    if line is not None:
        raise MemoryPlanError(line)
