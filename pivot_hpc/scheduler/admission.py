"""How many sequences of a role run at once (`scheduler.admission`, beyond the paper).

§6 dispatches every queued sequence that fits. Under a staleness bound s that is not what
makes the pipeline fastest: at most s+1 batches are in flight, and a batch is done only
when its longest sequence is, so end-to-end throughput is at most

    min( R·n / ℓ(n),  (s+1)·B / (L_max·ℓ(n)) )

for n sequences per replica on R replicas, ℓ(n) the iteration latency (it grows with n),
B a batch's generated tokens and L_max its longest sequence (iterations). The first term
(capacity) grows with n, the second (latency: s+1 batches per longest sequence) falls, so
the best total concurrency is where they meet:

    C* = R·n* = (s+1)·B / L_max = (s+1) · batch size · L̄ / L_max

— more running sequences only slow every iteration, including the oldest batch's, which
the next release waits for; fewer leave capacity unused. `pipeline` admission spreads C*
over every slot the role can hold — its slots outside training's own GPUs (training
gives those up only in a "0 or N" shift-down; sizing over them halved the cap): each
replica runs at most ⌈C*/slots⌉ sequences, so the role reaches C* when it holds all of
them; with fewer replicas the rest wait in the
queue's priority order (sequence id: older batches first), which the planner reads as
demand (Eq. 1 counts queued sequences). L̄ and L_max are the mean and the longest
generated length of the role's sequences finished so far; until one has finished there is
no cap. The engines' own running-request caps still apply.

A replica is never capped below its knee ⌈B/C⌉ (`scheduler._knee`). The latency term
assumes fewer running sequences make every iteration shorter; but up to B/C sequences an
iteration streams the weights once whatever their number (T's max(B, C·N_seq)), and only
attention (A·N_tok) grows. A cap there saves the longest sequence little time per
iteration, idles the memory-bound engine, and keeps the batch's sequences — its longest
among them, which the term assumes starts at release — waiting in the queue. C* per
replica fell below the knee for the small dense models of group 1 (8 rollouts, 12
judgements per GPU against a knee of 20) and on short batches; MoE models (fitted B = 0)
have no such flat part and keep C*.
"""

from __future__ import annotations

import math


class PipelineAdmission:
    def __init__(self, staleness: int, batch_size: int) -> None:
        self.batches = staleness + 1
        self.batch_size = batch_size
        self._sum: dict[str, float] = {}
        self._count: dict[str, int] = {}
        self._max: dict[str, int] = {}

    def observe(self, role: str, generated: int) -> None:
        """A sequence of `role` finished with `generated` tokens."""
        self._sum[role] = self._sum.get(role, 0.0) + generated
        self._count[role] = self._count.get(role, 0) + 1
        self._max[role] = max(self._max.get(role, 0), generated)

    def concurrency(self, role: str) -> int:
        """C* for `role` (0: no cap yet)."""
        longest = self._max.get(role, 0)
        if longest <= 0:
            return 0
        mean = self._sum[role] / self._count[role]
        return max(1, math.ceil(self.batches * self.batch_size * mean / longest))

    def replica_limit(self, role: str, slots: int) -> int:
        """Sequences one replica of `role` may run (0: no cap yet)."""
        c = self.concurrency(role)
        return math.ceil(c / max(slots, 1)) if c else 0
