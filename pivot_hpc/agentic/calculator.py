"""The calculator tool: a whitelisting arithmetic evaluator.

Only numbers, + - * / // % **, unary plus/minus and parentheses are evaluated; every other
syntax (names, attributes, calls, subscripts, strings, `__import__('os')`) is refused before
anything runs. Exponents and results are bounded *before* each operation, so `9**9**9` is
refused in microseconds instead of filling memory.

This file is also the program the sandbox child runs (sandbox.py executes its source with
`python -I -S`, where pivot_hpc is not importable): it therefore imports nothing but the
standard library. Run as a program it reads `{"expression": "..."}` on stdin and writes
the value on stdout (exit 0), or `error: why` (exit 1).

It is also `calc_memory`'s program (tools.py sets MEMORY), a stateful tool whose
state is `ans`, the last result (0 before any): an expression may use the name `ans` and
nothing else. Its state is the fold of the trajectory's earlier calls of it, which the
call carries (`main_memory`: `{"history": [args, ...], "args": {...}}` on stdin): the
child evaluates them in order, discarding their values (a refused one leaves `ans` as it
was), then the call itself, so no state outlives the child.
"""

from __future__ import annotations

import ast
import json
import math
import sys

MAX_EXPRESSION_CHARS = 200  # a call the model writes; longer is refused, not parsed
MAX_NODES = 100  # syntax-tree nodes of one expression
MAX_INT_BITS = 1024  # |integer| results stay below 2**1024 (309 digits)
MAX_EXPONENT = 1024  # |exponent| of **
MAX_STDIN_CHARS = 64 * 1024  # calc_memory's payload, its history included
# calc_memory's program is this source with this line set to True (tools.py)
MEMORY = False
MEMORY_NAME = "ans"  # the name of the last result in calc_memory's expressions


class CalcError(ValueError):
    """The expression is refused or cannot be evaluated; the message is the observation."""


_BINARY = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow)
_UNARY = (ast.UAdd, ast.USub)


def _check_size(value: int | float) -> int | float:
    if isinstance(value, complex):  # (-8) ** 0.5
        raise CalcError("result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalcError("result is too large")
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise CalcError("result is too large")
    return value


def _bits(value: int | float) -> int:
    if isinstance(value, int):
        return value.bit_length()
    return max(0, math.frexp(value)[1])  # binary exponent of a float


def _binary(op: ast.operator, a: int | float, b: int | float) -> int | float:
    # Refuse before computing: a product or power of huge ints costs time and memory.
    if isinstance(op, ast.Pow):
        if abs(b) > MAX_EXPONENT:
            raise CalcError(f"exponent beyond {MAX_EXPONENT}")
        if isinstance(a, int) and isinstance(b, int) and b > 0 and _bits(a) * b > MAX_INT_BITS:
            raise CalcError("result is too large")
        if a == 0 and b < 0:
            raise CalcError("division by zero")
    elif isinstance(op, ast.Mult):
        if isinstance(a, int) and isinstance(b, int) and _bits(a) + _bits(b) > MAX_INT_BITS + 1:
            raise CalcError("result is too large")
    elif isinstance(op, ast.Div | ast.FloorDiv | ast.Mod) and b == 0:
        raise CalcError("division by zero")
    try:
        if isinstance(op, ast.Add):
            out = a + b
        elif isinstance(op, ast.Sub):
            out = a - b
        elif isinstance(op, ast.Mult):
            out = a * b
        elif isinstance(op, ast.Div):
            out = a / b
        elif isinstance(op, ast.FloorDiv):
            out = a // b
        elif isinstance(op, ast.Mod):
            out = a % b
        else:
            out = a**b
    except OverflowError:
        raise CalcError("result is too large") from None
    except ArithmeticError as exc:
        raise CalcError(str(exc) or "arithmetic error") from None
    return _check_size(out)


Names = dict[str, int | float]


def _eval(node: ast.AST, names: Names | None = None) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body, names)
    if isinstance(node, ast.Name) and names is not None:
        if node.id not in names:
            raise CalcError(f"unknown name '{node.id[:40]}' (only {', '.join(sorted(names))})")
        return _check_size(names[node.id])
    if isinstance(node, ast.Constant):
        value = node.value
        # bool is an int subclass: True + True is not arithmetic the model should write
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise CalcError(f"only numbers are allowed, not {type(value).__name__}")
        return _check_size(value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, _UNARY):
        value = _eval(node.operand, names)
        return -value if isinstance(node.op, ast.USub) else +value
    if isinstance(node, ast.BinOp) and isinstance(node.op, _BINARY):
        return _binary(node.op, _eval(node.left, names), _eval(node.right, names))
    allowed = "".join(f", {n}" for n in sorted(names or ()))
    raise CalcError(
        f"{type(node).__name__} is not allowed (numbers{allowed} and + - * / // % ** only)"
    )


def evaluate(expression: str, names: Names | None = None) -> int | float:
    """The value of `expression`, or CalcError saying why it was refused. `names`: the
    only names it may use and their values (calc_memory's `ans`); none by default."""
    if not isinstance(expression, str):
        raise CalcError("the expression must be a string")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalcError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise CalcError("not an arithmetic expression") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalcError(f"expression has more than {MAX_NODES} parts")
    return _eval(tree, names)


def format_value(value: int | float) -> str:
    """181, 0.25, 3 (for 6/2): integral floats print as integers, others with 12 digits."""
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return format(value, ".12g")
    return str(value)


def main() -> int:
    """The sandbox child: `{"expression": ...}` on stdin → the value on stdout."""
    try:
        # room for the arguments of the longest expression, JSON escapes (6 chars) included
        args = json.loads(sys.stdin.read(8 * MAX_EXPRESSION_CHARS + 64))
        expression = args["expression"] if isinstance(args, dict) else None
        sys.stdout.write(format_value(evaluate(expression)))
        return 0
    except (ValueError, KeyError, RecursionError) as exc:
        why = str(exc) if isinstance(exc, CalcError) else "malformed arguments"
        sys.stdout.write(f"error: {why}")
        return 1


def fold(history: list, ans: int | float = 0) -> int | float:
    """calc_memory's state after the calls `history` (their arguments, in order):
    each evaluated with the `ans` before it, its value discarded but kept as the next
    `ans`; a refused one leaves `ans` as it was, as it did when it was first called."""
    for past in history:
        try:
            expression = past.get("expression") if isinstance(past, dict) else None
            ans = evaluate(expression, {MEMORY_NAME: ans})
        except (CalcError, RecursionError):
            continue
    return ans


def main_memory() -> int:
    """calc_memory's child: `{"history": [...], "args": {...}}` on stdin → the value
    of args' expression, with `ans` rebuilt from the history, on stdout."""
    try:
        payload = json.loads(sys.stdin.read(MAX_STDIN_CHARS + 1))
        if not isinstance(payload, dict) or not isinstance(payload.get("history"), list):
            raise ValueError("malformed")
        args = payload.get("args")
        expression = args["expression"] if isinstance(args, dict) else None
        ans = fold(payload["history"])
        sys.stdout.write(format_value(evaluate(expression, {MEMORY_NAME: ans})))
        return 0
    except (ValueError, KeyError, RecursionError) as exc:
        why = str(exc) if isinstance(exc, CalcError) else "malformed arguments"
        sys.stdout.write(f"error: {why}")
        return 1


if __name__ == "__main__":
    sys.exit(main_memory() if MEMORY else main())
