"""Tool declarations, the registry, and reading a tool call out of generated text.

A turn that calls a tool ends at the call's closing tag (a stop string). Two call formats
are read:

    <calc>47+38+96</calc>                                  the tiny default's shorthand
    <tool_call>{"name": "calculator", "arguments": {"expression": "47+38"}}</tool_call>

and the model sees the outcome as `<result>181</result>` (or `<result>error: why</result>`).
Whatever the model writes — an undeclared tool, a malformed call, arguments that fail the
schema — becomes such an observation (`Refusal`), never an exception.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
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
_NON_PRINTABLE = re.compile(r"[^\n\x20-\x7e]")


@dataclass(frozen=True)
class ToolSpec:
    """One tool. `program` is the Python source the sandbox child runs: it reads the
    arguments (a JSON object) on stdin and writes its value on stdout, exiting 0, or a
    message and exit 1. It imports only the standard library (the child runs `python -I
    -S`). `tag`: a shorthand `<tag>TEXT</tag>` that calls the tool with {tag_arg: TEXT}.

    `idempotent`: running a call twice gives the same result and no side effect, so a call
    pending at a checkpoint is simply issued again on resume. `replayable`: the tool keeps
    state, but re-running a trajectory's calls in order rebuilds it. A trajectory parked at
    a checkpoint on a tool that is not idempotent is dropped and its group resampled
    (`resume_group` in trajectory.py): each call runs in a fresh sandbox child, so there is
    no state for a replay to rebuild yet, and replayable is recorded for when there is."""

    name: str
    description: str
    parameters: Mapping[str, Any]  # JSON schema of the arguments (schema.py's subset)
    program: str = field(repr=False)
    idempotent: bool = True
    replayable: bool = True
    tag: str | None = None
    tag_arg: str | None = None

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}", self.name):
            raise ValueError(f"tool name {self.name!r}: letters, digits, _ . - only")
        json_schema.check_schema(self.parameters, f"tool {self.name!r} parameters")
        if self.parameters.get("type") != "object":
            raise ValueError(f"tool {self.name!r}: parameters must be a JSON object schema")
        if (self.tag is None) != (self.tag_arg is None):
            raise ValueError(f"tool {self.name!r}: give both tag and tag_arg, or neither")
        if self.tag is not None and not re.fullmatch(r"[a-z][a-z0-9_]{0,31}", self.tag):
            raise ValueError(f"tool {self.name!r}: tag {self.tag!r} must be a lower-case word")

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
    def args_json(self) -> str:
        return json.dumps(self.args, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class Refusal:
    """A call that cannot run. `body` ("error: why") is the observation's body the model
    sees instead of a result (`observation`: as text); `reason`: "unknown_tool",
    "malformed" or "schema"."""

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
            if tool.tag in self._tags or tool.tag in ("tool_call", "result"):
                raise ValueError(f"tool {tool.name!r}: tag <{tool.tag}> is taken")
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


BUILTIN_TOOLS = {"calculator": calculator}  # name -> factory; ToolsConfig.tools picks from these


def build_registry(names: Iterable[str]) -> ToolRegistry:
    """The registry of the built-in tools `names` (config `tools.tools`)."""
    unknown = [n for n in names if n not in BUILTIN_TOOLS]
    if unknown:
        raise ValueError(f"unknown tool(s) {unknown}; built in: {sorted(BUILTIN_TOOLS)}")
    return ToolRegistry(BUILTIN_TOOLS[n]() for n in names)
