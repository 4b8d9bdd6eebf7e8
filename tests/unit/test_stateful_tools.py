"""Stateful tools (issue 37 §5): `calc_memory`, whose state is `ans`, the fold of the
trajectory's earlier calls of it. Each call carries those calls (`ToolCall.history`) and
its one fresh sandbox child re-runs them first, so its result depends on the history and
no tool process outlives a call. The history is bounded: past the bounds the model sees
an error observation, the server answers "error", nothing raises. The stateless
calculator's protocol is unchanged."""

from __future__ import annotations

import json

import pytest

from pivot_hpc.agentic import tools as agentic_tools
from pivot_hpc.agentic.calculator import CalcError, evaluate, fold, format_value
from pivot_hpc.agentic.config import ToolsConfig
from pivot_hpc.agentic.messages import ToolCall, ToolResult
from pivot_hpc.agentic.sandbox import SandboxLimits
from pivot_hpc.agentic.server import SandboxServer, preflight
from pivot_hpc.agentic.service import decode_call, encode
from pivot_hpc.agentic.tools import (
    MAX_HISTORY_BYTES,
    MAX_HISTORY_CALLS,
    build_registry,
    calc_memory,
    calculator,
)
from pivot_hpc.data.problem import Problem
from pivot_hpc.engines.base import SeqResult
from pivot_hpc.errors import ConfigError
from pivot_hpc.models.tokenizer import build_tokenizer
from pivot_hpc.rl.config import RLConfig
from pivot_hpc.runtime.live_samples import LiveSamples

TOK = build_tokenizer()


def args(expression: str) -> str:
    return json.dumps({"expression": expression}, sort_keys=True, separators=(",", ":"))


# ------------------------------------------------------------------ the tool
def test_calc_memory_is_declared_stateful_and_keeps_the_calculators_tag() -> None:
    spec = calc_memory()
    assert (spec.idempotent, spec.replayable, spec.stateful) == (False, True, True)
    assert spec.tag == "calc" and spec.parameters == calculator().parameters
    assert not calculator().stateful
    registry = build_registry(["calc_memory"])
    parsed = registry.parse_call("<calc>ans*2</calc>")
    assert parsed is not None and not hasattr(parsed, "body")
    assert parsed.tool == "calc_memory" and parsed.stateful
    # the child reads the history and the call; the stateless calculator its arguments alone
    assert json.loads(spec.stdin(args("ans+1"), [args("2")])) == {
        "history": [{"expression": "2"}],
        "args": {"expression": "ans+1"},
    }
    assert calculator().stdin(args("1+1"), ()) == args("1+1").encode()


def test_the_evaluator_still_whitelists_with_ans() -> None:
    ans = {"ans": 6}
    assert format_value(evaluate("ans*7+1", ans)) == "43"
    for refused in ("__import__('os')", "x", "ans.real", "ans()", "[ans]", "ans if 1 else 2"):
        with pytest.raises(CalcError):
            evaluate(refused, ans)
    with pytest.raises(CalcError, match="unknown name 'os'"):
        evaluate("os", ans)
    with pytest.raises(CalcError, match="Name is not allowed"):
        evaluate("ans")  # the plain calculator knows no name
    with pytest.raises(CalcError, match="too large"):
        evaluate("ans*ans", {"ans": 2**1000})


def test_the_state_is_the_fold_of_the_history() -> None:
    assert fold([]) == 0
    assert fold([{"expression": "2*3"}, {"expression": "ans*ans"}]) == 36
    # a refused call leaves ans as it was (as when it was first called); junk is skipped
    assert fold([{"expression": "5"}, {"expression": "1/0"}, "junk", {"expression": "ans+1"}]) == 6


@pytest.mark.timeout(60)
def test_the_sandboxed_results_depend_on_the_history() -> None:
    """The same call, three histories, three results; each in one fresh child."""
    registry = build_registry(["calc_memory"])
    with SandboxServer(registry, SandboxLimits()) as server:

        def run(expression: str, *history: str) -> ToolResult:
            call = ToolCall(1, 1, "calc_memory", args(expression), 5.0, history)
            return server.call(call)

        results = [
            run("ans+1"),
            run("ans+1", args("6*7")),
            run("ans+1", args("6*7"), args("ans*2"), args("1/0")),
            run("__import__('os')", args("1")),
            run("y", args("1")),
        ]
    assert [(r.status, r.text) for r in results[:3]] == [("ok", "1"), ("ok", "43"), ("ok", "85")]
    assert results[3].status == "error" and "Call is not allowed" in results[3].text
    assert results[4].status == "error" and "unknown name 'y'" in results[4].text


