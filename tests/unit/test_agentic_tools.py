"""Tool declarations, the JSON-schema subset, and reading calls out of generated text:
whatever the model writes becomes an Invocation, None, or a Refusal observation — never an
exception."""

from __future__ import annotations

import json

import pytest

from pivot_hpc.agentic import schema
from pivot_hpc.agentic.messages import ToolResult
from pivot_hpc.agentic.tools import (
    CALCULATOR_SCHEMA,
    Invocation,
    Refusal,
    ToolRegistry,
    ToolSpec,
    build_registry,
    observation_body,
    render,
)


@pytest.fixture(scope="module")
def registry() -> ToolRegistry:
    return build_registry(["calculator"])


def test_calc_shorthand(registry):
    call = registry.parse_call("I add them. <calc>47+38+96</calc>")
    assert call == Invocation("calculator", {"expression": "47+38+96"}, True, True)
    assert call.args_json == '{"expression":"47+38+96"}'


def test_json_call(registry):
    text = '<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>'
    assert registry.parse_call(text) == Invocation("calculator", {"expression": "2*3"}, True, True)
    # some templates write the arguments as a JSON string
    text = (
        '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1\\"}"}</tool_call>'
    )
    assert registry.parse_call(text).args == {"expression": "1"}


def test_no_call_is_a_final_answer(registry):
    assert registry.parse_call("7+8=15,4+3+1=8.Answer: 85") is None
    assert registry.parse_call("") is None


def test_stop_strings(registry):
    assert registry.stop_strings() == ["</tool_call>", "</calc>"]


def _refusal(registry, text: str, reason: str) -> str:
    out = registry.parse_call(text)
    assert isinstance(out, Refusal), out
    assert out.reason == reason
    assert out.observation.startswith("<result>error: ") and out.observation.endswith("</result>")
    return out.observation


def test_unknown_tool(registry):
    obs = _refusal(
        registry, '<tool_call>{"name": "search", "arguments": {}}</tool_call>', "unknown_tool"
    )
    assert "unknown tool 'search'" in obs and "calculator" in obs


@pytest.mark.parametrize(
    "text",
    [
        "<calc>1+1",  # never closed
        "<tool_call>{not json</tool_call>",
        "<tool_call>[1, 2]</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": 3}</tool_call>',
        '<tool_call>{"name": "calculator", "arguments": "{bad"}</tool_call>',
        "<tool_call>" + "[" * 2000 + "]" * 2000 + "</tool_call>",  # deep JSON
        "<tool_call>" + " " * 5000 + "</tool_call>",  # too long to read
    ],
)
def test_malformed_calls(registry, text):
    _refusal(registry, text, "malformed")


@pytest.mark.parametrize(
    ("args", "why"),
    [
        ({"expression": 5}, "expected string"),
        ({}, "missing required 'expression'"),
        ({"expression": "1", "shell": "rm"}, "unexpected 'shell'"),
        ({"expression": "1" * 201}, "longer than 200"),
        ([1], "expected object"),
    ],
)
def test_schema_failures(registry, args, why):
    text = "<tool_call>" + json.dumps({"name": "calculator", "arguments": args}) + "</tool_call>"
    assert why in _refusal(registry, text, "schema")


def test_shorthand_schema_failure(registry):
    assert "longer than 200" in _refusal(registry, "<calc>" + "1" * 300 + "</calc>", "schema")


def test_refusals_quote_only_printable_text(registry):
    obs = _refusal(
        registry, '<tool_call>{"name": "\\u001b]52;c;x\\u0007"}</tool_call>', "unknown_tool"
    )
    assert "\x1b" not in obs and "\x07" not in obs


@pytest.mark.parametrize(
    ("result", "body"),
    [
        (ToolResult(1, "ok", "181", 0.1), "181"),
        (ToolResult(1, "error", "error: division by zero", 0.1), "error: division by zero"),
        (ToolResult(1, "timeout", "timed out after 5 s", 5.0), "error: timed out after 5 s"),
        (ToolResult(1, "crash", "", 0.1), "error: crash"),
        (ToolResult(1, "output_limit", "", 0.1), "error: output limit"),
        (ToolResult(1, "ok", "a\x1b[2Jb\u00e9", 0.1), "a?[2Jb?"),
    ],
)
def test_observation_body(result, body):
    assert observation_body(result) == body
    assert render(body) == f"<result>{body}</result>"


def test_schema_subset():
    s = {"type": "object", "properties": {"op": {"type": "string", "enum": ["add", "mul"]}}}
    schema.check_schema(s)
    assert schema.validate({"op": "add"}, s) is None
    assert "one of" in schema.validate({"op": "div"}, s)
    assert "expected integer" in schema.validate(True, {"type": "integer"})
    assert schema.validate(3, {"type": "number"}) is None
    assert "[1]" in schema.validate([1, "x"], {"type": "array", "items": {"type": "integer"}})
    with pytest.raises(ValueError, match="unsupported keyword"):
        schema.check_schema({"type": "string", "pattern": "^a$"})
    with pytest.raises(ValueError, match="additionalProperties"):
        schema.check_schema({"type": "object", "additionalProperties": {"type": "string"}})


def test_declarations_are_checked():
    with pytest.raises(ValueError, match="tool name"):
        ToolSpec(name="rm -rf", description="", parameters=CALCULATOR_SCHEMA, program="")
    with pytest.raises(ValueError, match="object schema"):
        ToolSpec(name="t", description="", parameters={"type": "string"}, program="")
    spec = ToolSpec(
        name="t",
        description="d",
        parameters=CALCULATOR_SCHEMA,
        program="",
        tag="calc",
        tag_arg="expression",
    )
    with pytest.raises(ValueError, match="taken"):
        ToolRegistry([build_registry(["calculator"]).get("calculator"), spec])
    with pytest.raises(ValueError, match="unknown tool"):
        build_registry(["calculator", "shell"])
    assert spec.openai_schema()["function"]["name"] == "t"
