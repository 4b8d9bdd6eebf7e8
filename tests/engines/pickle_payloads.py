"""Hostile pickles planted in front of a genuine torch DCP `.metadata` (the way an attacker
would: the payload runs, `POP` drops its result, and the genuine metadata follows, so
an unguarded `pickle.load` returns real metadata and the checkpoint still loads).

Each payload, if it ran, would write the file `marker`. Built opcode by opcode: nothing
here is ever unpickled by the test process itself."""

from __future__ import annotations

import io
import os
import pickle
import struct

_MD = "torch.distributed.checkpoint.metadata"


def _text(s: str) -> bytes:
    data = s.encode()
    if len(data) < 256:
        return pickle.SHORT_BINUNICODE + bytes([len(data)]) + data
    return pickle.BINUNICODE + struct.pack("<I", len(data)) + data


def _bytes(b: bytes) -> bytes:
    return pickle.BINBYTES + struct.pack("<I", len(b)) + b


def _global(module: str, name: str) -> bytes:
    return _text(module) + _text(name) + pickle.STACK_GLOBAL


def _call1(module: str, name: str, arg: bytes) -> bytes:
    return _global(module, name) + arg + pickle.TUPLE1 + pickle.REDUCE


def _shell(marker: str) -> str:
    return f"touch {marker}"


class _System:  # what a legacy torch.save'd object that runs a command looks like
    def __init__(self, cmd: str) -> None:
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


def _nested_torch_pickle(marker: str) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(_System(_shell(marker)), buf, _use_new_zipfile_serialization=False)
    return buf.getvalue()


def payloads(marker: str) -> dict[str, bytes]:
    """name → the opcodes to put before the genuine metadata (each leaves nothing on the
    stack)."""
    sh = _text(_shell(marker))
    return {
        # 1. a dotted name through an allowed module: metadata's `os`, then `.system`
        "dotted_name": _call1(_MD, "os.system", sh) + pickle.POP,
        # the same with the text GLOBAL opcode
        "dotted_global_opcode": pickle.GLOBAL
        + f"{_MD}\nos.system\n".encode()
        + sh
        + pickle.TUPLE1
        + pickle.REDUCE
        + pickle.POP,
        # 2. BUILD on a module: metadata's `os` gets environ = {} (weights-only forcing gone),
        # then a nested legacy torch pickle through torch.storage._load_from_bytes
        "build_on_module": _global(_MD, "os")
        + pickle.EMPTY_DICT
        + _text("environ")
        + pickle.EMPTY_DICT
        + pickle.SETITEM
        + pickle.BUILD
        + pickle.POP
        + _call1("torch.storage", "_load_from_bytes", _bytes(_nested_torch_pickle(marker)))
        + pickle.POP,
        # 3. _load_from_bytes on its own
        "load_from_bytes": _call1(
            "torch.storage", "_load_from_bytes", _bytes(_nested_torch_pickle(marker))
        )
        + pickle.POP,
        # 4. try_import: imports any module by name
        "try_import": _call1("torch.distributed.checkpoint._extension", "try_import", _text("this"))
        + pickle.POP,
        # 5. a 100 GB allocation
        "bytearray": _call1(
            "builtins", "bytearray", pickle.LONG1 + b"\x05" + (10**11).to_bytes(5, "little")
        )
        + pickle.POP,
        # 6. BUILD with slot state on an allowed *function*: poisons _get_layout's cache
        "build_on_function": _global("torch.serialization", "_get_layout")
        + pickle.NONE
        + pickle.EMPTY_DICT
        + _text("cache")
        + pickle.EMPTY_DICT
        + pickle.SETITEM
        + pickle.TUPLE2
        + pickle.BUILD
        + pickle.POP,
        # 7. BUILD on an allowed class (rewrites the class for the whole process)
        "build_on_class": _global(_MD, "Metadata")
        + pickle.NONE
        + pickle.EMPTY_DICT
        + _text("__eq__")
        + _global("torch.serialization", "_get_layout")
        + pickle.SETITEM
        + pickle.TUPLE2
        + pickle.BUILD
        + pickle.POP,
        # 8. a plain dangerous global
        "plain_global": _call1("os", "system", sh) + pickle.POP,
    }


def plant(genuine: bytes, payload: bytes) -> bytes:
    """`payload` in front of `genuine` (a protocol >= 2 pickle), still one valid pickle."""
    assert genuine[:1] == pickle.PROTO
    return genuine[:2] + payload + genuine[2:]
