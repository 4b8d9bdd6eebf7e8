"""Each config key's documentation, read from the comments of its dataclass field.

The one documentation style of the config: a field's doc is its trailing comment, or the
comment lines right above it (both, joined, when it has both); a section's doc is its
dataclass's docstring. `pivot-hpc config show` prints them beside the resolved values.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import textwrap
import tokenize
from typing import Any


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """field name -> its comment text ("" when it has none)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    comments: dict[int, str] = {}  # line -> comment text
    code_lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT):
            code_lines.update(range(tok.start[0], tok.end[0] + 1))
    out: dict[str, str] = {}
    (node,) = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)][:1]
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above = []
        line = stmt.lineno - 1
        while line in comments and line not in code_lines:
            above.insert(0, comments[line])
            line -= 1
        trailing = [comments[n] for n in range(stmt.lineno, stmt.end_lineno + 1) if n in comments]
        text = " ".join(above + trailing)
        out[stmt.target.id] = text.replace("(fmt: skip)", "").strip()
    return out


def section_doc(cls: type) -> str:
    return " ".join((inspect.getdoc(cls) or "").split())


@dataclasses.dataclass(frozen=True)
class Entry:
    key: str  # dotted path
    value: Any  # resolved value (plain data)
    default: Any  # the dataclass default (plain data), or MISSING
    doc: str
    section: bool  # a dataclass (its children follow)


def entries(obj: Any, prefix: str = "") -> list[Entry]:
    """Every key of a config tree, depth first in declaration order."""
    from pivot_hpc.config.loader import to_dict

    out: list[Entry] = []
    docs = field_docs(type(obj))
    for f in dataclasses.fields(obj):
        key = f"{prefix}.{f.name}" if prefix else f.name
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            doc = docs.get(f.name) or section_doc(type(value))
            out.append(Entry(key, None, None, doc, True))
            out.extend(entries(value, key))
            continue
        if f.default is not dataclasses.MISSING:
            default = to_dict(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = to_dict(f.default_factory())
        else:
            default = dataclasses.MISSING
        out.append(Entry(key, to_dict(value), default, docs.get(f.name, ""), False))
    return out
