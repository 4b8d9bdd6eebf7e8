"""A node's sandbox service: the process that owns the node's `SandboxServer`, next to its
host rank, started before MPI initialises (runtime/host_tools.py starts it).

Why a process of its own: the server spawns a child per call, and Open MPI advises against
fork() inside an MPI process (registered memory, UCX/libfabric). This process is started
(fork+exec) by the host rank's process before `MPI_Init`, so no rank ever forks after it.

    python -m pivot_hpc.agentic.service --fd N --node K --config JSON

It talks to its rank over one end of a socketpair (fd N, inherited only by it): one JSON
object per line each way. Its first line is a hello, `{"ready": true, "isolation": ...,
"dumpable": false}` (or `{"ready": false, "error": ...}` when it cannot serve); then a
`ToolCall` line in gives, some time later, its `ToolResult` line out (any order: calls run
concurrently). A call line longer than MAX_LINE_BYTES is refused (an "error" result where
its first bytes name the call) and the service goes on. It makes itself non-dumpable
before it spawns anything (`_undumpable`).

Its lifetime is its rank's: end of file on the socket (the rank closed it, exited or was
killed) ends it, after the calls still running have been killed at their deadlines and
their working directories removed. It ignores the job's signals (mpirun and srun forward
USR1/USR2/TERM to a rank's process group; the rank decides when to stop) and also ends
when its parent is gone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import selectors
import signal
import socket
import sys
from typing import Any

from pivot_hpc.agentic.messages import STATUSES, ToolCall, ToolResult

MAX_LINE_BYTES = 4 * 2**20  # far above one call or result (outputs are capped far lower)
BUSY_POLL_S = 0.002  # how often finished calls are looked for while some run
IDLE_POLL_S = 0.5  # how often the parent is checked while none run


# ------------------------------------------------------------------ the wire
def encode(message: ToolCall | ToolResult | dict[str, Any]) -> bytes:
    """One line of the socket protocol (json.dumps escapes every newline)."""
    data = message if isinstance(message, dict) else dataclasses.asdict(message)
    return json.dumps(data, separators=(",", ":")).encode() + b"\n"


def decode_call(line: bytes) -> ToolCall:
    d = json.loads(line)
    history = d.get("history", [])
    if not isinstance(history, list) or not all(isinstance(h, str) for h in history):
        raise ValueError("history: expected a list of strings")
    return ToolCall(
        call_id=int(d["call_id"]),
        traj_id=int(d["traj_id"]),
        tool=str(d["tool"]),
        args_json=str(d["args_json"]),
        deadline_s=float(d["deadline_s"]),
        history=tuple(history),
    )


def decode_result(d: dict[str, Any]) -> ToolResult:
    status = d["status"]
    if status not in STATUSES:
        raise ValueError(f"unknown status {status!r}")
    return ToolResult(int(d["call_id"]), status, str(d["text"]), float(d["seconds"]))


class LineReader:
    """Splits what a non-blocking socket delivers into lines; `eof` once it is closed.

    A line longer than MAX_LINE_BYTES is not kept: it is skipped up to its newline, and
    its first bytes go to `overlong` (the caller says so, and answers its call if they
    name one), so that one such line costs neither the memory nor the connection."""

    HEAD_BYTES = 64  # what is kept of an over-long line: enough for its call id

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.eof = False
        self.overlong: list[bytes] = []
        self._buf = bytearray()
        self._skipping = False  # inside an over-long line, until its newline

    def read(self) -> list[bytes]:
        lines: list[bytes] = []
        while not self.eof:
            try:
                chunk = self.sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:  # reset by a peer that died
                chunk = b""
            if not chunk:
                self.eof = True
                break
            lines += self._split(chunk)
        return lines

    def _split(self, data: bytes) -> list[bytes]:
        lines = []
        while data:
            end = data.find(b"\n")
            if self._skipping:
                if end < 0:
                    return lines
                self._skipping, data = False, data[end + 1 :]
                continue
            if end < 0:
                self._buf += data
                if len(self._buf) > MAX_LINE_BYTES:
                    self.overlong.append(bytes(self._buf[: self.HEAD_BYTES]))
                    self._buf, self._skipping = bytearray(), True
                return lines
            line = bytes(self._buf + data[:end])
            self._buf, data = bytearray(), data[end + 1 :]
            if len(line) > MAX_LINE_BYTES:
                self.overlong.append(line[: self.HEAD_BYTES])
            else:
                lines.append(line)
        return lines

    def take_overlong(self) -> list[bytes]:
        out, self.overlong = self.overlong, []
        return out


_CALL_ID = re.compile(rb'\{"call_id":(\d{1,18})[,}]')  # how `encode` starts a ToolCall's line


def overlong_answer(head: bytes) -> ToolResult | None:
    """The answer to a call whose line was too long to read, if its first bytes name it."""
    m = _CALL_ID.match(head)
    if m is None:
        return None
    why = f"refused: the call is longer than {MAX_LINE_BYTES} bytes"
    return ToolResult(int(m.group(1)), "error", why, 0.0)


# ------------------------------------------------------------------ the process
def _say(line: str) -> None:
    print(f"pivot-hpc: sandbox service: {line}", file=sys.stderr, flush=True)


def _send(sock: socket.socket, message: ToolResult | dict[str, Any]) -> bool:
    try:
        sock.sendall(encode(message))
        return True
    except OSError:  # the rank is gone
        return False


def serve(sock: socket.socket, config: dict[str, Any], node: int) -> int:
    """Serve calls on `sock` until its end of file; the process's exit status."""
    from pivot_hpc.agentic.config import ToolsConfig
    from pivot_hpc.agentic.server import SandboxServer
    from pivot_hpc.agentic.tools import build_registry

    parent = os.getppid()
    try:
        cfg = ToolsConfig(**{**config, "tools": tuple(config["tools"])})
        cfg.validate("tools")
        server = SandboxServer(
            build_registry(cfg.tools),
            cfg.sandbox_limits(),
            max_concurrent=cfg.max_concurrent,
            unhealthy_after_failures=cfg.unhealthy_after_failures,
            node=node,
        )
    except Exception as exc:  # said to the rank, which fails with it
        _send(sock, {"ready": False, "error": f"{type(exc).__name__}: {exc}"})
        return 1
    with server:
        hello = {"ready": True, "isolation": server.isolation.detail, "dumpable": dumpable()}
        if not _send(sock, hello):
            return 0
        sock.setblocking(False)
        reader = LineReader(sock)
        sel = selectors.DefaultSelector()
        sel.register(sock, selectors.EVENT_READ)
        try:
            while not reader.eof:
                sel.select(BUSY_POLL_S if server.outstanding else IDLE_POLL_S)
                for line in reader.read():
                    try:
                        call = decode_call(line)
                    except (ValueError, KeyError, TypeError) as exc:
                        _say(f"node {node}: a malformed call line is ignored ({exc})")
                        continue
                    server.submit(call)
                refused = []  # over-long lines: refused (by call id where they name one)
                for head in reader.take_overlong():
                    answer = overlong_answer(head)
                    shown = f"call {answer.call_id}" if answer else "a line naming no call"
                    _say(f"node {node}: {shown} is longer than {MAX_LINE_BYTES} bytes: refused")
                    refused += [answer] if answer else []
                sock.setblocking(True)  # results go out whole
                for result in [*refused, *server.poll()]:
                    if not _send(sock, result):
                        reader.eof = True
                sock.setblocking(False)
                if os.getppid() != parent:  # the rank died without closing its end
                    break
        finally:
            sel.close()
    return 0  # leaving `with server` waited for running calls and removed their dirs


