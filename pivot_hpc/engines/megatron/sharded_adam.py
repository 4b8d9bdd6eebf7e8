"""ZeRO-1 for the Megatron engine (`rl.trainer.distributed_optimizer`): AdamW whose fp32
master weights and moments are sharded over data parallelism, one code path on CPU (gloo)
and GPU (NCCL) — megatron's own DistributedOptimizer does not run on CPU (docs/platform.md).

- **Canonical layout.** This rank's parameters (its tensor-parallel shards, the engine's
  parameter order) flattened and concatenated: independent of data parallelism, so a
  range means the same elements whatever the DP size.
- **Owners.** The state is split into near-equal contiguous ranges over the *owners*: the
  replicas of the data-parallel group that hold state (`regroup`). Under megatron's own data
  parallelism that is every replica. With elastic training (`use_data_parallel`) a replica
  that joins through GPS takes no state and owns nothing, so it can leave again without
  handing anything back (runtime/training_world.py): the training set owns all of it, as the
  memory plan sizes it (optimizer / training DP).
- **A step.** After the gradient all-reduce every replica holds the full gradient; each owner
  runs AdamW on its range (the caller clips with the norm of the full gradient), writes the
  range into the model's parameters and broadcasts it to the group (an all-gather: one
  broadcast per owner and parameter piece), so every replica holds the full weights.
- **Re-partitioning.** `regroup` all-gathers what each member holds (range, step) and moves
  ranges point to point to the new owners; a range nobody holds is fresh state only before
  the first step (zero moments, masters from the weights), otherwise an error.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

KINDS = ("master", "exp_avg", "exp_avg_sq")  # the per-element state, all fp32
MOMENTS = KINDS[1:]


def split(total: int, parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous ranges covering [0, total), sizes differing by at most one."""
    return [(total * i // parts, total * (i + 1) // parts) for i in range(parts)]


@dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of parameter `index`, at flat position `at`."""

    index: int
    start: int
    stop: int
    at: int


class FlatLayout:
    """The canonical flat space: parameters (by element count) concatenated in order."""

    def __init__(self, numels: Sequence[int]) -> None:
        self.numels = tuple(int(n) for n in numels)
        self.offsets = [0]
        for n in self.numels:
            self.offsets.append(self.offsets[-1] + n)
        self.total = self.offsets[-1]

    def pieces(self, lo: int, hi: int) -> Iterator[Piece]:
        """The parameter pieces of flat range [lo, hi), in order."""
        i = bisect.bisect_right(self.offsets, lo) - 1
        while lo < hi and i < len(self.numels):
            start, end = self.offsets[i], self.offsets[i + 1]
            a, b = max(lo, start), min(hi, end)
            if a < b:
                yield Piece(i, a - start, b - start, a)
            i += 1

    def first_owner(self, index: int, ranges: Sequence[tuple[int, int]]) -> int:
        """Which of `ranges` holds the first element of parameter `index`."""
        at = self.offsets[index]
        return next(k for k, (lo, hi) in enumerate(ranges) if lo <= at < hi)


@dataclass(frozen=True)
class Owners:
    """Who owns which range: `members[k]` (a rank of `group`) owns `ranges[k]`."""

    group: object | None
    members: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...]

    def global_rank(self, k: int) -> int:
        m = self.members[k]
        return m if self.group is None else dist.get_global_rank(self.group, m)


class ShardedAdam:
    """This rank's part of a sharded AdamW: the state of flat range [lo, hi) (empty: it
    owns nothing) and the owners of the current data-parallel group."""

    def __init__(
        self,
        numels: Sequence[int],
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        device: torch.device,
        masters: bool = True,
    ) -> None:
        """`masters`: keep fp32 master weights (a model that is not fp32); without, AdamW
        steps the fp32 parameters' pieces in place."""
        self.layout = FlatLayout(numels)
        self.kinds = KINDS if masters else MOMENTS
        self.hyper = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        self.device = device
        self.lo = self.hi = 0
        self.state: dict[str, torch.Tensor] | None = None  # KINDS → [hi - lo] fp32; None: none
        self.step_count = 0  # AdamW steps the state belongs to
        self.offloaded = False
        self.saved_owners = 1  # owners that wrote the last checkpoint (`assemble`)
        self.owners = Owners(None, (0,), ((0, self.layout.total),))
        self.me: int | None = 0  # my index in owners.members (None: I own nothing)

    # ------------------------------------------------------------------ state
    @property
    def elements(self) -> int:
        """State elements held here (all kinds): the memory the sharding saves."""
        return 0 if self.state is None else sum(t.numel() for t in self.state.values())

    def _fresh(self, lo: int, hi: int, params: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """State of a range before any step: zero moments, masters from the weights."""
        out = {k: torch.zeros(hi - lo, dtype=torch.float32, device=self.device) for k in MOMENTS}
        if "master" in self.kinds:
            master = torch.empty(hi - lo, dtype=torch.float32, device=self.device)
            for pc in self.layout.pieces(lo, hi):
                src = params[pc.index].detach().reshape(-1)[pc.start : pc.stop]
                master[pc.at - lo : pc.at - lo + pc.stop - pc.start].copy_(src)
            out["master"] = master
        return out

    def own(self, owners: Owners, me: int | None, params: Sequence[torch.Tensor]) -> None:
        """Take `owners` as the layout, with fresh state for my range (construction, or
        before a checkpoint fills it)."""
        self.owners, self.me = owners, me
        self.lo, self.hi = owners.ranges[me] if me is not None else (0, 0)
        self.state = self._fresh(self.lo, self.hi, params) if me is not None else None
        self.offloaded = False

    def hold_full(self, state: dict[str, torch.Tensor], step: int) -> None:
        """Hold the whole flat state (a replica given the canonical state): the next
        `regroup` keeps only what it then owns."""
        self.lo, self.hi = 0, self.layout.total
        self.state = {k: state[k].to(self.device, torch.float32).contiguous() for k in self.kinds}
        self.step_count = step
        self.offloaded = False

    def discard(self, step: int = 0) -> None:
        self.state = None
        self.lo = self.hi = 0
        self.me = None
        self.step_count = step
        self.offloaded = False

    def own_range(self) -> tuple[int, int, int, dict[str, torch.Tensor] | None]:
        """(lo, hi, step, state on the host) of what this rank holds (None: nothing)."""
        state = None
        if self.state is not None:
            state = {k: t.detach().to("cpu", copy=True) for k, t in self.state.items()}
        return self.lo, self.hi, self.step_count, state

    def restore_range(
        self, lo: int, hi: int, step: int, state: dict[str, torch.Tensor] | None
    ) -> None:
        """Hold again what `own_range` returned (a trainer process started anew, given
        what its rank kept of the one that died). The owners stay as they are: the next
        `regroup` (elastic training) agrees them from what every member holds."""
        if state is None:
            self.lo = self.hi = 0
            self.state = self.me = None
        else:
            self.lo, self.hi = lo, hi
            self.state = {
                k: state[k].to(self.device, torch.float32).contiguous() for k in self.kinds
            }
            if (lo, hi) in self.owners.ranges:
                self.me = self.owners.ranges.index((lo, hi))
        self.step_count = step
        self.offloaded = False

    def load_master(self, sources: dict[int, torch.Tensor]) -> None:
        """Masters of my range from full parameter tensors (`sources[index]`)."""
        if self.state is None or "master" not in self.state:
            return
        master = self.state["master"]
        for pc in self.layout.pieces(self.lo, self.hi):
            src = sources[pc.index].reshape(-1)[pc.start : pc.stop]
            master[pc.at - self.lo : pc.at - self.lo + pc.stop - pc.start].copy_(src)

    def offload(self, pin: bool) -> None:
        """State → host memory (pinned and copied asynchronously on a GPU)."""
        if self.offloaded or self.state is None:
            return
        host = {}
        for k, t in self.state.items():
            h = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            h.copy_(t, non_blocking=pin)
            host[k] = h
        if pin:
            torch.cuda.synchronize(self.device)
        self.state = host
        self.offloaded = True

    def reload(self) -> None:
        if not self.offloaded:
            return
        pin = self.device.type == "cuda"
        self.state = {
            k: t.to(self.device, non_blocking=pin, copy=True) for k, t in (self.state or {}).items()
        }
        if pin:
            torch.cuda.synchronize(self.device)  # the pinned sources may be freed now
        self.offloaded = False

    # ------------------------------------------------------------------- step
    def step(
        self,
        params: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
        *,
        lr: float,
        scale: float | None,
    ) -> None:
        """AdamW on my range (grads: the full, reduced gradients; `scale`: the clipping
        factor), written into `params` and broadcast so every replica has all of them."""
        self.reload()
        if self.me is not None:
            if self.state is None:
                raise RuntimeError("sharded optimizer: this replica owns a range it discarded")
            lo = self.lo
            grad = torch.empty(self.hi - lo, dtype=torch.float32, device=self.device)
            for pc in self.layout.pieces(lo, self.hi):
                src = grads[pc.index].reshape(-1)[pc.start : pc.stop]
                grad[pc.at - lo : pc.at - lo + pc.stop - pc.start].copy_(src)
            if scale is not None:
                grad.mul_(scale)
            pieces = list(self.layout.pieces(lo, self.hi))
            cuts = [(pc.at - lo, pc.at - lo + pc.stop - pc.start) for pc in pieces]
            if "master" in self.state:  # one flat fp32 tensor, written to the weights after
                targets, spans = [self.state["master"]], [(0, self.hi - lo)]
            else:  # the fp32 parameters' pieces themselves
                targets = [params[pc.index].detach().view(-1)[pc.start : pc.stop] for pc in pieces]
                spans = cuts
            # torch's own AdamW: the unsharded optimizer's arithmetic, element for element
            opt = torch.optim.AdamW(targets, **{**self.hyper, "lr": lr})
            for t, (a, b) in zip(targets, spans, strict=True):
                t.grad = grad[a:b]
                opt.state[t] = {
                    "step": torch.tensor(float(self.step_count)),
                    **{k: self.state[k][a:b] for k in MOMENTS},
                }
            opt.step()
            for t in targets:
                t.grad = None
            if "master" in self.state:
                master = self.state["master"]
                with torch.no_grad():
                    for pc, (a, b) in zip(pieces, cuts, strict=True):
                        params[pc.index].detach().view(-1)[pc.start : pc.stop].copy_(master[a:b])
        self.step_count += 1
        self.broadcast(params)

    def broadcast(self, params: Sequence[torch.Tensor]) -> None:
        """Every owner's range of the weights to the whole group."""
        o = self.owners
        if o.group is None:
            return
        for k, (lo, hi) in enumerate(o.ranges):
            src = o.global_rank(k)
            for pc in self.layout.pieces(lo, hi):
                view = params[pc.index].detach().view(-1)[pc.start : pc.stop]
                dist.broadcast(view, src=src, group=o.group)

    # -------------------------------------------------------- re-partitioning
    def regroup(
        self, group, size: int, rank: int, params: Sequence[torch.Tensor]
    ) -> tuple[int, int]:
        """Make the owners of `group` (`size` members, mine `rank`) the replicas that hold
        current state and split the flat space over them; collective over the group.
        Returns (owners, elements moved to or from this rank)."""
        self.reload()
        mine = torch.tensor(
            [self.lo, self.hi, self.step_count, int(self.state is not None)],
            dtype=torch.int64,
            device=self.device,
        )
        if size > 1:
            parts = [torch.empty_like(mine) for _ in range(size)]
            dist.all_gather(parts, mine, group=group)
            held = [tuple(int(x) for x in p.tolist()) for p in parts]
        else:
            held = [tuple(int(x) for x in mine.tolist())]
        holding = [m for m, (_, _, _, h) in enumerate(held) if h]
        if not holding:
            raise RuntimeError(
                "sharded optimizer: no replica of this step holds optimizer state (all joined "
                "without it or discarded it)"
            )
        step = max(held[m][2] for m in holding)
        holders = [m for m in holding if held[m][2] == step]  # a stale copy is dropped
        ranges = split(self.layout.total, len(holders))
        plan = []  # (owner k, segment lo, hi, provider member or None = fresh)
        for k, m in enumerate(holders):
            a, b = ranges[k]
            cuts = sorted({a, b} | {x for h in holders for x in held[h][:2] if a < x < b})
            for x, y in itertools.pairwise(cuts):
                covers = [h for h in holders if held[h][0] <= x and y <= held[h][1]]
                provider = m if m in covers else (covers[0] if covers else None)
                if provider is None and step > 0:
                    raise RuntimeError(
                        f"sharded optimizer: elements [{x}, {y}) of the optimizer state at "
                        f"step {step} are held by no replica of this step (a replica that "
                        "owned them left without handing them over)"
                    )
                plan.append((k, x, y, provider))
        owners = Owners(group, tuple(holders), tuple(ranges))
        me = holders.index(rank) if rank in holders else None
        new = None
        if me is not None:
            lo, hi = ranges[me]
            new = {
                k: torch.empty(hi - lo, dtype=torch.float32, device=self.device) for k in self.kinds
            }
        moved = 0
        old, old_lo = self.state, self.lo
        for k, x, y, provider in plan:
            m = holders[k]
            if m != rank and provider != rank:
                continue
            if m == rank:
                lo = ranges[k][0]
                if provider is None:
                    for kind, t in self._fresh(x, y, params).items():
                        new[kind][x - lo : y - lo].copy_(t)
                elif provider == rank:
                    for kind in self.kinds:
                        new[kind][x - lo : y - lo].copy_(old[kind][x - old_lo : y - old_lo])
                else:
                    src = _global(group, provider)
                    for kind in self.kinds:
                        dist.recv(new[kind][x - lo : y - lo], src=src, group=group)
                    moved += len(self.kinds) * (y - x)
            else:  # I provide another owner's segment
                dst = _global(group, m)
                for kind in self.kinds:
                    dist.send(old[kind][x - old_lo : y - old_lo].contiguous(), dst=dst, group=group)
                moved += len(self.kinds) * (y - x)
        self.owners, self.me = owners, me
        self.lo, self.hi = ranges[me] if me is not None else (0, 0)
        self.state = new
        self.step_count = step
        return len(holders), moved

    # ------------------------------------------------------------ whole state
    def gather(self) -> dict[str, torch.Tensor]:
        """The whole flat state of every kind on every member (collective over the group;
        the owners' ranges are disjoint, so a sum of zero-padded ranges is exact)."""
        self.reload()
        out = {}
        for kind in self.kinds:
            full = torch.zeros(self.layout.total, dtype=torch.float32, device=self.device)
            if self.me is not None and self.state is not None:
                full[self.lo : self.hi].copy_(self.state[kind])
            if self.owners.group is not None:
                dist.all_reduce(full, group=self.owners.group)
            out[kind] = full
        return out

    def assemble(self, key: int = 0) -> dict[int, dict[str, torch.Tensor]]:
        """Whole (flat) parameters' state for the parameters whose first element is in my
        range — each parameter on exactly one owner, for a checkpoint that does not depend
        on the partition; pieces move point to point. Collective over the whole world (as a
        checkpoint save is): the owners are agreed there — the holders of the newest state
        among the ranks of flat layout `key` (the tensor-parallel rank) — so a rank left
        with an older layout (an elastic extension that never joined) takes no part."""
        self.reload()
        mine = torch.tensor(
            [key, self.lo, self.hi, self.step_count, int(self.state is not None)],
            dtype=torch.int64,
            device=self.device,
        )
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, mine)
        held = {r: t.tolist() for r, t in enumerate(rows) if t[0] == key and t[4] and t[1] < t[2]}
        if not held:
            raise RuntimeError("sharded optimizer: no rank holds optimizer state to save")
        step = max(h[3] for h in held.values())
        owners = sorted((h[1], h[2], r) for r, h in held.items() if h[3] == step)
        ends = [0, *(hi for _, hi, _ in owners)]
        if [lo for lo, _, _ in owners] != ends[:-1] or ends[-1] != self.layout.total:
            raise RuntimeError(
                f"sharded optimizer: the ranges held at step {step} "
                f"{[(lo, hi) for lo, hi, _ in owners]} do not tile the state"
            )
        ranges = [(lo, hi) for lo, hi, _ in owners]
        ranks = [r for _, _, r in owners]
        self.saved_owners = len(ranks)  # the same on every rank (the checkpoint records it)
        me = dist.get_rank()
        out: dict[int, dict[str, torch.Tensor]] = {}
        if me not in ranks:
            return out
        mine_k, lay = ranks.index(me), self.layout
        for i, n in enumerate(lay.numels):
            if n == 0:
                continue
            start = lay.offsets[i]
            saver = lay.first_owner(i, ranges)
            parts = [
                (k, max(lo, start), min(hi, start + n))
                for k, (lo, hi) in enumerate(ranges)
                if max(lo, start) < min(hi, start + n)
            ]
            if saver == mine_k:
                bufs = {
                    kind: torch.empty(n, dtype=torch.float32, device=self.device)
                    for kind in self.kinds
                }
                for k, a, b in parts:
                    for kind in self.kinds:
                        dst = bufs[kind][a - start : b - start]
                        if k == mine_k:
                            dst.copy_(self.state[kind][a - self.lo : b - self.lo])
                        else:
                            dist.recv(dst, src=ranks[k])
                out[i] = bufs
            elif any(k == mine_k for k, _, _ in parts):
                a, b = next((a, b) for k, a, b in parts if k == mine_k)
                for kind in self.kinds:
                    piece = self.state[kind][a - self.lo : b - self.lo].contiguous()
                    dist.send(piece, dst=ranks[saver])
        return out

    def fill(self, sources: dict[int, dict[str, torch.Tensor]], step: int) -> None:
        """My range from whole parameters' state (`sources[index][kind]`, a checkpoint)."""
        if self.state is None:
            self.step_count = step
            return
        for pc in self.layout.pieces(self.lo, self.hi):
            for kind in self.kinds:
                src = sources[pc.index][kind].reshape(-1)[pc.start : pc.stop]
                self.state[kind][pc.at - self.lo : pc.at - self.lo + pc.stop - pc.start].copy_(src)
        self.step_count = step

    def first_owner_is_me(self, index: int) -> bool:
        """Whether parameter `index` starts in my range (I save its state)."""
        return self.me is not None and self.lo <= self.layout.offsets[index] < self.hi

    def needed(self) -> list[int]:
        """Parameters overlapping my range (what a checkpoint load must read here)."""
        return sorted({pc.index for pc in self.layout.pieces(self.lo, self.hi)})


def _global(group, member: int) -> int:
    return member if group is None else dist.get_global_rank(group, member)
