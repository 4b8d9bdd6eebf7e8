"""Typed config loading: YAML (safe, alias-free) → nested dataclasses, dotted CLI overrides.

Every component owns one dataclass. This module turns plain data into those dataclasses
and rejects anything it cannot place: unknown keys (with the list of valid ones), wrong
types, values outside a Literal's choices. Errors always name the dotted key path.
Cross-field rules live in each dataclass's `validate(path)` method, called once, top
down, by `validate_config` before any MPI work starts.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from pivot_hpc.errors import (  # noqa: F401 (re-exported)
    MAX_SHOWN_CHARS,
    ConfigError,
    PivotError,
    fail,
    short_repr,
)

T = TypeVar("T")

# Bounds on YAML the project reads (configs, overrides, profiles, checkpoint configs): far
# above any real file, far below what would hang the pure-Python parser or fill memory.
MAX_YAML_CHARS = 8 * 2**20
MAX_YAML_DEPTH = 100  # real configs nest about 5 levels
MAX_YAML_INT_CHARS = 100  # Python refuses int(str) over 4300 digits with a ValueError


class YamlRefused(yaml.MarkedYAMLError):
    """Valid YAML this project does not accept (aliases, absurd nesting or numbers)."""


class _SafeNoAliasLoader(yaml.SafeLoader):
    """yaml.SafeLoader without anchors or aliases, with a nesting cap.

    An alias makes the composer share one node, which `_flatten`, `to_dict` and error
    messages then expand: 9 levels of 9 aliases are 370 bytes and a billion values. No
    config needs them, so the first anchor is refused before anything is built."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise YamlRefused(
                problem="YAML anchors and aliases (&name, *name, <<: *name) are not "
                "supported; write the values out in full",
                problem_mark=event.start_mark,
            )
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise YamlRefused(
                    problem=f"nested more than {MAX_YAML_DEPTH} levels deep; flatten it",
                    problem_mark=event.start_mark,
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        if len(node.value) > MAX_YAML_INT_CHARS:
            raise YamlRefused(
                problem=f"an integer of {len(node.value)} characters is too long (at most "
                f"{MAX_YAML_INT_CHARS})",
                problem_mark=node.start_mark,
            )
        return super().construct_yaml_int(node)


_SafeNoAliasLoader.add_constructor("tag:yaml.org,2002:int", _SafeNoAliasLoader.construct_yaml_int)


def _parse_yaml(text: str) -> Any:
    """`yaml.safe_load` without aliases; every failure is a yaml.YAMLError (RecursionError
    and ValueError included), refusals a YamlRefused."""
    if len(text) > MAX_YAML_CHARS:
        raise YamlRefused(
            problem=f"{len(text)} characters is more than the {MAX_YAML_CHARS} this reader takes"
        )
    loader = _SafeNoAliasLoader(text)
    try:
        return loader.get_single_data()
    except RecursionError:  # a deep structure on an already deep stack
        raise YamlRefused(problem="nested too deeply; flatten it") from None
    except ValueError as exc:  # e.g. Python's int-str digit limit inside a constructor
        raise YamlRefused(problem=f"a value cannot be read ({_first_line(exc)})") from None
    finally:
        loader.dispose()


def _first_line(exc: BaseException) -> str:
    line = (str(exc).splitlines() or [type(exc).__name__])[0]
    return line if len(line) <= MAX_SHOWN_CHARS else line[: MAX_SHOWN_CHARS - 3] + "..."


def load_yaml_text(text: str, source: str) -> Any:
    """Parse YAML `text` the one way the project reads YAML (safe tags only, no anchors or
    aliases, bounded size, nesting and integers), or raise ConfigError: one line that starts
    with `source` (e.g. "config file 'a.yaml'") and says where and what to do."""
    try:
        return _parse_yaml(text)
    except YamlRefused as exc:
        raise ConfigError(f"{source}: {_yaml_problem(exc)}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source} is not valid YAML: {_yaml_problem(exc)}") from None


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin is not None:
        return str(tp).replace("typing.", "")
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, path: str) -> Any:
    """Convert plain YAML data `value` to type `tp`, or raise ConfigError naming `path`."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            raise ConfigError(
                f"config key '{path}': {short_repr(value)} is not a valid choice; "
                f"valid choices: {', '.join(repr(c) for c in choices)}"
            )
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, path)
            except ConfigError:
                continue  # try the next member; none matched: the error below
        raise ConfigError(
            f"config key '{path}': {short_repr(value)} does not match {_type_name(tp)}"
        )
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        return from_dict(tp, value, path)
    if origin in (list, tuple, Iterable) or tp in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"config key '{path}': expected a list, got {short_repr(value)}")
        args = get_args(tp)
        item_tp = args[0] if args else Any
        items = [_convert(v, item_tp, _join(path, i)) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple or tp is tuple else items
    if origin in (dict, Mapping) or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{path}': expected a mapping, got {short_repr(value)}")
        args = get_args(tp)
        key_tp, val_tp = args if args else (Any, Any)
        return {
            _convert(k, key_tp, path): _convert(v, val_tp, _join(path, str(k)))
            for k, v in value.items()
        }
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config key '{path}': expected true or false, got {short_repr(value)}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config key '{path}': expected an integer, got {short_repr(value)}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-6" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"config key '{path}': expected a number, got {short_repr(value)}")
        if not math.isfinite(value):  # NaN passes every range check: refuse it here, once
            raise ConfigError(f"config key '{path}': {short_repr(value)} is not a finite number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"config key '{path}': expected a string, got {short_repr(value)}")
        return value
    if tp is Path:
        if not isinstance(value, str | Path):
            raise ConfigError(f"config key '{path}': expected a path, got {short_repr(value)}")
        return Path(value)
    raise ConfigError(f"config key '{path}': unsupported field type {_type_name(tp)}")


def _field_table(cls: type) -> dict[str, tuple[dataclasses.Field, Any]]:
    hints = get_type_hints(cls)
    return {f.name: (f, hints[f.name]) for f in dataclasses.fields(cls) if f.init}


def from_dict(cls: type[T], data: Any, path: str = "") -> T:
    """Build dataclass `cls` from a mapping, rejecting unknown keys with the valid list."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        where = f"config key '{path}'" if path else "config"
        raise ConfigError(
            f"{where}: expected a mapping of keys for {cls.__name__}, got {short_repr(data)}"
        )
    table = _field_table(cls)
    unknown = sorted(set(data) - set(table), key=str)  # YAML keys may be ints too
    if unknown:
        where = f"section '{path}'" if path else "the top level"
        valid = ", ".join(sorted(table))
        shown = ", ".join(short_repr(_join(path, str(k))) for k in unknown[:5])
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise ConfigError(f"unknown config key(s) {shown}{more} in {where}; valid keys: {valid}")
    kwargs = {}
    for name, (field, tp) in table.items():
        if name in data:
            kwargs[name] = _convert(data[name], tp, _join(path, name))
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError(f"config key '{_join(path, name)}' is required but missing")
    return cls(**kwargs)


