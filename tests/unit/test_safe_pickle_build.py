"""Issue 49, findings 12 and 8 (the unpickler's part): `BUILD` in megatron's metadata
pickle. pickle's own BUILD looks `__setstate__` up on the instance, so one BUILD could
plant an instance `__setstate__` (any allowed callable) that a second BUILD calls; and a
state naming a dunder attribute (`__class__`) rewrites what the object is. Both are
refused in one line; so is a class's own `__setstate__` that raises RuntimeError (torch's
TensorProperties with an unknown memory format), which used to escape as a traceback."""

from __future__ import annotations

import io
import pickle

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from pivot_hpc.checkpoint.safe_pickle import UnsafePickleError, load_metadata

P = pickle
DCP = b"torch.distributed.checkpoint.metadata"


def sg(mod: bytes, name: bytes) -> bytes:  # STACK_GLOBAL
    return (
        P.SHORT_BINUNICODE + bytes([len(mod)]) + mod
        + P.SHORT_BINUNICODE + bytes([len(name)]) + name + P.STACK_GLOBAL
    )  # fmt: skip


def s(x: bytes) -> bytes:
    return P.SHORT_BINUNICODE + bytes([len(x)]) + x


H = P.PROTO + b"\x05"
METADATA = sg(DCP, b"Metadata") + P.EMPTY_TUPLE + P.NEWOBJ
PAYLOADS = {
    # BUILD 1 plants __setstate__ = torch.Size on the instance, BUILD 2 would call it
    "planted __setstate__": (
        H + METADATA + P.EMPTY_DICT + s(b"__setstate__") + sg(b"torch", b"Size") + P.SETITEM
        + P.BUILD + P.EMPTY_LIST + P.BUILD + P.STOP
    ),
    "__class__ through slot state": (
        H + METADATA + P.NONE + P.EMPTY_DICT + s(b"__class__") + sg(DCP, b"StorageMeta")
        + P.SETITEM + P.TUPLE2 + P.BUILD + P.STOP
    ),
    "__dict__ through the state": (
        H + METADATA + P.EMPTY_DICT + s(b"__dict__") + P.EMPTY_DICT + P.SETITEM + P.BUILD + P.STOP
    ),
    "a state that is no mapping": H + METADATA + P.EMPTY_LIST + P.BUILD + P.STOP,
    "__setstate__ raising RuntimeError": (
        H + sg(DCP, b"TensorProperties") + P.EMPTY_TUPLE + P.NEWOBJ + P.MARK
        + sg(b"torch", b"float32") + P.NONE + P.NEWFALSE + P.BININT1 + b"\x63" + P.NEWFALSE
        + P.TUPLE + P.BUILD + P.STOP
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(PAYLOADS))
def test_build_tricks_are_refused_in_one_line(name: str) -> None:
    real = torch.Size
    with pytest.raises(UnsafePickleError) as info:
        load_metadata(io.BytesIO(PAYLOADS[name]), "train/.metadata")
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("train/.metadata: "), msg
    assert torch.Size is real  # nothing rebound


def test_genuine_metadata_with_setstate_classes_still_loads() -> None:
    """TensorProperties has a __setstate__ of its class's own: still honoured."""
    md = Metadata(
        state_dict_metadata={
            "w": TensorStorageMetadata(
                TensorProperties(dtype=torch.bfloat16, requires_grad=True),
                torch.Size([4, 4]),
                [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 4]))],
            )
        }
    )
    back = load_metadata(io.BytesIO(pickle.dumps(md)), "train/.metadata")
    assert back == md and back.state_dict_metadata["w"].properties.requires_grad is True
