"""The calculator tool: a whitelisting arithmetic evaluator.

Only numbers, + - * / // % **, unary plus/minus and parentheses are evaluated; every other
syntax (names, attributes, calls, subscripts, strings, `__import__('os')`) is refused before
anything runs. Exponents and results are bounded *before* each operation, so `9**9**9` is
refused in microseconds instead of filling memory.

This file is also the program the sandbox child runs (sandbox.py executes its source with
`python -I -S`, where pivot_hpc is not importable): it therefore imports nothing but the
standard library. Run as a program it reads `{"expression": "..."}` on stdin and writes
the value on stdout (exit 0), or `error: why` (exit 1).
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


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant):
        value = node.value
        # bool is an int subclass: True + True is not arithmetic the model should write
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise CalcError(f"only numbers are allowed, not {type(value).__name__}")
        return _check_size(value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, _UNARY):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else +value
    if isinstance(node, ast.BinOp) and isinstance(node.op, _BINARY):
        return _binary(node.op, _eval(node.left), _eval(node.right))
    raise CalcError(f"{type(node).__name__} is not allowed (numbers and + - * / // % ** only)")


def evaluate(expression: str) -> int | float:
    """The value of `expression`, or CalcError saying why it was refused."""
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
    return _eval(tree)


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


if __name__ == "__main__":
    sys.exit(main())
