"""A node's sandbox server: the pool a node's host rank drives, one per node.

In-process API, no listener: the host rank `submit`s the `ToolCall`s the coordinator sends
it and, in its loop, `poll`s the finished `ToolResult`s to send back. At most
`max_concurrent` children run at once (the rest queue), each through `sandbox.run_tool`.
It spawns processes, which Open MPI advises against inside MPI ranks (UCX, libfabric), so
it lives in the node's sandbox service (service.py), a process the host rank's process
starts before MPI initialises (runtime/host_tools.py).

A stateful tool's call carries its trajectory's earlier calls of it (`ToolCall.history`):
each is checked like the call's own arguments, and the child gets them with the call on
stdin (`ToolSpec.stdin`) and re-runs them first, so the tool's state lives in that one
child only. A history past the bounds (tools.MAX_HISTORY_*), or one given for a tool that
keeps no state, is an "error" result, like a schema failure.

Failures of a call (a timeout, the tool refusing its arguments) are data: they go back as
observations. A dead sandbox is infrastructure: a crashed child, or one that could not be
started. After `unhealthy_after_failures` of those in a row the node's sandbox is marked
unhealthy, with one line, and answers every further call "unavailable" without spawning;
the coordinator then leaves the node out of tool dispatch (`healthy`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import sys
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from pivot_hpc.agentic import schema as json_schema
from pivot_hpc.agentic.messages import ToolCall, ToolResult
from pivot_hpc.agentic.sandbox import (
    Isolation,
    SandboxLimits,
    detect_isolation,
    remove_tree,
    run_tool,
)
from pivot_hpc.agentic.tools import ToolRegistry, ToolSpec, history_problem

DEATHS = ("crash", "unavailable")  # statuses that mean the sandbox, not the call, failed


def _print_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _test_delay() -> float:
    """PIVOT_HPC_TOOL_DELAY_S, a test hook (0 when unset or not a finite number >= 0)."""
    try:
        value = float(os.environ.get("PIVOT_HPC_TOOL_DELAY_S", "0"))
    except ValueError:
        return 0.0
    return value if 0 < value < 3600 else 0.0


class SandboxServer:
    """Runs tool calls for one node. `registry`: the declared tools (their programs);
    `limits`: each call's limits (a call's own `deadline_s` may only shorten the wall
    clock); `notify`: where the one unhealthy line goes (stderr by default)."""

    def __init__(
        self,
        registry: ToolRegistry,
        limits: SandboxLimits,
        *,
        max_concurrent: int = 4,
        unhealthy_after_failures: int = 3,
        node: int = 0,
        isolation: Isolation | None = None,
        notify: Callable[[str], None] = _print_line,
    ) -> None:
        if max_concurrent < 1 or unhealthy_after_failures < 1:
            raise ValueError("max_concurrent and unhealthy_after_failures must be >= 1")
        self.registry = registry
        self.limits = limits
        self.node = node
        self.unhealthy_after_failures = unhealthy_after_failures
        self.isolation = detect_isolation() if isolation is None else isolation
        self._notify = notify
        self._root = tempfile.mkdtemp(prefix="pivot-sandbox-")  # 0700; calls' dirs inside
        self._pool = ThreadPoolExecutor(max_concurrent, thread_name_prefix="pivot-sandbox")
        self._done: queue.SimpleQueue[ToolResult] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._outstanding = 0
        # Test hook: seconds every call waits before it runs, so that a live test can stop
        # a job while trajectories are surely parked on calls (tests/mpi/test_tools_live.py).
        self._test_delay_s = _test_delay()
        self._closing = threading.Event()  # ends a test-hook delay at close
        self._deaths_in_a_row = 0
        self._unhealthy: str | None = None
        self._closed = False

    # ------------------------------------------------------------------ state
    @property
    def healthy(self) -> bool:
        return self._unhealthy is None

    @property
    def unhealthy_reason(self) -> str | None:
        return self._unhealthy

    @property
    def outstanding(self) -> int:
        """Calls submitted and not yet returned by `poll` (queued or running)."""
        return self._outstanding

    # ------------------------------------------------------------------ calls
    def submit(self, call: ToolCall) -> None:
        """Queue `call`; its result comes out of `poll`. Never raises for a bad call."""
        if self._closed:
            raise RuntimeError("the sandbox server is closed")
        with self._lock:
            self._outstanding += 1
        if self._unhealthy is not None:
            self._done.put(self._unavailable(call))
            return
        self._pool.submit(self._run_safely, call)

    def poll(self) -> list[ToolResult]:
        """The results finished since the last poll (non-blocking)."""
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                break
        with self._lock:
            self._outstanding -= len(out)
        return out

    def call(self, call: ToolCall, timeout_s: float | None = None) -> ToolResult:
        """Run one call and wait for it (for tests and single-call users; the host rank
        submits and polls). Results of other calls stay queued for `poll`."""
        done = threading.Event()
        box: list[ToolResult] = []

        def run() -> None:
            box.append(self._run_safely(call, publish=False))
            done.set()

        with self._lock:
            self._outstanding += 1
        try:
            if self._unhealthy is not None:
                return self._unavailable(call)
            self._pool.submit(run)
            if not done.wait(timeout_s):
                return ToolResult(call.call_id, "timeout", "no result in time", 0.0)
            return box[0]
        finally:
            with self._lock:
                self._outstanding -= 1

    def _run_safely(self, call: ToolCall, publish: bool = True) -> ToolResult:
        if self._test_delay_s > 0:
            self._closing.wait(self._test_delay_s)
        try:
            result = self._run(call)
        except Exception as exc:  # a bug here must not lose the call or kill the pool
            result = ToolResult(call.call_id, "unavailable", f"sandbox error: {exc!r}", 0.0)
        self._record(result)
        if publish:
            self._done.put(result)
        return result

    def _run(self, call: ToolCall) -> ToolResult:
        if self._unhealthy is not None:
            return self._unavailable(call)
        tool = self.registry.get(call.tool)
        if tool is None:
            return ToolResult(call.call_id, "error", f"unknown tool '{call.tool[:40]}'", 0.0)
        try:
            args = json.loads(call.args_json)
        except (ValueError, RecursionError):
            return ToolResult(call.call_id, "error", "arguments are not valid JSON", 0.0)
        why = json_schema.validate(args, tool.parameters)
        if why is None:
            why = _history_problem(tool, call.history)
        if why is not None:  # checked by the coordinator already; trust no one
            return ToolResult(call.call_id, "error", why, 0.0)
        timeout = min(self.limits.timeout_s, max(call.deadline_s, 0.0))
        limits = dataclasses.replace(self.limits, timeout_s=timeout)
        return run_tool(
            tool.program,
            tool.stdin(call.args_json, call.history),
            limits,
            call_id=call.call_id,
            isolation=self.isolation,
            workdir_root=self._root,
        )

    def _record(self, result: ToolResult) -> None:
        line = None
        with self._lock:
            if result.status in DEATHS:
                self._deaths_in_a_row += 1
            else:
                self._deaths_in_a_row = 0
            if self._unhealthy is None and self._deaths_in_a_row >= self.unhealthy_after_failures:
                self._unhealthy = (
                    f"{self._deaths_in_a_row} calls in a row failed in the sandbox "
                    f"(last: {result.status}: {result.text[:120]})"
                )
                line = (
                    f"pivot-hpc: warning: node {self.node}'s tool sandbox is unhealthy: "
                    f"{self._unhealthy}; the node takes no more tool calls"
                )
        if line is not None:
            self._notify(line)

    def _unavailable(self, call: ToolCall) -> ToolResult:
        return ToolResult(call.call_id, "unavailable", "the node's tool sandbox is unhealthy", 0.0)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Wait for running calls, then remove the server's private directory."""
        if self._closed:
            return
        self._closed = True
        self._closing.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        remove_tree(self._root)

    def __enter__(self) -> SandboxServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _history_problem(tool: ToolSpec, history: tuple[str, ...]) -> str | None:
    """Why `history` cannot go with a call of `tool`, or None."""
    if not tool.stateful:
        return None if not history else f"tool '{tool.name}' keeps no state: no history"
    why = history_problem(tool.name, history)
    if why is not None:
        return why
    for i, past in enumerate(history):
        try:
            args = json.loads(past)
        except (ValueError, RecursionError):
            return f"history[{i}]: arguments are not valid JSON"
        why = json_schema.validate(args, tool.parameters)
        if why is not None:
            return f"history[{i}]: {why}"
    return None


def preflight(registry: ToolRegistry, limits: SandboxLimits) -> str | None:
    """One line when this machine cannot run tool calls (checked before launch), else None.
    Runs each declared tool's program once on an empty argument set: it must answer (a
    refusal of the empty arguments is an answer), not crash or fail to start."""
    isolation = detect_isolation()
    for name in registry.names():
        tool = registry.get(name)
        assert tool is not None
        result = run_tool(tool.program, tool.stdin("{}"), limits, isolation=isolation)
        if result.status not in ("ok", "error"):
            return (
                f"tools are enabled but the sandbox cannot run tool '{name}' on this machine "
                f"({result.status}: {result.text[:160]}); check tools.memory_mb and "
                "tools.cpu_seconds, or set tools.enabled=false"
            )
    return None
