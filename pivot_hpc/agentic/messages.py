"""The two messages of a tool call between the coordinator and a node's host rank.

Frozen plain-data dataclasses shaped like the ones in `runtime/protocol.py`, which
imports them: the runtime carries them as they are (command `ToolCall` on CMD to a node's
host rank, event `ToolResult` on EVT back), and the node's sandbox service takes and
returns them as JSON lines (service.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# What became of a call. Only "ok" carries the tool's value; every other status is turned
# into an error observation the model sees (tools.observation_body), never an exception.
#   error        the tool refused its arguments or failed cleanly (exit 1, message given)
#   timeout      wall-clock deadline or CPU-seconds limit reached; the process group killed
#   memory       the address-space limit was hit
#   output_limit the tool wrote more than the output limit; the process group killed
#   crash        the child died otherwise (a signal, an unexpected exit status)
#   unavailable  no child could be started, or the node's sandbox is marked unhealthy
Status = Literal["ok", "error", "timeout", "memory", "output_limit", "crash", "unavailable"]
STATUSES: tuple[Status, ...] = (
    "ok",
    "error",
    "timeout",
    "memory",
    "output_limit",
    "crash",
    "unavailable",
)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """Run `tool` with `args_json` (a JSON object, already checked against the tool's
    schema by the coordinator; the sandbox checks it again) within `deadline_s` seconds.
    `traj_id` names the trajectory that waits on it (for telemetry and resume).

    `history`: for a stateful tool (replayable, not idempotent), the `args_json` of the
    trajectory's earlier calls of it, in order, which its child re-runs before this one
    (tools.ToolSpec.stdin; at most tools.MAX_HISTORY_CALLS, MAX_HISTORY_BYTES); empty for
    any other tool."""

    call_id: int
    traj_id: int
    tool: str
    args_json: str
    deadline_s: float
    history: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ToolResult:
    """The outcome of call `call_id`: `text` is the tool's output when `status` is "ok",
    else a short reason; `seconds` is the wall time the call took in the sandbox."""

    call_id: int
    status: Status
    text: str
    seconds: float
