"""Load megatron-core's pickled checkpoint metadata as data, never as code.

pivot_hpc writes no pickles, but megatron-core's distributed checkpoint (`train/`) is
torch.distributed.checkpoint, whose `.metadata` file is a pickle that torch itself reads
with a plain `pickle.load`. A static scan of its opcodes is not enough (a dotted global
name resolves attribute by attribute, `BUILD` rewrites a module's or function's
namespace), so the allow-list is enforced *while unpickling*:

- `find_class` accepts only the exact (module, name) pairs a genuine megatron checkpoint
  uses (below) and refuses every other global, including any dotted name;
- `BUILD` may only fill in an instance of one of those classes (never a class, a
  module or a function: that would rewrite shared state such as `os.environ`), through
  its class's own `__setstate__` or plain attributes, never a dunder one (an instance
  `__setstate__` planted by one BUILD would be called by the next);
- persistent ids, out-of-band buffers and copyreg extensions fail as in `pickle`.

`data_only_loads(path)` routes torch DCP's `pickle.load` through that unpickler and forces
torch's weights-only unpickler for every `torch.load` inside (megatron's `common.pt`,
DCP's byte items), whatever the caller asks or the environment says. The pure-Python
unpickler is used because the C one cannot intercept `BUILD`; a genuine `.metadata` is a
few hundred kilobytes even for large models, so the cost is a fraction of a second.
"""

from __future__ import annotations

import contextlib
import enum
import os
import pickle
import re
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

from pivot_hpc.errors import PivotError
from pivot_hpc.safe_files import UnsafeReadError, open_for_read

_DCP = "torch.distributed.checkpoint"
# Every global a megatron-core 0.16 / torch 2.13 distributed checkpoint's `.metadata`
# refers to (read from real checkpoints), plus the dtypes a GPU checkpoint may carry.
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        (f"{_DCP}.filesystem", "_StorageInfo"),
        *(
            (f"{_DCP}.metadata", name)
            for name in (
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "Metadata",
                "MetadataIndex",
                "StorageMeta",
                "TensorProperties",
                "TensorStorageMetadata",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        *(
            (f"{_DCP}.planner", name)
            for name in ("SavePlan", "TensorWriteData", "WriteItem", "WriteItemType")
        ),
        *(
            ("torch", dtype)
            for dtype in (
                "float32", "float64", "float16", "bfloat16", "int8", "int16", "int32",
                "int64", "uint8", "bool", "float8_e4m3fn", "float8_e5m2", "complex64",
                "complex128",
            )
        ),
    }
)  # fmt: skip


class UnsafePickleError(PivotError, pickle.UnpicklingError):
    """A pickle refers to something checkpoint metadata never holds: it is not loaded."""


class _DataOnlyUnpickler(pickle._Unpickler):  # the Python unpickler: BUILD can be checked
    dispatch: ClassVar[dict] = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: Any, source: str) -> None:
        super().__init__(file)
        self._source = source
        self._classes: set[type] = set()

    def _refuse(self, what: str) -> UnsafePickleError:
        return UnsafePickleError(
            f"{self._source}: {what}, which checkpoint metadata never does (a pickle that "
            "could run code is not loaded); delete this checkpoint or use one you wrote "
            "yourself"
        )

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED_GLOBALS:  # a dotted name is never in the list
            shown = f"{module}.{name}"
            raise self._refuse(f"refers to {shown[:120]!r}")
        obj = super().find_class(module, name)
        if isinstance(obj, type):
            self._classes.add(obj)
        return obj

    def _load_build(self) -> None:
        state = self.stack.pop()  # BUILD pops the state and updates the object beneath it
        target = self.stack[-1]
        shared = isinstance(target, type | types.ModuleType | enum.Enum)  # singletons
        if shared or type(target) not in self._classes:
            raise self._refuse(f"sets the state of {type(target).__name__[:60]!r}")
        # pickle's own BUILD looks `__setstate__` up on the instance, where an earlier
        # BUILD can have planted one (any allowed callable: a second BUILD would call it):
        # only the class's own counts, and no state may name a dunder attribute.
        setstate = getattr(type(target), "__setstate__", None)
        if setstate is not None:
            setstate(target, state)
            return
        slots = None
        if isinstance(state, tuple) and len(state) == 2:
            state, slots = state
        for part in (state, slots):
            if part is None:
                continue
            if not isinstance(part, dict):
                raise self._refuse(
                    f"gives {type(target).__name__[:60]!r} a state that is no mapping"
                )
            for key in part:
                if not isinstance(key, str) or key.startswith("__"):
                    raise self._refuse(f"sets attribute {str(key)[:60]!r}")
        if state:
            target.__dict__.update(state)
        for key, value in (slots or {}).items():
            setattr(target, key, value)

    dispatch[pickle.BUILD[0]] = _load_build

    def persistent_load(self, pid: Any) -> Any:
        raise self._refuse("uses a persistent id")

    def get_extension(self, code: int) -> None:  # copyreg's cache would skip find_class
        raise self._refuse(f"uses copyreg extension code {code}")


