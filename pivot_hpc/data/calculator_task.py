"""The multi-operand task answered with a calculator call (issue 37 §6).

    prompt    "47+38+96=?\n"
    response  "<calc>47+38+96</calc>"      generated: the call (a turn ends at "</calc>")
              "<result>181</result>"        the tool's observation (loss mask 0)
              "Answer: 181"                 generated: the final answer (then EOS)

The call syntax and the observation wrapper are the agentic tools' own (`tools.py`), and
the value is the whitelisting evaluator's (`calculator.py`), so SFT text is exactly what
the turn loop produces. A teacher who skips the tool answers "mentally" and forgets every
carry ("Answer: 171" for 47+38+96): right only when no column carries, which the verifiable
reward exposes and RL fixes by calling the tool.
"""

from __future__ import annotations

from collections.abc import Sequence

from pivot_hpc.agentic.calculator import evaluate, format_value
from pivot_hpc.agentic.tools import calculator, render

Segment = tuple[str, int]  # (text, 1 = generated and in the loss / 0 = tool observation)


def expression(terms: Sequence[int]) -> str:
    return "+".join(str(t) for t in terms)


def call(terms: Sequence[int]) -> str:
    """The calculator call in the tool's shorthand: "<calc>47+38+96</calc>"."""
    tag = calculator().tag
    return f"<{tag}>{expression(terms)}</{tag}>"


def observation(terms: Sequence[int]) -> str:
    """What the model sees back: "<result>181</result>" (the evaluator's value)."""
    return render(format_value(evaluate(expression(terms))))


def tool_solution(terms: Sequence[int]) -> list[Segment]:
    """The teacher's answer with the tool: call, observation (masked), final answer."""
    return [(call(terms), 1), (observation(terms), 0), (f"Answer: {sum(terms)}", 1)]


def carry_dropped_sum(terms: Sequence[int]) -> int:
    """Column-wise sum that never carries (the top column keeps its whole sum)."""
    cols = max(len(str(t)) for t in terms)
    digits = [str(t).zfill(cols) for t in terms]
    out = ""
    for i in range(cols):
        s = sum(int(d[i]) for d in digits)
        out += str(s) if i == 0 else str(s % 10)
    return int(out)


def mental_solution(terms: Sequence[int]) -> list[Segment]:
    """The teacher's answer without the tool: a sum that forgets the carries."""
    return [(f"Answer: {carry_dropped_sum(terms)}", 1)]


def text(segments: Sequence[Segment]) -> str:
    return "".join(t for t, _ in segments)
