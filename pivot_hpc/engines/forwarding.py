"""Delegation generated from a protocol: a proxy (an engine in a child process, a trainer
with step groups beside it) forwards every member the protocol declares that the proxy
does not define itself, so a member added to engines/base.py reaches every proxy at once
and no forward is written by hand."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from pivot_hpc.engines.base import protocol_members

# how a proxy reaches its engine: (proxy, member name) -> a method call / an attribute read
Call = Callable[[Any, str, tuple, dict], Any]
Get = Callable[[Any, str], Any]


def forward(protocol: type, *, call: Call, get: Get) -> Callable[[type], type]:
    """A class decorator: every member of `protocol` the class lacks becomes a forward —
    methods through `call(self, name, args, kwargs)`, attributes and properties through
    `get(self, name)` (read-only properties). Signatures are the protocol's."""

    def decorate(cls: type) -> type:
        for name, kind in protocol_members(protocol).items():
            if _defined(cls, name):
                continue
            if kind == "method":
                setattr(cls, name, _method(protocol, name, call))
            else:
                setattr(cls, name, property(lambda self, n=name: get(self, n)))
        return cls

    return decorate


def _defined(cls: type, name: str) -> bool:
    """Defined by the class (or a base), or annotated there: an instance attribute."""
    return any(
        name in vars(k) or name in vars(k).get("__annotations__", {})
        for k in cls.__mro__
        if k is not object
    )


def _method(protocol: type, name: str, call: Call) -> Callable[..., Any]:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return call(self, name, args, kwargs)

    source = next(k for k in protocol.__mro__ if name in vars(k))
    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"Forwarded: {protocol.__name__}.{name}."
    method.__signature__ = inspect.signature(vars(source)[name])  # type: ignore[attr-defined]
    return method