def load_metadata(file: Any, source: str | None = None) -> Any:
    """`pickle.load` for DCP metadata: the same result on a genuine file, UnsafePickleError
    (naming the file) on anything else."""
    name = source or str(getattr(file, "name", "checkpoint metadata"))
    try:
        metadata = _DataOnlyUnpickler(file, name).load()
        _check_storage(metadata, name)
        return metadata
    except UnsafePickleError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            KeyError, IndexError, MemoryError, RecursionError, RuntimeError,
            OverflowError) as exc:  # fmt: skip
        # RuntimeError: torch's answer to data it refuses (TensorProperties.__setstate__
        # with an unknown memory format); OverflowError: a number past a C integer
        raise UnsafePickleError(
            f"{name}: not a readable checkpoint metadata pickle ({exc!s:.160})"
        ) from None


_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}")


def _check_storage(metadata: Any, source: str) -> None:
    """DCP reads each tensor from `relative_path` at `offset`: a name outside the
    checkpoint's own directory (`../../etc/passwd`, an absolute path) or a stream transform
    (we never write one) is refused, so that loading never reads another file."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata

    if type(metadata) is not Metadata:
        raise UnsafePickleError(
            f"{source}: holds a {type(metadata).__name__[:60]}, not checkpoint metadata"
        )
    storage = metadata.storage_data
    if storage is None:  # nothing to read (torch refuses such a checkpoint itself)
        return
    if not isinstance(storage, dict):
        raise UnsafePickleError(
            f"{source}: its storage table is a {type(storage).__name__[:60]}, not a mapping"
        )
    for info in storage.values():
        ok = (
            type(info) is _StorageInfo
            and isinstance(info.relative_path, str)
            and _FILE_NAME.fullmatch(info.relative_path) is not None
            and ".." not in info.relative_path
            and all(type(n) is int and n >= 0 for n in (info.offset, info.length))
            and not info.transform_descriptors
        )
        if not ok:
            raise UnsafePickleError(
                f"{source}: a tensor is stored at {str(info)[:160]}, outside the checkpoint's "
                "own files; delete this checkpoint or use one you wrote yourself"
            )


def check_metadata(path: Path) -> None:
    """Raise UnsafePickleError unless the pickle at `path` loads as plain metadata."""
    try:
        with open_for_read(path) as f:  # a FIFO planted there would block a plain open
            load_metadata(f, str(path))
    except UnsafeReadError as exc:
        raise UnsafePickleError(str(exc)) from None
    except OSError as exc:
        raise UnsafePickleError(f"{path}: unreadable ({exc.strerror})") from None


class _PickleForDCP(types.ModuleType):
    """Stands in for the `pickle` module inside torch DCP's filesystem reader: loading goes
    through the allow-list, everything else (dump for saving) is the real module. A refusal
    is kept: torch re-raises it wrapped in an AssertionError of its own wording."""

    def __init__(self) -> None:
        super().__init__("pickle")
        self.refusal: UnsafePickleError | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(pickle, name)

    def load(self, file: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return load_metadata(file)
        except UnsafePickleError as exc:
            self.refusal = exc
            raise


@contextlib.contextmanager
def data_only_loads(path: str | Path) -> Iterator[None]:
    """Load the distributed checkpoint at `path` inside: torch DCP reads `.metadata` with
    the allow-list above, and every torch.load uses torch's weights-only unpickler (forced
    through the environment, which the allow-list keeps a pickle from rewriting). A failed
    load leaves as one PivotError naming the file (torch's own `CheckpointException` is a
    BaseException that `except Exception` would let through as a traceback)."""
    from torch.distributed.checkpoint import filesystem
    from torch.distributed.checkpoint.api import CheckpointException

    keys = ("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
    saved = {k: os.environ.pop(k, None) for k in keys}
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    real, shim = filesystem.pickle, _PickleForDCP()
    filesystem.pickle = shim
    try:
        yield
    except (Exception, CheckpointException) as exc:
        if shim.refusal is not None:
            raise shim.refusal from None
        if isinstance(exc, CheckpointException):
            raise _load_failed(exc, path) from None
        raise
    finally:
        filesystem.pickle = real
        for k, v in saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v


def _load_failed(exc: BaseException, path: str | Path) -> PivotError:
    inner = [f[0] for f in getattr(exc, "failures", {}).values() if isinstance(f, tuple) and f]
    cause = f"{type(inner[0]).__name__}: {inner[0]!s:.200}" if inner else f"{exc!s:.200}"
    return PivotError(
        f"training checkpoint {path} cannot be loaded ({cause}); delete its checkpoint "
        "to resume from the previous one, or start a new --run-dir"
    )
