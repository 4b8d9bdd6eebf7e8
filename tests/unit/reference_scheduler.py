"""A plain-Python reference of Alg. 2–4 (paper App. C), written for clarity, not speed.

The production scheduler runs compiled loops over arrays; tests compare its decisions
with this straightforward version (brute-force argmax over `ThroughputModel.gain`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pivot_hpc.scheduler import ThroughputModel


@dataclass
class RefReplica:
    rid: str
    capacity: int
    model: ThroughputModel
    seqs: dict[int, int] = field(default_factory=dict)  # seq_id -> length

    @property
    def n(self) -> int:
        return len(self.seqs)

    @property
    def tok(self) -> int:
        return sum(self.seqs.values())

    @property
    def T(self) -> float:
        return self.model.throughput(self.n, self.tok)


class RefScheduler:
    def __init__(self) -> None:
        self.replicas: list[RefReplica] = []  # insertion order
        self.queue: dict[int, int] = {}  # seq_id -> length; priority: ascending id

    def add(self, rid: str, capacity: int, model: ThroughputModel) -> None:
        self.replicas.append(RefReplica(rid, capacity, model))

    def best(self, length: int, among: list[RefReplica]) -> RefReplica | None:
        best, best_gain = None, 0.0
        for r in among:
            if r.tok + length > r.capacity:
                continue
            g = r.model.gain(r.n, r.tok, length)
            if best is None or g > best_gain:
                best, best_gain = r, g
        return best

    def dispatch(self, among: list[RefReplica] | None = None) -> None:
        among = self.replicas if among is None else among
        for seq_id in sorted(self.queue):
            r = self.best(self.queue[seq_id], among)
            if r is None:
                return
            r.seqs[seq_id] = self.queue.pop(seq_id)

    def shift_down(self, rids: list[str]) -> None:
        for r in [r for r in self.replicas if r.rid in rids]:
            self.queue.update(r.seqs)
            r.seqs.clear()
            self.replicas.remove(r)
        self.dispatch()

    def shift_up(self, new: list[tuple[str, int, ThroughputModel]]) -> int:
        added = []
        for rid, cap, model in new:
            self.add(rid, cap, model)
            added.append(self.replicas[-1])
        self.dispatch(added)
        if self.queue:
            return 0
        moves = 0
        budget = sum(r.n for r in self.replicas)
        while moves < budget:
            src = None
            for r in self.replicas:
                if r.n and (src is None or r.T > src.T):
                    src = r
            if src is None:
                break
            seq_id = min(src.seqs, key=lambda s: (src.seqs[s], s))
            t_src = src.T
            length = src.seqs.pop(seq_id)
            dst = self.best(length, self.replicas)
            if dst is None or dst is src:
                src.seqs[seq_id] = length
                break
            t_dst = dst.T
            dst.seqs[seq_id] = length
            delta = (src.T - t_src) + (dst.T - t_dst)
            scale = abs(t_src) + abs(t_dst)
            if not delta > 1e-12 * max(scale, 1.0):
                del dst.seqs[seq_id]
                src.seqs[seq_id] = length
                break
            moves += 1
        return moves

    def assignment(self) -> dict[int, str]:
        return {s: r.rid for r in self.replicas for s in r.seqs}
