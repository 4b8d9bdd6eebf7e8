"""Where the live cluster sends tool calls (runtime/live_cluster.py): node 0's to the
coordinator's own sandbox service, the others' to their host ranks, the least loaded node
first; a node whose service answered "unavailable" takes no more; results come back as
`ToolReturned` events, and an unknown result brings the run down."""

from __future__ import annotations

import importlib
import sys
import types

import pytest

from pivot_hpc.agentic.messages import ToolCall, ToolResult
from pivot_hpc.coordinator.events import ToolReturned
from pivot_hpc.runtime.world import Layout


@pytest.fixture
def live(monkeypatch: pytest.MonkeyPatch):
    """runtime/live_cluster.py without initialising MPI in this process: a host rank's
    sandbox service must start before MPI does (test_tools_launch.py starts some)."""
    if "mpi4py.MPI" not in sys.modules:
        import mpi4py

        fake = types.ModuleType("mpi4py.MPI")
        monkeypatch.setitem(sys.modules, "mpi4py.MPI", fake)
        monkeypatch.setattr(mpi4py, "MPI", fake, raising=False)
    monkeypatch.delitem(sys.modules, "pivot_hpc.runtime.live_cluster", raising=False)
    yield importlib.import_module("pivot_hpc.runtime.live_cluster")
    sys.modules.pop("pivot_hpc.runtime.live_cluster", None)  # not the copy over the fake


class Local:
    def __init__(self) -> None:
        self.calls: list[ToolCall] = []

    def submit(self, call: ToolCall) -> None:
        self.calls.append(call)

    def poll(self) -> list[ToolResult]:
        out = [ToolResult(c.call_id, "ok", "2", 0.01) for c in self.calls]
        self.calls = []
        return out


def cluster(live, nodes: int = 3) -> tuple[object, list, Local]:
    c = live.LiveCluster.__new__(live.LiveCluster)
    sent: list = []
    lay = Layout(rank=0, size=nodes * 3, node=0, local_rank=0, gpus_per_node=2)
    c.layout, c._nodes, c._local = lay, nodes, Local()
    c._tool_node, c._tool_gone, c._pending = {}, set(), []
    c.t0 = 0.0
    c._send = lambda rank, cmd: sent.append((rank, cmd))
    return c, sent, c._local


def call(i: int) -> ToolCall:
    return ToolCall(i, 100 + i, "calculator", '{"expression":"1+1"}', 5.0)


def test_calls_spread_over_nodes_node_0_in_process(live) -> None:
    c, sent, local = cluster(live)
    for i in range(6):
        c.call_tool(call(i))
    assert [x.call_id for x in local.calls] == [0, 3]  # node 0: its own service
    assert [(rank, cmd.call_id) for rank, cmd in sent] == [(3, 1), (6, 2), (3, 4), (6, 5)]
    c._poll_local_tools()
    assert [type(e) for e in c._pending] == [ToolReturned, ToolReturned]
    assert sorted(c._tool_node) == [1, 2, 4, 5]


def test_a_node_whose_service_is_gone_takes_no_more_calls(live) -> None:
    c, sent, _ = cluster(live)
    c.call_tool(call(0))
    c.call_tool(call(1))  # node 1
    c._tool_result(ToolResult(1, "unavailable", "the node's sandbox service is gone", 0.0))
    for i in range(2, 6):
        c.call_tool(call(i))
    assert all(rank != 3 for rank, cmd in sent if cmd.call_id >= 2)
    ev = c._pending[0]
    assert isinstance(ev, ToolReturned) and ev.result.status == "unavailable"


def test_a_result_for_no_call_brings_the_run_down(live) -> None:
    c, _, _ = cluster(live)
    with pytest.raises(live.WorkerFailed, match="tool call 9"):
        c._tool_result(ToolResult(9, "ok", "2", 0.01))


def test_with_every_node_gone_calls_still_go_somewhere(live) -> None:
    c, sent, local = cluster(live, nodes=1)
    c._tool_gone = {0}
    c.call_tool(call(0))
    assert [x.call_id for x in local.calls] == [0]  # answered "unavailable" by the service
    assert not sent
