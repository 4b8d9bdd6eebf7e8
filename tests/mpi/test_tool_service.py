"""Tool calls in a real MPI world (issue 37): each node's host rank runs the coordinator's
`ToolCall`s in the node's sandbox service, started before MPI initialises, and sends the
`ToolResult`s back; rank 0 (node 0's host rank) uses its own service in-process. No
sandbox service outlives the job.

This file is also the world's program: `mpirun -n 4 python test_tool_service.py --worker`
(2 pseudo-nodes of 1 host rank + 1 worker rank each).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs OpenMPI (mpirun)")

ROOT = Path(__file__).parents[2]
CALLS = {  # call id -> (tool, arguments as JSON, the status it must get, its text or None)
    1: ("calculator", '{"expression": "47+38+96"}', "ok", "181"),
    2: ("calculator", '{"expression": "__import__(\'os\')"}', "error", None),
    3: ("shell", '{"command": "ls"}', "error", "unknown tool 'shell'"),
    4: ("calculator", "{not json", "error", "arguments are not valid JSON"),
    5: ("calculator", '{"expression": "2**10 - 24"}', "ok", "1000"),
}


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for a reaper does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.timeout(180)
def test_host_ranks_run_tool_calls_in_their_node_sandbox() -> None:
    from pivot_hpc.cli.local_world import MPI_ENV

    cmd = ["mpirun", "-n", "4", "--oversubscribe", "--bind-to", "none"]
    cmd += [sys.executable, str(Path(__file__).resolve()), "--worker"]
    env = {**os.environ, **MPI_ENV, "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the tool world hung:\n{str(exc.stdout or '')[-3000:]}")
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"rc={p.returncode}\n{out[-6000:]}"
    assert "TOOLS-OK" in p.stdout, out[-6000:]
    m = re.search(r"HELPERS (\d+) (\d+)", p.stdout)
    assert m, out[-3000:]
    # the services ended with their ranks: none runs once the world has exited
    deadline = time.monotonic() + 10
    pids = [int(m.group(1)), int(m.group(2))]
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if _alive(pid)], out[-3000:]
    print(f"tool world: {time.monotonic() - t0:.1f} s")


# ------------------------------------------------------------------ the world's program
def _world() -> int:
    from pivot_hpc.agentic.config import ToolsConfig
    from pivot_hpc.job.config import ClusterConfig, Config
    from pivot_hpc.runtime import host_tools

    cfg = Config(
        cluster=ClusterConfig(nodes=2, gpus_per_node=1),
        tools=ToolsConfig(enabled=True, max_concurrent=2),
    )
    service = host_tools.start_before_mpi(cfg)  # before MPI initialises, as the CLI does
    from mpi4py import MPI

    from pivot_hpc.runtime.protocol import CMD, Stop
    from pivot_hpc.runtime.world import layout

    comm = MPI.COMM_WORLD
    lay = layout(comm, cfg)
    pids = comm.gather(service.pid if service is not None else None, root=0)
    if lay.is_coordinator:
        return _coordinate(comm, pids)
    if lay.is_host:
        return host_tools.serve_host(comm, cfg)
    while not comm.Iprobe(source=0, tag=CMD):  # a worker: no service of its own
        time.sleep(0.02)
    cmd = comm.recv(source=0, tag=CMD)
    assert isinstance(cmd, Stop), cmd
    return cmd.code


def _check(results: dict, offset: int) -> None:
    assert sorted(results) == [offset + i for i in CALLS], results
    for i, (_, _, status, text) in CALLS.items():
        r = results[offset + i]
        assert r.status == status, r
        assert text is None or r.text == text, r


def _coordinate(comm, pids: list[int | None]) -> int:
    from pivot_hpc.runtime import host_tools
    from pivot_hpc.runtime.protocol import CMD, EVT, Stop, ToolCall, ToolResult

    assert pids[1] is None and pids[3] is None, pids  # worker ranks start no service
    assert pids[0] is not None and pids[2] is not None, pids
    print(f"HELPERS {pids[0]} {pids[2]}", flush=True)
    # node 1: through its host rank (world rank 2), over MPI
    for i, (tool, args, _, _) in CALLS.items():
        comm.send(ToolCall(100 + i, 7, tool, args, 5.0), dest=2, tag=CMD)
    remote: dict[int, ToolResult] = {}
    while len(remote) < len(CALLS):
        r = comm.recv(source=2, tag=EVT)
        assert isinstance(r, ToolResult), r
        remote[r.call_id] = r
    _check(remote, 100)
    # node 0: rank 0 is its host rank; it calls its own service in-process
    local = host_tools.local_service()
    assert local is not None
    print(f"isolation: {local.wait_ready()}", flush=True)
    for i, (tool, args, _, _) in CALLS.items():
        local.submit(ToolCall(i, 7, tool, args, 5.0))
    mine: dict[int, ToolResult] = {}
    deadline = time.monotonic() + 60
    while len(mine) < len(CALLS) and time.monotonic() < deadline:
        mine.update((r.call_id, r) for r in local.poll())
        time.sleep(0.005)
    _check(mine, 0)
    for rank in range(1, comm.Get_size()):
        comm.send(Stop(0), dest=rank, tag=CMD)
    local.close()
    print("TOOLS-OK", flush=True)
    return 0


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    import traceback

    try:
        code = _world()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)
    sys.exit(code)
