"""Tool declarations, the registry, and reading a tool call out of generated text.

A turn that calls a tool ends at the call's closing tag (a stop string). Two call formats
are read:

    <calc>47+38+96</calc>                                  the tiny default's shorthand
    <tool_call>{"name": "calculator", "arguments": {"expression": "47+38"}}</tool_call>

and the model sees the outcome as `<result>181</result>` (or `<result>error: why</result>`).
Whatever the model writes — an undeclared tool, a malformed call, arguments that fail the
schema — becomes such an observation (`Refusal`), never an exception.

A stateful tool (`ToolSpec.stateful`: replayable, not idempotent) keeps no process between
calls either: each call carries the arguments of the trajectory's earlier calls of it
(`ToolCall.history`, at most MAX_HISTORY_CALLS of them and MAX_HISTORY_BYTES), and its
child re-runs them before the call (`ToolSpec.stdin`). A call past those bounds is refused
with an observation (`history_refusal`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from pivot_hpc.agentic import schema as json_schema
from pivot_hpc.agentic.messages import ToolResult

RESULT_OPEN = "<result>"
RESULT_CLOSE = "</result>"
CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
MAX_CALL_CHARS = 4096  # a longer call is refused unparsed (json of any depth is not read)
MAX_OBSERVATION_CHARS = 4096  # tool output the model sees, before token truncation
# A stateful tool's call carries the trajectory's earlier calls of it: at most this many,
# of at most this many bytes of arguments in all (the sandbox takes 64 KiB of stdin). A
# call that would carry more is refused with an observation (max_turns bounds the calls
# of a trajectory, so only a run with tools.max_turns above 33 can meet it).
MAX_HISTORY_CALLS = 32
MAX_HISTORY_BYTES = 32 * 1024
_NON_PRINTABLE = re.compile(r"[^\n\x20-\x7e]")


@dataclass(frozen=True)
class ToolSpec:
    """One tool. `program` is the Python source the sandbox child runs: it reads the
    arguments (a JSON object) on stdin and writes its value on stdout, exiting 0, or a
    message and exit 1. It imports only the standard library (the child runs `python -I
    -S`). `tag`: a shorthand `<tag>TEXT</tag>` that calls the tool with {tag_arg: TEXT}.

    `idempotent`: running a call twice gives the same result and no side effect, so a call
    pending at a checkpoint is simply issued again on resume. `replayable`: the tool's
    state is the fold of the trajectory's earlier calls of it, so re-running them in order
    rebuilds it. A tool that is replayable and not idempotent is `stateful`: its program
    reads `{"history": [args, ...], "args": {...}}` instead (the trajectory's earlier calls
    of it, in order, then this call's arguments; `stdin`), re-runs the history discarding
    its output, then runs the call — all in the call's one fresh child, so no state
    outlives it. On resume a pending call of it is issued again with its history (the same
    result as without the interruption). A tool neither idempotent nor replayable (side
    effects a replay would repeat) cannot resume a pending call: its trajectory is dropped
    and its group resampled (`resume_group` in trajectory.py)."""

    name: str
    description: str
    parameters: Mapping[str, Any]  # JSON schema of the arguments (schema.py's subset)
    program: str = field(repr=False)
    idempotent: bool = True
    replayable: bool = True
    tag: str | None = None
    tag_arg: str | None = None

    def __post_init__(self) -> None:
        # at most 16 characters: telemetry keeps it so (tool_calls.tool, an S16 column)
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]{0,15}", self.name):
            raise ValueError(f"tool name {self.name!r}: letters, digits, _ . - only, at most 16")
        json_schema.check_schema(self.parameters, f"tool {self.name!r} parameters")
        if self.parameters.get("type") != "object":
            raise ValueError(f"tool {self.name!r}: parameters must be a JSON object schema")
        if (self.tag is None) != (self.tag_arg is None):
            raise ValueError(f"tool {self.name!r}: give both tag and tag_arg, or neither")
        if self.tag is not None and not re.fullmatch(r"[a-z][a-z0-9_]{0,31}", self.tag):
            raise ValueError(f"tool {self.name!r}: tag {self.tag!r} must be a lower-case word")

    @property
    def stateful(self) -> bool:
        """Its calls carry the trajectory's earlier calls of it, which its child re-runs."""
        return self.replayable and not self.idempotent

    def stdin(self, args_json: str, history: Sequence[str] = ()) -> bytes:
        """What the child reads: `args_json` itself, or for a stateful tool
        `{"history": [...], "args": ...}`. `args_json` and each of `history` must be JSON
        objects already checked (SandboxServer checks them)."""
        if not self.stateful:
            return args_json.encode()
        return ('{"history":[' + ",".join(history) + '],"args":' + args_json + "}").encode()

    def openai_schema(self) -> dict[str, Any]:
        """The declaration as chat templates take it (`tools=[...]`)."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": dict(self.parameters),
            },
        }


@dataclass(frozen=True, slots=True)
class Invocation:
    """A well-formed call of a declared tool, its arguments valid against the schema."""

    tool: str
    args: dict[str, Any]
    idempotent: bool
    replayable: bool

    @property
    def stateful(self) -> bool:
        return self.replayable and not self.idempotent

    @property
    def args_json(self) -> str:
        return json.dumps(self.args, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class Refusal:
    """A call that cannot run. `body` ("error: why") is the observation's body the model
    sees instead of a result (`observation`: as text); `reason`: "unknown_tool",
    "malformed", "schema" or "history" (a stateful tool's call past MAX_HISTORY_*)."""

    reason: str
    body: str

    @property
    def observation(self) -> str:
        return render(self.body)


class ToolRegistry:
    """The tools a run declares, by name (and by shorthand tag)."""

    def __init__(self, tools: Iterable[ToolSpec] = ()) -> None:
        self._tools: dict[str, ToolSpec] = {}
        self._tags: dict[str, ToolSpec] = {}
        for tool in tools:
            self.register(tool)

    def register(self, tool: ToolSpec) -> None:
        if tool.name in self._tools:
            raise ValueError(f"tool {tool.name!r} is declared twice")
        if tool.tag is not None:
            if tool.tag in ("tool_call", "result"):
                raise ValueError(f"tool {tool.name!r}: tag <{tool.tag}> is taken")
            if tool.tag in self._tags:
                other = self._tags[tool.tag].name
                raise ValueError(
                    f"tool {tool.name!r}: tag <{tool.tag}> is taken (by {other!r}): "
                    "declare one of them"
                )
            self._tags[tool.tag] = tool
        self._tools[tool.name] = tool

    def get(self, name: str) -> ToolSpec | None:
        return self._tools.get(name)

    def names(self) -> list[str]:
        return sorted(self._tools)

    def __len__(self) -> int:
        return len(self._tools)

    def stop_strings(self) -> list[str]:
        """The strings that end a turn calling a tool (SamplingParams.stop)."""
        return [CALL_CLOSE, *(f"</{tag}>" for tag in sorted(self._tags))]

    def parse_call(self, text: str) -> Invocation | Refusal | None:
        """The tool call a turn's generated `text` ends with: None when it calls no tool
        (a final answer), an Invocation, or a Refusal whose observation says why not."""
        found = self._first_call(text)
        if found is None:
            return None
        kind, body = found
        if body is None:
            return _refuse("malformed", f"a call opened with <{kind}> is never closed")
        if len(body) > MAX_CALL_CHARS:
            return _refuse("malformed", f"a call is longer than {MAX_CALL_CHARS} characters")
        if kind == "tool_call":
            return self._parse_json_call(body)
        tool = self._tags[kind]
        assert tool.tag_arg is not None
        return self._checked(tool, {tool.tag_arg: body.strip()})

    def _first_call(self, text: str) -> tuple[str, str | None] | None:
        """(tag, body) of the first call in `text`; body None when it is never closed."""
        tags = [*self._tags, "tool_call"]
        opened = re.search("<(" + "|".join(re.escape(t) for t in tags) + ")>", text)
        if opened is None:
            return None
        kind = opened.group(1)
        end = text.find(f"</{kind}>", opened.end())
        return kind, (None if end < 0 else text[opened.end() : end])

    def _parse_json_call(self, body: str) -> Invocation | Refusal:
        try:
            call = json.loads(body)
        except (ValueError, RecursionError):
            return _refuse("malformed", "the call is not valid JSON")
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return _refuse("malformed", 'a call is {"name": ..., "arguments": {...}}')
        tool = self._tools.get(call["name"])
        if tool is None:
            known = ", ".join(self.names()) or "none"
            return _refuse("unknown_tool", f"unknown tool '{call['name'][:40]}' (tools: {known})")
        args = call.get("arguments", {})
        if isinstance(args, str):  # some templates write the arguments as a JSON string
            try:
                args = json.loads(args)
            except (ValueError, RecursionError):
                return _refuse("malformed", "the arguments are not valid JSON")
        return self._checked(tool, args)

    def _checked(self, tool: ToolSpec, args: Any) -> Invocation | Refusal:
        why = json_schema.validate(args, tool.parameters)
        if why is not None:
            return _refuse("schema", why)
        return Invocation(tool.name, args, tool.idempotent, tool.replayable)


def history_problem(tool: str, history: Sequence[str]) -> str | None:
    """Why a call of stateful `tool` cannot carry `history` (its earlier calls' arguments),
    or None: more than MAX_HISTORY_CALLS calls or MAX_HISTORY_BYTES bytes."""
    if len(history) > MAX_HISTORY_CALLS:
        return (
            f"tool '{tool}' replays at most {MAX_HISTORY_CALLS} earlier calls of a "
            f"trajectory (this call follows {len(history)})"
        )
    size = sum(len(h.encode()) for h in history)
    if size > MAX_HISTORY_BYTES:
        return (
            f"tool '{tool}' replays at most {MAX_HISTORY_BYTES} bytes of earlier calls of a "
            f"trajectory (this call follows {size})"
        )
    return None


def history_refusal(tool: str, history: Sequence[str]) -> Refusal | None:
    """The refusal (an observation the model sees) of a call of stateful `tool` that would
    carry `history` past the bounds, or None."""
    why = history_problem(tool, history)
    return None if why is None else _refuse("history", why)


def _refuse(reason: str, why: str) -> Refusal:
    # `why` may quote what the model wrote: keep it printable, like a tool's output
    return Refusal(reason, _NON_PRINTABLE.sub("?", f"error: {why}"))


def render(body: str) -> str:
    """The observation text the model sees: `<result>BODY</result>`."""
    return f"{RESULT_OPEN}{body}{RESULT_CLOSE}"


def observation_body(result: ToolResult) -> str:
    """The body of the observation for `result`: the tool's value when it succeeded, else
    `error: why`. Only printable ASCII and newlines are kept (the tiny tokenizer has no
    other characters; terminal escapes stay out of logs), at most MAX_OBSERVATION_CHARS."""
    text = result.text
    if result.status != "ok":
        why = text.removeprefix("error:").strip() or result.status.replace("_", " ")
        text = f"error: {why}"
    return _NON_PRINTABLE.sub("?", text[:MAX_OBSERVATION_CHARS])


CALCULATOR_SCHEMA: Mapping[str, Any] = {
    "type": "object",
    "properties": {"expression": {"type": "string", "maxLength": 200}},
    "required": ["expression"],
    "additionalProperties": False,
}


@cache
def calculator() -> ToolSpec:
    """The calculator (calculator.py's source is the child's program)."""
    program = (Path(__file__).parent / "calculator.py").read_text(encoding="utf-8")
    return ToolSpec(
        name="calculator",
        description="Evaluate an arithmetic expression: numbers, + - * / // % ** and ().",
        parameters=CALCULATOR_SCHEMA,
        program=program,
        idempotent=True,
        replayable=True,
        tag="calc",
        tag_arg="expression",
    )


MEMORY_OFF, MEMORY_ON = "\nMEMORY = False\n", "\nMEMORY = True\n"  # calculator.py's switch


@cache
def calc_memory() -> ToolSpec:
    """The calculator with a memory: `ans` is the last result (0 before any), so a call
    may build on the one before (`<calc>ans*2</calc>`). Stateful: its state is the fold
    of the trajectory's earlier calls of it, which each call carries and its child
    re-runs (calculator.py's `main_memory`; the same whitelisting evaluator, `ans` the
    only name). Its tag is the calculator's: a run declares one of the two."""
    source = (Path(__file__).parent / "calculator.py").read_text(encoding="utf-8")
    if source.count(MEMORY_OFF) != 1:
        raise RuntimeError("calculator.py: no single 'MEMORY = False' line to switch")
    return ToolSpec(
        name="calc_memory",
        description=(
            "Evaluate an arithmetic expression: numbers, ans (the last result), "
            "+ - * / // % ** and ()."
        ),
        parameters=CALCULATOR_SCHEMA,
        program=source.replace(MEMORY_OFF, MEMORY_ON),
        idempotent=False,
        replayable=True,
        tag="calc",
        tag_arg="expression",
    )


# name -> factory; ToolsConfig.tools picks from these
BUILTIN_TOOLS = {"calculator": calculator, "calc_memory": calc_memory}


def build_registry(names: Iterable[str]) -> ToolRegistry:
    """The registry of the built-in tools `names` (config `tools.tools`)."""
    unknown = [n for n in names if n not in BUILTIN_TOOLS]
    if unknown:
        raise ValueError(f"unknown tool(s) {unknown}; built in: {sorted(BUILTIN_TOOLS)}")
    return ToolRegistry(BUILTIN_TOOLS[n]() for n in names)
