"""Deployment modes (paper §8.1, App. E, Table 4) as policies over one coordinator.

colocated      every GPU runs rollout for batch s, then reward, then training; staleness 0;
               each stage boundary shifts every GPU (offload/reload, as veRL does).
disaggregated  a static split; stages overlap asynchronously within the staleness bound.
rr_colocated   rollout and reward share one pool that alternates by batch (rollout of s,
               then reward of s); training has its own GPUs and overlaps.
pivot          GPUs shift at run time as the planner decides (strategy pivot, vanilla,
               static or rule; the last two start from the disaggregated split).

A mode sees the coordinator through `mode_api.ModeView`: what it may read and ask.
"""

from __future__ import annotations

from dataclasses import dataclass

from pivot_hpc.config.loader import ConfigError
from pivot_hpc.coordinator.mode_api import ModeView
from pivot_hpc.job.config import Config
from pivot_hpc.planner import Strategy, make_strategy, replica_id
from pivot_hpc.planner.snapshot import INFERENCE_ROLES, TRAINING, Topology


def slots_within(topology: Topology, role: str, gpus: set[int]) -> list[str]:
    spec = topology.roles[role]
    return [replica_id(role, s) for s, g in sorted(spec.slots.items()) if set(g) <= gpus]


@dataclass
class Split:
    """Static GPU ranges: rollout, reward (inference) and the training set."""

    rollout: set[int]
    reward: set[int]


class Colocated:
    name = "colocated"

    def __init__(self) -> None:
        self.stage = "rollout"
        self.everything: set[int] = set()
        self.trained_to = 0

    def may_release(self, c: ModeView, step: int) -> bool:
        return True  # staleness 0 already serialises the batches

    def start(self, c: ModeView) -> None:
        self.everything = set(range(c.topology.num_gpus))
        self.trained_to = c.rl.version
        c.request_up(slots_within(c.topology, "rollout", self.everything))

    def on_tick(self, c: ModeView) -> None:
        pass

    def on_change(self, c: ModeView) -> None:
        if not c.settled():
            return
        ro, rm = c.schedulers["rollout"], c.schedulers["reward"]
        step = c.rl.version
        if self.stage == "rollout" and ro.n_seq == 0 and c.rl.rolled_out(step):
            self.stage = "reward"
            c.take_down(list(ro.replicas))
            c.request_up(slots_within(c.topology, "reward", self.everything))
        elif self.stage == "reward" and rm.n_seq == 0 and c.rl.awaits_rollout(step):
            self.stage = "rollout"  # dynamic sampling drew fresh prompts: roll them out
            c.take_down(list(rm.replicas))
            c.request_up(slots_within(c.topology, "rollout", self.everything))
        elif self.stage == "reward" and c.rl.batch_ready():
            self.stage = "train"
            self.trained_to = c.rl.version + 1
            c.take_down(list(rm.replicas))
            c.request_up([TRAINING])
        elif self.stage == "train" and c.rl.version >= self.trained_to and not c.rl.done:
            self.stage = "rollout"
            c.take_down([TRAINING])
            c.request_up(slots_within(c.topology, "rollout", self.everything))


class Disaggregated:
    name = "disaggregated"

    def __init__(self, split: Split) -> None:
        self.split = split

    def may_release(self, c: ModeView, step: int) -> bool:
        return True

    def start(self, c: ModeView) -> None:
        c.request_up(slots_within(c.topology, "rollout", self.split.rollout))
        c.request_up(slots_within(c.topology, "reward", self.split.reward))
        c.request_up([TRAINING])

    def on_tick(self, c: ModeView) -> None:
        pass

    def on_change(self, c: ModeView) -> None:
        pass


class RolloutRewardColocated:
    name = "rr_colocated"

    def __init__(self, pool: set[int]) -> None:
        self.pool = pool
        self.phase = "rollout"
        self.batch = 0

    def may_release(self, c: ModeView, step: int) -> bool:
        return step <= self.batch  # the pool rolls out one batch at a time

    def start(self, c: ModeView) -> None:
        # A resumed run continues with its oldest batch whose rewards are incomplete.
        self.batch = c.rl.oldest_unrewarded()
        c.request_up(slots_within(c.topology, "rollout", self.pool))
        c.request_up([TRAINING])

    def on_tick(self, c: ModeView) -> None:
        pass

    def on_change(self, c: ModeView) -> None:
        if not c.settled():
            return
        b = self.batch
        ro, rm = c.schedulers["rollout"], c.schedulers["reward"]
        if self.phase == "rollout" and c.rl.rolled_out(b):
            self.phase = "reward"
            c.take_down(list(ro.replicas))
            c.request_up(slots_within(c.topology, "reward", self.pool))
        elif self.phase == "reward" and rm.n_seq == 0 and c.rl.awaits_rollout(b):
            self.phase = "rollout"  # dynamic sampling drew fresh prompts: roll them out
            c.take_down(list(rm.replicas))
            c.request_up(slots_within(c.topology, "rollout", self.pool))
        elif self.phase == "reward":
            if c.rl.rewarded(b):
                if b + 1 >= c.rl.steps:
                    self.phase = "done"
                    return
                if c.rl.can_release() or b + 1 < c.rl.released:
                    self.batch = b + 1
                    self.phase = "rollout"
                    c.take_down(list(rm.replicas))
                    c.request_up(slots_within(c.topology, "rollout", self.pool))
                    c.release()


