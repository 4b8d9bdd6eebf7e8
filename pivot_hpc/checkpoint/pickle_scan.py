"""Refuse pickles that could run code, without running them.

pivot_hpc writes no pickles, but megatron-core's distributed checkpoint (`train/`) is
torch.distributed.checkpoint, whose `.metadata` file is a pickle that torch loads with
`pickle.load`, and whose `common.pt` torch loads with its weights-only unpickler. Before a
resume hands `train/` to megatron-core, `check_metadata` reads the pickle's opcodes
(pickletools: nothing is executed) and accepts it only if every global it would import is
one of the plain data types such metadata consists of. Anything else — `os.system`,
`builtins.eval`, an unknown class — is refused with the file named.
"""

from __future__ import annotations

import pickletools
from pathlib import Path

from pivot_hpc.errors import PivotError

# Modules whose every class is plain metadata (dataclasses and enums of DCP).
_DATA_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.planner",
    "torch.distributed.checkpoint._extension",
)
# Single globals a DCP metadata pickle legitimately refers to.
_DATA_GLOBALS = {
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("builtins", "bytearray"),
    ("builtins", "complex"),
    ("collections", "OrderedDict"),
    ("collections", "defaultdict"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch.storage", "_load_from_bytes"),
    ("torch", "device"),
    ("torch", "layout"),
    ("torch", "memory_format"),
    ("torch", "strided"),
    ("torch", "contiguous_format"),
    ("torch", "preserve_format"),
}
_DTYPES = {
    "float32", "float64", "float16", "bfloat16", "int8", "int16", "int32", "int64", "uint8",
    "bool", "float8_e4m3fn", "float8_e5m2", "complex64", "complex128",
}  # fmt: skip


class UnsafePickleError(PivotError, ValueError):
    pass


def _allowed(module: str, name: str) -> bool:
    if module in _DATA_MODULES:  # dataclasses and enums only
        return True
    if module == "torch" and name in _DTYPES:
        return True
    return (module, name) in _DATA_GLOBALS


_STRING_OPS = ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING",
               "BINSTRING", "SHORT_BINSTRING")  # fmt: skip


def globals_of(data: bytes) -> list[tuple[str, str]]:
    """(module, name) of every global the pickle would import, read from its opcodes.

    STACK_GLOBAL takes module and name from the stack: the two strings pushed just before
    it, literally or from the memo. Anything else there is reported as ('?', '?')."""
    out = []
    memo: dict[int, str | None] = {}
    prev: str | None = None
    top: str | None = None
    for op, arg, _pos in pickletools.genops(data):
        name = op.name
        if name in ("GLOBAL", "INST"):
            module, attr = str(arg).split(" ", 1)
            out.append((module, attr))
            prev = top = None
        elif name == "STACK_GLOBAL":
            out.append((prev, top) if prev is not None and top is not None else ("?", "?"))
            prev = top = None
        elif name in _STRING_OPS:
            prev, top = top, str(arg)
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            prev, top = top, memo.get(int(arg))
        elif name == "MEMOIZE":
            memo[len(memo)] = top
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[int(arg)] = top
        elif name in ("PROTO", "FRAME"):
            pass
        else:
            prev = top = None
    return out


def check_metadata(path: Path) -> None:
    """Raise UnsafePickleError unless the pickle at `path` only refers to plain data."""
    try:
        data = path.read_bytes()
        found = globals_of(data)
    except (OSError, ValueError, EOFError) as exc:
        raise UnsafePickleError(f"{path}: unreadable pickle ({exc})") from None
    bad = sorted({f"{m}.{n}" for m, n in found if not _allowed(m, n)})
    if bad:
        raise UnsafePickleError(
            f"{path}: refers to {', '.join(bad[:5])}, which checkpoint metadata never does "
            "(a pickle that would run code is not loaded); delete this checkpoint or use one "
            "you wrote yourself"
        )
