"""The small subset of JSON Schema that tool arguments are declared with.

Supported keywords: `type` (object, string, integer, number, boolean, array, null),
`properties`, `required`, `additionalProperties: false`, `items`, `maxLength`, `enum`.
Anything else in a schema is refused when the tool is declared (`check_schema`), so a
keyword is never silently ignored at call time. No dependency: the arguments of a tool
call are small, and the validator must never raise on them (`validate` returns a reason).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "null": (type(None),),
}
_KEYWORDS = frozenset(
    {
        "type",
        "properties",
        "required",
        "additionalProperties",
        "items",
        "maxLength",
        "enum",
        "description",
    }
)
MAX_DEPTH = 8  # schemas and arguments nest at most this deep


def check_schema(schema: Any, where: str = "schema") -> None:
    """Raise ValueError when `schema` uses something this subset does not implement."""
    if not isinstance(schema, Mapping):
        raise ValueError(f"{where}: a schema is a mapping")
    unknown = set(schema) - _KEYWORDS
    if unknown:
        raise ValueError(f"{where}: unsupported keyword(s) {sorted(unknown)}")
    tp = schema.get("type")
    if tp is not None and tp not in _TYPES:
        raise ValueError(f"{where}: unknown type {tp!r}")
    if schema.get("additionalProperties", False) is not False:
        raise ValueError(f"{where}: only additionalProperties: false is supported")
    for name, sub in schema.get("properties", {}).items():
        check_schema(sub, f"{where}.properties.{name}")
    if "items" in schema:
        check_schema(schema["items"], f"{where}.items")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ValueError(f"{where}: required is a list of names")
    if "maxLength" in schema and not isinstance(schema["maxLength"], int):
        raise ValueError(f"{where}: maxLength is an integer")
    if "enum" in schema and not isinstance(schema["enum"], list):
        raise ValueError(f"{where}: enum is a list")


def _is_type(value: Any, tp: str) -> bool:
    if tp in ("integer", "number") and isinstance(value, bool):
        return False  # JSON's true is not a number
    return isinstance(value, _TYPES[tp])


def validate(value: Any, schema: Mapping[str, Any], where: str = "arguments") -> str | None:
    """None when `value` satisfies `schema`, else the first reason it does not (one line)."""
    return _validate(value, schema, where, 0)


def _validate(value: Any, schema: Mapping[str, Any], where: str, depth: int) -> str | None:
    if depth > MAX_DEPTH:
        return f"{where}: nested too deeply"
    tp = schema.get("type")
    if tp is not None and not _is_type(value, tp):
        return f"{where}: expected {tp}, got {_json_type(value)}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{where}: must be one of {schema['enum']}"
    if isinstance(value, str) and len(value) > schema.get("maxLength", len(value)):
        return f"{where}: longer than {schema['maxLength']} characters"
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for name in schema.get("required", []):
            if name not in value:
                return f"{where}: missing required '{name}'"
        for name, item in value.items():
            if name in props:
                why = _validate(item, props[name], f"{where}.{name}", depth + 1)
                if why:
                    return why
            elif schema.get("additionalProperties", True) is False:
                return f"{where}: unexpected '{str(name)[:40]}'"
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            why = _validate(item, schema["items"], f"{where}[{i}]", depth + 1)
            if why:
                return why
    return None


def _json_type(value: Any) -> str:
    for name in _TYPES:
        if _is_type(value, name):
            return name
    return type(value).__name__
