"""Tool calls on each node's host rank: the sandbox service beside it, and its loop.

Where the sandbox lives. Open MPI advises against fork() in an initialised MPI process,
and a sandbox spawns a child per call. So the process of each node's host rank (world
rank ≡ 0 mod ranks_per_node, rank 0 included) starts the node's sandbox service — one
process, `python -m pivot_hpc.agentic.service` — BEFORE MPI initialises: `start_before_mpi`,
called by `pivot-hpc run` on arrival in the world (`--in-world`: the local world's mpirun,
slurm/pivot.sbatch's srun) and by `pivot-hpc submit`'s task, just before `run_in_world`.
Every launcher ends in one of those two lines, so no launcher, wrapper or batch script
changes; the rank is read from the launcher's environment (OMPI_COMM_WORLD_RANK,
PMIX_RANK, PMI_RANK, SLURM_PROCID) because COMM_WORLD does not exist yet.

They talk over a socketpair: the service's end is the only descriptor it inherits, the
rank's end is close-on-exec (nothing the rank starts holds it), so no path, port or
environment variable names it and no other process can connect. Its lifetime is the
rank's: the rank closes its end at Stop or exit, and a rank that dies closes it too;
either way the service sees end of file and ends (see agentic/service.py).

With `tools.enabled: false` nothing here runs: no process, no socket.

Who asks. Other nodes' host ranks take `ToolCall` commands from the coordinator (CMD) in
`serve_host` and send each `ToolResult` back (EVT). Rank 0 is node 0's host rank and the
coordinator: it calls its own service in-process (`local_service()`), without MPI.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Mapping

from pivot_hpc import interpreter
from pivot_hpc.agentic.config import ToolsConfig
from pivot_hpc.agentic.messages import ToolCall, ToolResult
from pivot_hpc.agentic.service import MAX_LINE_BYTES, LineReader, decode_result, encode
from pivot_hpc.errors import PivotError
from pivot_hpc.job.config import Config

RANK_ENV = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")
READY_TIMEOUT_S = 60.0  # a cold Python start on a loaded node, plus the isolation probe
IDLE_POLL_S = 0.05  # the host rank's loop when no call runs (as it always polled for Stop)
BUSY_POLL_S = 0.002  # … and while calls run


class ToolServiceError(PivotError, RuntimeError):
    pass


def world_rank_before_mpi(env: Mapping[str, str] | None = None) -> int | None:
    """This process's world rank as its launcher announced it, before MPI initialises."""
    env = os.environ if env is None else env
    for name in RANK_ENV:
        value = env.get(name, "")
        if value.isdigit():
            return int(value)
    return None