@dataclasses.dataclass(frozen=True)
class Moved:
    """A config key that moved to another section (a section dataclass lists them in its
    MOVED_KEYS: old name → Moved): its value is read at the new key(s), `convert` maps it
    there, and one line tells the user so (a deprecated alias, issue 34)."""

    to: tuple[str, ...]  # dotted keys from the top level
    convert: Any = None  # value → the new key's value; None: the same value
    note: str = ""  # how the value maps, when not the same


def _moved(cls: type | None, key: Any) -> Moved | None:
    return getattr(cls, "MOVED_KEYS", {}).get(key) if cls is not None else None


def _deprecated(here: str, moved: Moved, value: Any) -> None:
    import sys

    what = " and ".join(moved.to)
    print(
        f"pivot-hpc: config key '{here}' is deprecated: read as {what}"
        f"{f' ({moved.note})' if moved.note else ''}; set that instead (one config describes "
        "a deployment for pivot-hpc run, simulate and plan alike)",
        file=sys.stderr,
    )


def _set_dotted(data: dict, dotted: str, value: Any, here: str, *, keep: bool) -> None:
    node = data
    parts = dotted.split(".")
    for key in parts[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config key '{here}' moved to '{dotted}', but '{key}' is a value")
        node = child
    last = parts[-1]
    if keep and last in node and node[last] != value:
        raise ConfigError(
            f"config keys '{here}' ({short_repr(value)}) and '{dotted}' "
            f"({short_repr(node[last])}) say different things; keep only '{dotted}'"
        )
    node[last] = value


def migrate_moved(data: Any, root: type, path: str = "", top: dict | None = None) -> None:
    """Read every moved key of raw config `data` (a file, a saved config) at its new key,
    with one line each; a new key set to something else as well is an error."""
    if not isinstance(data, dict) or not dataclasses.is_dataclass(root):
        return
    top = data if top is None else top
    table = _field_table(root)
    for key in list(data):
        here = _join(path, str(key))
        moved = None if key in table else _moved(root, key)
        if moved is not None:
            value = data.pop(key)
            new = moved.convert(value) if moved.convert else value
            _deprecated(here, moved, value)
            for target in moved.to:
                _set_dotted(top, target, new, here, keep=True)
        elif key in table:
            tp = table[key][1]
            args = [a for a in get_args(tp) if a is not type(None)]
            sub = tp if dataclasses.is_dataclass(tp) else (args[0] if len(args) == 1 else None)
            if sub is not None and dataclasses.is_dataclass(sub):
                migrate_moved(data[key], sub, here, top)


def to_dict(obj: Any) -> Any:
    """Plain-data view of a config (for telemetry metadata and checkpoints)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list | tuple):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, Path):
        return str(obj)
    return obj


def parse_override(text: str) -> tuple[list[str], Any]:
    """`trainer.lr=1e-6` → (['trainer', 'lr'], 1e-6). The value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(
            f"override {short_repr(text)} is not of the form dotted.key=value (e.g. planner.horizon_s=120)"
        )
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {short_repr(text)}: empty key segment in {short_repr(key)}")
    try:
        value = _parse_yaml(raw) if raw.strip() else ""
    except YamlRefused as exc:
        mark = exc.problem_mark
        at = f"column {mark.column + 1}: " if mark is not None else ""
        raise ConfigError(f"override {short_repr(text)}: {at}{exc.problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(
            f"override {short_repr(text)}: the value is not valid YAML ({_yaml_problem(exc, 'column')}); "
            "quote it if it is text"
        ) from None
    return parts, value


def _yaml_problem(exc: yaml.YAMLError, where: str = "line") -> str:
    """One line for a YAML error: what is wrong and where (1-based)."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    if "\\t" in str(problem):  # YAML names a tab as the two characters backslash, t
        problem = f"{problem} (indent with spaces, not tabs)"
    if mark is None:
        return str(problem)
    if where == "column":
        return f"{problem} at column {mark.column + 1}"
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"


def apply_overrides(data: dict, overrides: Iterable[str], root: type | None = None) -> dict:
    """Apply dotted overrides to plain config data (before it becomes dataclasses).

    With `root` given, every path segment is checked against the dataclass fields so a
    typo fails with the valid keys at that level, not as a confusing later error.
    """
    for text in overrides:
        parts, value = parse_override(text)
        node = data
        cls = root
        for depth, key in enumerate(parts):
            here = ".".join(parts[: depth + 1])
            if cls is not None and dataclasses.is_dataclass(cls):
                table = _field_table(cls)
                moved = _moved(cls, key) if key not in table else None
                if moved is not None and depth == len(parts) - 1:  # a deprecated alias
                    _deprecated(here, moved, value)
                    for target in moved.to:
                        new = moved.convert(value) if moved.convert else value
                        _set_dotted(data, target, new, here, keep=False)
                    break
                if key not in table:
                    raise ConfigError(
                        f"override {short_repr(text)}: unknown key '{here}'; valid keys at this level: "
                        f"{', '.join(sorted(table))}"
                    )
                tp = table[key][1]
                args = [a for a in get_args(tp) if a is not type(None)]
                cls = (
                    tp
                    if dataclasses.is_dataclass(tp)
                    else (args[0] if len(args) == 1 and dataclasses.is_dataclass(args[0]) else None)
                )
            else:
                cls = None
            if depth == len(parts) - 1:
                node[key] = value
            else:
                child = node.get(key)
                if child is None:
                    child = node[key] = {}
                if not isinstance(child, dict):
                    raise ConfigError(
                        f"override {short_repr(text)}: '{here}' is a value, not a section"
                    )
                node = child
    return data


def load_yaml(path: str | Path) -> dict:
    path = Path(path)
    source = f"config file {str(path)!r}"
    if not path.is_file():
        raise ConfigError(f"{source} does not exist; pass the path of a YAML file")
    text = read_yaml_file(path, source)
    data = load_yaml_text(text, source)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping")
    return data


def read_yaml_file(path: str | Path, source: str) -> str:
    """The UTF-8 text of YAML file `path` (at most MAX_YAML_CHARS bytes, checked before
    reading), or ConfigError: one line starting with `source`."""
    try:
        with Path(path).open("rb") as f:
            raw = f.read(MAX_YAML_CHARS + 1)  # never more than the cap, whatever the file
    except OSError as exc:
        raise ConfigError(f"{source} cannot be read ({exc.strerror or exc})") from None
    if len(raw) > MAX_YAML_CHARS:
        raise ConfigError(
            f"{source} is larger than {MAX_YAML_CHARS} bytes, more than any config; "
            "is it the right file?"
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{source} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at "
            f"offset {exc.start}); save it as UTF-8"
        ) from None


def validate_tree(obj: Any, path: str = "") -> None:
    """Call `validate(path)` on every dataclass in the tree, parents first."""
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        return
    check = getattr(obj, "validate", None)
    if callable(check):
        check(path)
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            validate_tree(value, _join(path, f.name))
        elif isinstance(value, dict):
            for k, v in value.items():
                validate_tree(v, _join(path, str(k)))
        elif isinstance(value, list | tuple):
            for i, v in enumerate(value):
                validate_tree(v, _join(path, i))