def _ignore(_signum: int, _frame: object) -> None:
    pass


_PR_GET_DUMPABLE, _PR_SET_DUMPABLE = 3, 4  # <linux/prctl.h>


def _prctl(option: int, value: int = 0) -> int | None:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl.argtypes = (ctypes.c_int,) + (ctypes.c_ulong,) * 4
        return int(libc.prctl(option, value, 0, 0, 0))
    except (OSError, AttributeError):  # not Linux
        return None


def _undumpable() -> None:
    """This process spawns the tool calls: not dumpable, so that no process of the same
    user without CAP_SYS_PTRACE (a tool where no user namespace holds it) can open its
    memory or environment through /proc or ptrace it; nor does it dump a core."""
    _prctl(_PR_SET_DUMPABLE, 0)


def dumpable() -> bool:
    """Whether this process is dumpable (PR_GET_DUMPABLE); the hello reports it."""
    return _prctl(_PR_GET_DUMPABLE) != 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pivot_hpc.agentic.service")
    p.add_argument("--fd", type=int, required=True, help="this end of the rank's socketpair")
    p.add_argument("--node", type=int, default=0)
    p.add_argument("--config", required=True, help="the tools section as JSON")
    args = p.parse_args(argv)
    _undumpable()
    # The rank's lifetime is ours (see above). A handler, not SIG_IGN: an ignored signal
    # would stay ignored in the sandbox's children across exec.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
        signal.signal(sig, _ignore)
    sock = socket.socket(fileno=args.fd)
    try:
        return serve(sock, json.loads(args.config), args.node)
    finally:
        sock.close()


if __name__ == "__main__":
    sys.exit(main())