class HostToolService:
    """The rank's side of its node's sandbox service: `submit` ToolCalls, `poll` the
    ToolResults. Never raises for a call: if the service dies, every outstanding and
    later call is answered "unavailable" (one line says so)."""

    def __init__(self, proc: subprocess.Popen, sock: socket.socket, node: int, close_s: float):
        self._proc = proc
        self._sock = sock
        self._reader = LineReader(sock)
        self.node = node
        self._close_s = close_s
        self._pending: set[int] = set()
        self._answers: list[ToolResult] = []  # answered here (service gone), not yet polled
        self.ready: bool | None = None  # None until the service's hello arrives
        self.isolation = ""
        self.dumpable: bool | None = None  # the service's, from its hello (False: as it should)
        self._dead: str | None = None
        self._closed = False

    @classmethod
    def start(cls, tools: ToolsConfig, node: int) -> HostToolService:
        """Start the service process (fork+exec; before MPI initialises)."""
        ours, theirs = socket.socketpair()  # both close-on-exec; `theirs` is passed
        config = json.dumps(dataclasses.asdict(tools))
        argv = interpreter.python("-m", "pivot_hpc.agentic.service")  # -P: no module from the cwd
        argv += ["--fd", str(theirs.fileno()), "--node", str(node), "--config", config]
        try:
            proc = subprocess.Popen(
                argv,
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                close_fds=True,
                env=interpreter.environ(),
            )
        except OSError as exc:
            ours.close()
            raise ToolServiceError(
                f"tools.enabled=true but node {node}'s sandbox service could not start ({exc})"
            ) from exc
        finally:
            theirs.close()
        ours.setblocking(False)
        return cls(proc, ours, node, close_s=tools.call_timeout_s + 10.0)

    # ------------------------------------------------------------------ state
    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def outstanding(self) -> int:
        return len(self._pending) + len(self._answers)

    @property
    def alive(self) -> bool:
        return self._dead is None and not self._closed

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> str:
        """Wait for the service's hello; its isolation, or a ToolServiceError saying why
        it cannot serve."""
        deadline = time.monotonic() + timeout_s
        while self.ready is None and self._dead is None:
            if time.monotonic() > deadline:
                raise ToolServiceError(
                    f"node {self.node}'s sandbox service did not answer in {timeout_s:g} s"
                )
            self._answers.extend(self._read())
            time.sleep(0.01)
        if not self.ready:
            raise ToolServiceError(
                f"node {self.node}'s sandbox service cannot serve: {self._dead or '?'}"
            )
        return self.isolation

    # ------------------------------------------------------------------ calls
    def submit(self, call: ToolCall) -> None:
        if self._closed:
            raise ToolServiceError("the host tool service is closed")
        if self._dead is not None:
            self._answers.append(self._unavailable(call.call_id))
            return
        line = encode(call)
        if len(line) > MAX_LINE_BYTES:  # the service would refuse it unread: say so here
            why = f"refused: the call is longer than {MAX_LINE_BYTES} bytes"
            self._answers.append(ToolResult(call.call_id, "error", why, 0.0))
            return
        self._pending.add(call.call_id)
        data = memoryview(line)
        while data and self._dead is None:
            try:
                data = data[self._sock.send(data) :]
            except BlockingIOError:
                # its buffer is full: maybe it waits for us to read its results, so read
                # them (kept for the next poll) rather than block both ends
                self._answers.extend(self._read())
                select.select([], [self._sock], [], 0.01)
            except OSError as exc:
                self._die(f"its socket failed ({exc})")
        if self._dead is not None:  # answer it (and whatever else it owed) now
            self._answers.extend(self._read())

    def poll(self) -> list[ToolResult]:
        """The results that arrived since the last poll (non-blocking)."""
        out, self._answers = self._answers, []
        return out + self._read()

    def _read(self) -> list[ToolResult]:
        if self._closed:
            return []
        out = []
        lines: list[bytes] = []
        if self._dead is None:
            lines = self._reader.read()
            if self._reader.take_overlong():  # results are capped far below it
                self._die(f"it sent a line longer than {MAX_LINE_BYTES} bytes")
        for line in lines:
            try:
                data = json.loads(line)
                if "ready" in data:
                    self.ready = bool(data["ready"])
                    self.isolation = str(data.get("isolation", ""))
                    self.dumpable = data.get("dumpable")
                    if not self.ready:
                        self._die(str(data.get("error", "no reason given")))
                    continue
                result = decode_result(data)
            except (ValueError, KeyError, TypeError) as exc:
                self._die(f"it sent a malformed line ({exc})")
                break
            if result.call_id in self._pending:
                self._pending.discard(result.call_id)
                out.append(result)
        if self._reader.eof and self._dead is None:
            code = self._proc.poll()
            self._die("it exited" + (f" with status {code}" if code is not None else ""))
        if self._dead is not None:  # what it still owed
            out += [self._unavailable(c) for c in sorted(self._pending)]
            self._pending.clear()
        return out

    def _die(self, why: str) -> None:
        if self._dead is not None:
            return
        self._dead = why
        if self.ready:  # a failed start is raised by wait_ready instead
            print(
                f"pivot-hpc: warning: node {self.node}'s sandbox service stopped ({why}); "
                "its tool calls are answered 'unavailable'",
                file=sys.stderr,
                flush=True,
            )

    def _unavailable(self, call_id: int) -> ToolResult:
        return ToolResult(call_id, "unavailable", "the node's sandbox service is gone", 0.0)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """End the service: close our end (its end of file), wait for it to finish its
        running calls and exit, kill it past that. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._sock.close()
        finally:
            try:
                self._proc.wait(self._close_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


_service: HostToolService | None = None


def start_before_mpi(cfg: Config, env: Mapping[str, str] | None = None) -> HostToolService | None:
    """On a node's host rank with tools enabled: start the node's sandbox service (once per
    process) and keep it for `local_service()`. None on every other rank, and when tools
    are disabled. Must run before MPI initialises (before mpi4py's `MPI` is imported)."""
    global _service
    if not cfg.tools.enabled:
        return None
    rank = world_rank_before_mpi(env)
    if rank is None:
        raise ToolServiceError(
            "tools.enabled=true, but this process cannot tell its MPI rank before MPI "
            f"starts (none of {', '.join(RANK_ENV)} is set); launch with `pivot-hpc run`, "
            "`pivot-hpc submit`, slurm/pivot.sbatch, mpirun or srun"
        )
    node, local = divmod(rank, cfg.cluster.ranks_per_node)
    if local != 0:
        return None
    mpi = sys.modules.get("mpi4py.MPI")
    if _service is None and mpi is not None and mpi.Is_initialized():
        raise ToolServiceError("the sandbox service must start before MPI initialises")
    if _service is None:
        _service = HostToolService.start(cfg.tools, node)
        atexit.register(_service.close)
    return _service


def local_service() -> HostToolService | None:
    """This process's sandbox service (a host rank with tools enabled), else None."""
    return _service


def serve_host(comm, cfg: Config) -> int:
    """The loop of a host rank other than the coordinator: run the coordinator's
    `ToolCall`s in the node's sandbox service and send back each `ToolResult`, until
    `Stop` (its code is the rank's exit status). The loop keeps probing MPI while idle, as
    the GPS shard this rank holds has always relied on. The coordinator collects its calls'
    results before it sends Stop; results still running then are dropped."""
    from pivot_hpc.runtime.protocol import CMD, EVT, Stop

    service = local_service()
    if cfg.tools.enabled:
        if service is None:
            raise ToolServiceError(
                f"tools.enabled=true but host rank {comm.Get_rank()} has no sandbox service: "
                "it is started before MPI by `pivot-hpc run`/`submit` (runtime/host_tools.py)"
            )
        service.wait_ready()
    try:
        while True:
            while comm.Iprobe(source=0, tag=CMD):
                cmd = comm.recv(source=0, tag=CMD)
                if isinstance(cmd, Stop):
                    return cmd.code
                if not isinstance(cmd, ToolCall):
                    raise ToolServiceError(f"a host rank got {type(cmd).__name__}")
                if service is None:
                    why = "tools are not enabled in this run"
                    comm.send(ToolResult(cmd.call_id, "unavailable", why, 0.0), dest=0, tag=EVT)
                else:
                    service.submit(cmd)
            if service is not None:
                for result in service.poll():
                    comm.send(result, dest=0, tag=EVT)
            busy = service is not None and service.outstanding
            time.sleep(BUSY_POLL_S if busy else IDLE_POLL_S)
    finally:
        if service is not None:
            service.close()