@pytest.mark.timeout(60)
def test_the_server_refuses_a_history_it_cannot_take_with_an_error_result() -> None:
    registry = build_registry(["calc_memory"])
    plain = build_registry(["calculator"])
    too_many = tuple(args("1") for _ in range(MAX_HISTORY_CALLS + 1))
    escaped = args("\u00e9" * 200)  # within the schema's 200 characters, 1.2 kB as JSON
    too_big = (escaped,) * (MAX_HISTORY_BYTES // len(escaped) + 1)
    assert len(too_big) <= MAX_HISTORY_CALLS
    with SandboxServer(registry, SandboxLimits()) as server:
        over = server.call(ToolCall(1, 1, "calc_memory", args("1"), 5.0, too_many))
        big = server.call(ToolCall(2, 1, "calc_memory", args("1"), 5.0, too_big))
        bad = server.call(ToolCall(3, 1, "calc_memory", args("1"), 5.0, ('{"x": 1}',)))
        broken = server.call(ToolCall(4, 1, "calc_memory", args("1"), 5.0, ("{",)))
        fine = server.call(ToolCall(5, 1, "calc_memory", args("ans"), 5.0, too_many[:-1]))
    with SandboxServer(plain, SandboxLimits()) as server:
        stateless = server.call(ToolCall(6, 1, "calculator", args("1"), 5.0, (args("1"),)))
    assert over.status == "error" and f"at most {MAX_HISTORY_CALLS} earlier calls" in over.text
    assert big.status == "error" and f"at most {MAX_HISTORY_BYTES} bytes" in big.text
    assert bad.status == "error" and bad.text.startswith("history[0]: ")
    assert broken.status == "error" and "history[0]" in broken.text
    assert over.seconds == big.seconds == bad.seconds == 0.0  # no child was started
    assert (fine.status, fine.text) == ("ok", "1")  # the most it carries
    assert stateless.status == "error" and "keeps no state" in stateless.text


@pytest.mark.timeout(60)
def test_preflight_runs_the_stateful_tool() -> None:
    assert preflight(build_registry(["calc_memory"]), SandboxLimits()) is None


def test_a_call_crosses_the_services_wire_with_its_history() -> None:
    call = ToolCall(3, 4, "calc_memory", args("ans"), 5.0, (args("1"), args("ans+1")))
    assert decode_call(encode(call)) == call
    old = b'{"call_id":1,"traj_id":2,"tool":"calculator","args_json":"{}","deadline_s":5.0}'
    assert decode_call(old).history == ()  # a line without it: no history
    with pytest.raises(ValueError, match="history"):
        decode_call(old[:-1] + b',"history":"{}"}')


# ------------------------------------------------------------------ config
def test_the_config_selects_it_and_refuses_it_beside_the_calculator() -> None:
    ToolsConfig(enabled=True, tools=("calc_memory",)).validate("tools")
    with pytest.raises(ConfigError, match=r"tag <calc> is taken \(by 'calculator'\)"):
        ToolsConfig(enabled=True, tools=("calculator", "calc_memory")).validate("tools")


# ------------------------------------------------------------------ the live source
def memory_source() -> LiveSamples:
    cfg = ToolsConfig(enabled=True, tools=("calc_memory",), max_turns=8)
    return LiveSamples([Problem("What is 6*7+1? ", "43")], TOK, RLConfig(), tools=cfg)


def turn(src: LiveSamples, s, text: str, call_id: int):
    out = [*TOK.encode(text, add_special_tokens=False), TOK.eos_token_id]
    res = SeqResult(s.sample_id, s.payload.traj.context_ids(), out, [-0.1] * len(out), "stop")
    return src.turn(s, len(out), res, call_id)


def test_each_call_carries_the_answered_calls_before_it() -> None:
    src = memory_source()
    s = src.make(0, 0, 0, 0)
    first = turn(src, s, "<calc>6*7</calc>", 0)
    assert (first.kind, first.history) == ("call", ())
    src.observe(s, ToolResult(0, "ok", "42", 0.01))
    assert turn(src, s, "<tool_call>oops</tool_call>", 1).kind == "again"  # never ran
    second = turn(src, s, "<calc>ans/0</calc>", 2)
    assert second.history == (args("6*7"),)
    src.observe(s, ToolResult(2, "error", "error: division by zero", 0.01))
    third = turn(src, s, "<calc>9**9**9</calc>", 3)  # the tool answered: in the history
    assert third.history == (args("6*7"), args("ans/0"))
    src.observe(s, ToolResult(3, "timeout", "timed out after 5 s", 5.0))
    fourth = turn(src, s, "<calc>ans+1</calc>", 4)  # a call that did not finish: left out
    assert fourth.history == (args("6*7"), args("ans/0"))


def test_a_call_past_the_history_bound_is_an_error_observation(monkeypatch) -> None:
    monkeypatch.setattr(agentic_tools, "MAX_HISTORY_CALLS", 1)
    src = memory_source()
    s = src.make(0, 0, 0, 0)
    for i, expression in enumerate(("1", "ans+1")):
        assert turn(src, s, f"<calc>{expression}</calc>", i).kind == "call"
        src.observe(s, ToolResult(i, "ok", str(i + 1), 0.01))
    refused = turn(src, s, "<calc>ans+1</calc>", 2)
    assert refused.kind == "again"  # not run; the model reads why, and goes on
    traj = s.payload.traj
    assert traj.state == "gen" and len(traj.calls) == 2
    seen = TOK.decode(traj.segments[-1].token_ids)  # cut to max_tool_output_tokens
    assert seen.startswith("<result>error: tool 'calc_memory' replays at most")
    assert seen.endswith("</result>")