def stall_cues(c: ModeView) -> frozenset[str]:
    """Where GPUs idle while there is work they could take, until the planner acts: a
    training batch waiting for its GPUs (lent out), or a role with sequences while
    replicas of the other role, or training's GPUs, run nothing. (While every GPU is
    busy there is no stall, even for a role with no replica: the next interval weighs it;
    so a phase's first finishes do not pull running sequences around.)"""
    cues = {"training batch waits"} if c.training_waits() else set()
    idle = {r for r in INFERENCE_ROLES if c.schedulers[r].n_idle_replicas}
    if c.training_idle():
        idle.add(TRAINING)
    for role in INFERENCE_ROLES:
        if c.schedulers[role].n_seq:
            cues |= {f"{role} has work, {src} idle" for src in idle if src != role}
    return frozenset(cues)


class Shifting:
    """pivot mode: the planner decides every `interval` seconds, one plan at a time; a
    strategy that reacts (pivot+) also plans as soon as a new stall appears."""

    name = "pivot"

    def __init__(self, strategy: Strategy, interval_s: float, split: Split | None) -> None:
        self.strategy = strategy
        self.interval_s = interval_s
        self.split = split  # static/rule start from the disaggregated split
        self.next_plan = 0.0
        # the stall cues a reactive plan last answered: each new stall is planned for
        # once, then it waits for the interval like any other state
        self.answered: frozenset[str] = frozenset()

    def may_release(self, c: ModeView, step: int) -> bool:
        return True

    def start(self, c: ModeView) -> None:
        if self.split is None:  # §8.3: PivotRL starts with every GPU rolling out
            c.request_up(slots_within(c.topology, "rollout", set(range(c.topology.num_gpus))))
        else:
            c.request_up(slots_within(c.topology, "rollout", self.split.rollout))
            c.request_up(slots_within(c.topology, "reward", self.split.reward))
            c.request_up([TRAINING])

    def on_change(self, c: ModeView) -> None:
        if not self.strategy.react:
            return
        cues = stall_cues(c)
        if not c.settled():  # a shift in flight: plan once it is done, if the stall remains
            self.answered &= cues
            return
        if cues - self.answered:
            self._plan(c)
        self.answered = cues

    def on_tick(self, c: ModeView) -> None:
        if c.cluster.now() >= self.next_plan and c.settled():
            self._plan(c)

    def _plan(self, c: ModeView) -> None:
        self.next_plan = c.cluster.now() + self.interval_s
        c.execute(self.strategy.plan(c.snapshot()))


def static_split(cfg: Config, training: list[int]) -> Split:
    """Rollout and reward GPU ranges of the static split (disaggregated; static/rule start)."""
    n = cfg.cluster.total_gpus
    free = [g for g in range(n) if g not in set(training)]
    d = cfg.deployment
    ro_tp, rm_tp = cfg.rollout.tp, cfg.reward.tp
    align = max(ro_tp, rm_tp)  # keep the reward range on its tp boundaries
    if d.rollout_gpus is None and d.reward_gpus is None:
        half = len(free) // 2
        ro = half - half % align
        rm = (len(free) - ro) - (len(free) - ro) % rm_tp
    else:
        ro = d.rollout_gpus if d.rollout_gpus is not None else 0
        rm = d.reward_gpus if d.reward_gpus is not None else len(free) - ro
    for key, v, tp in (("rollout_gpus", ro, ro_tp), ("reward_gpus", rm, rm_tp)):
        if v < 0 or v % tp:
            raise ConfigError(f"config key 'deployment.{key}' = {v}: must be a multiple of tp={tp}")
    if ro + rm > len(free):
        raise ConfigError(
            f"config key 'deployment.rollout_gpus' + 'deployment.reward_gpus' = {ro + rm}: only "
            f"{len(free)} GPUs are left after training's {len(training)}"
        )
    split = Split(rollout=set(free[:ro]), reward=set(free[ro : ro + rm]))
    for role, gpus, tp in (("rollout", split.rollout, ro_tp), ("reward", split.reward, rm_tp)):
        aligned = {g for g in gpus if all(h in gpus for h in range(g - g % tp, g - g % tp + tp))}
        if aligned != gpus:
            raise ConfigError(
                f"config key 'deployment.{role}_gpus': GPUs {sorted(gpus)} do not split into "
                f"aligned groups of tp={tp}; make rollout_gpus a multiple of {align}"
            )
    return split


def make_mode(cfg: Config, training: list[int]):
    """The deployment mode object named by `deployment.mode` (and `planner.strategy`)."""
    n = cfg.cluster.total_gpus
    name = cfg.deployment.mode
    if name == "colocated":
        return Colocated()
    if name == "disaggregated":
        return Disaggregated(static_split(cfg, training))
    if name == "rr_colocated":
        return RolloutRewardColocated({g for g in range(n) if g not in set(training)})
    strategy = cfg.planner.strategy
    split = static_split(cfg, training) if strategy in ("static", "rule") else None
    return Shifting(make_strategy(cfg.planner), cfg.planner.interval_s, split)
