"""Checkpoint state as data: tagged JSON that can only ever rebuild known types.

Everything a checkpoint holds besides tensors files (RL state with its samples and partial
sequences, RNG states) goes through `dumps`/`loads`. JSON cannot name code, and `loads`
rebuilds only the dataclasses registered with `register` (by name, field by field), numpy
arrays, torch tensors, tuples, bytes and dicts with non-string keys: a checkpoint from
someone else can be wrong, never executable (docs/design.md §9).
"""

from __future__ import annotations

import base64
import dataclasses
import json
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from pivot_hpc.errors import PivotError


class CodecError(PivotError, ValueError):
    """A state file that does not decode into the expected types."""


_TYPES: dict[str, type] = {}
# A record's own checks, run on every one decoded: a constructor takes what it is given, so a
# checkpoint's record is checked as input is (ValueError or TypeError: one line).
_CHECKS: dict[type, Callable[[Any], None]] = {}


def register(*classes: type, check: Callable[[Any], None] | None = None) -> None:
    """Allow these dataclasses in checkpoints (name → class; a name is registered once);
    `check(record)` raises ValueError/TypeError for a decoded record that is malformed."""
    for cls in classes:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls!r} is not a dataclass")
        have = _TYPES.get(cls.__name__)
        if have is not None and have is not cls:
            raise TypeError(f"two checkpoint types named {cls.__name__}: {have!r} and {cls!r}")
        _TYPES[cls.__name__] = cls
        if check is not None:
            _CHECKS[cls] = check


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode("ascii")


def _encode(x: Any) -> Any:
    if x is None or isinstance(x, bool | int | float | str):
        return x
    if isinstance(x, list):
        return [_encode(v) for v in x]
    if isinstance(x, tuple):
        return {"__tuple__": [_encode(v) for v in x]}
    if isinstance(x, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in x):
            return {k: _encode(v) for k, v in x.items()}
        return {"__items__": [[_encode(k), _encode(v)] for k, v in x.items()]}
    if isinstance(x, bytes):
        return {"__bytes__": _b64(x)}
    if isinstance(x, np.ndarray):
        a = np.ascontiguousarray(x)
        return {"__ndarray__": _b64(a.tobytes()), "dtype": a.dtype.str, "shape": list(a.shape)}
    if isinstance(x, np.generic):
        return _encode(x.item())
    if isinstance(x, torch.Tensor):
        t = x.detach().cpu().contiguous()
        raw = t.view(torch.uint8) if t.dtype != torch.uint8 and t.numel() else t
        return {
            "__tensor__": _b64(raw.numpy().tobytes()),
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
        }
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        name = type(x).__name__
        if _TYPES.get(name) is not type(x):
            raise TypeError(f"checkpoint state holds an unregistered type {type(x)!r}")
        fields = {f.name: _encode(getattr(x, f.name)) for f in dataclasses.fields(x)}
        return {"__dataclass__": name, "fields": fields}
    raise TypeError(f"checkpoint state cannot hold {type(x)!r}")


def _decode(x: Any) -> Any:
    if isinstance(x, list):
        return [_decode(v) for v in x]
    if not isinstance(x, dict):
        return x
    if "__tuple__" in x:
        return tuple(_decode(v) for v in x["__tuple__"])
    if "__items__" in x:
        return {_decode(k): _decode(v) for k, v in x["__items__"]}
    if "__bytes__" in x:
        return base64.b64decode(x["__bytes__"])
    if "__ndarray__" in x:
        dtype = np.dtype(x["dtype"])
        if dtype.hasobject:
            raise CodecError("object arrays are not allowed")
        return np.frombuffer(base64.b64decode(x["__ndarray__"]), dtype).reshape(x["shape"]).copy()
    if "__tensor__" in x:
        dtype = getattr(torch, str(x["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise CodecError(f"unknown tensor dtype {x['dtype']!r}")
        raw = torch.frombuffer(bytearray(base64.b64decode(x["__tensor__"])), dtype=torch.uint8)
        t = raw if dtype == torch.uint8 else raw.view(dtype)
        return t.reshape(x["shape"]).clone()
    if "__dataclass__" in x:
        cls = _TYPES.get(x["__dataclass__"])
        if cls is None:
            raise CodecError(f"unknown type {x['__dataclass__']!r} (allowed: {sorted(_TYPES)})")
        fields = {f.name for f in dataclasses.fields(cls)}
        given = x.get("fields", {})
        if not isinstance(given, dict) or set(given) - fields:
            raise CodecError(f"{cls.__name__}: unexpected fields {sorted(set(given) - fields)}")
        init = {k: _decode(v) for k, v in given.items() if _field(cls, k).init}
        obj = cls(**init)
        for k, v in given.items():  # fields outside __init__ (set after construction)
            if not _field(cls, k).init:
                object.__setattr__(obj, k, _decode(v))
        check = _CHECKS.get(cls)
        if check is not None:
            try:
                check(obj)
            except (ValueError, TypeError) as exc:
                raise CodecError(f"{cls.__name__}: {exc!s:.300}") from None
        return obj
    return {k: _decode(v) for k, v in x.items()}


def _field(cls: type, name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(cls) if f.name == name)


def dumps(obj: Any) -> bytes:
    return json.dumps(_encode(obj), separators=(",", ":")).encode("utf-8")


def loads(data: bytes, what: str) -> Any:
    """Decode `data` (the contents of file `what`, named in errors)."""
    try:
        return _decode(json.loads(data.decode("utf-8")))
    except CodecError as exc:
        raise CodecError(f"{what}: {exc}") from None
    except RecursionError:
        raise CodecError(f"{what}: nested too deeply for a pivot_hpc state file") from None
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError, MemoryError) as exc:
        # RuntimeError: torch's answer to a tensor whose bytes do not fit its shape
        raise CodecError(f"{what}: not a pivot_hpc state file ({exc!s:.200})") from None
