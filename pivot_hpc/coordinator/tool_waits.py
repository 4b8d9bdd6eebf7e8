"""What the answered tool calls predict for a call still out: its remaining wait.

The planner counts a parked trajectory as rollout demand when its call is due back within
the horizon H (`TurnLoop.due_within`). A mean of answered waits is the wrong predictor for
a call that has already waited: tool latencies are skewed or bimodal (a cache hit and a
cold run, a fast and a slow tool), the first answers are the shortest (the long calls of
the same wave are still out), and a call older than its tool's mean would count as due at
once, forever. So the estimate is conditional on the call's age a: the mean remaining time
E[W − a | W > a] over the recent answered waits longer than a. A call older than every
answer seen (the longest, m) is in a tail no answer describes yet: it is expected to take
a − m more, as long past m again as it already is. That keeps the estimate continuous at
m (it falls to 0 as a reaches m): a jump there would flip the call from due to not due and
back each time a longer answer arrives, and the planner would move a GPU back and forth
with it (measured: `tests/sim/test_tool_latency_mix.py`).
"""

from __future__ import annotations

import bisect
from collections import deque

WINDOW = 1024  # recent answers kept per tool: latencies drift (load, cache warmth)


class _Waits:
    """The last WINDOW answered waits, sorted, with their suffix sums (rebuilt lazily)."""

    def __init__(self) -> None:
        self._order: deque[float] = deque()
        self._sorted: list[float] = []
        self._suffix: list[float] | None = None

    def __len__(self) -> int:
        return len(self._sorted)

    def add(self, wait: float) -> None:
        if len(self._order) == WINDOW:
            old = self._order.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._order.append(wait)
        bisect.insort(self._sorted, wait)
        self._suffix = None

    def remaining(self, age: float) -> float:
        w = self._sorted
        if self._suffix is None:  # suffix[i] = sum(w[i:])
            self._suffix = [0.0] * (len(w) + 1)
            for i in range(len(w) - 1, -1, -1):
                self._suffix[i] = self._suffix[i + 1] + w[i]
        i = bisect.bisect_right(w, age)
        if i == len(w):
            return age - w[-1]
        return self._suffix[i] / (len(w) - i) - age


class ToolWaits:
    """Answered waits per tool, and pooled over tools (for a tool not answered yet)."""

    def __init__(self) -> None:
        self._by_tool: dict[str, _Waits] = {}
        self._all = _Waits()

    def add(self, tool: str, wait: float) -> None:
        self._by_tool.setdefault(tool, _Waits()).add(wait)
        self._all.add(wait)

    def remaining(self, tool: str, age: float) -> float:
        """Expected seconds until a call of `tool` that has waited `age` is answered: 0
        before any call was answered (a first wave is due at once, not mistaken for idle
        rollout GPUs); the pooled answers for a tool that has none of its own."""
        waits = self._by_tool.get(tool) or self._all
        if not len(waits):
            return 0.0
        return waits.remaining(max(0.0, age))
