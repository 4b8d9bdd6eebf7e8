"""The tensors of a Hugging Face directory from its safetensors headers alone.

A safetensors file is an 8-byte little-endian header length n, n bytes of JSON
(`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`), then
the tensors' bytes. Reading the first 8 + n bytes of each file tells every tensor's name,
shape, dtype and place without touching the weights, so any rank can learn a model's shape
in milliseconds. A directory from someone else may be wrong, never dangerous: the header
size is capped (safetensors' own 100 MB limit), every entry is checked as safetensors'
loader would check it (offsets contiguous from 0, sizes matching shape x dtype, the file
exactly as long as the header says), and each problem is one ModelDirError line naming
the file and what to do. Nothing read here is ever unpickled or executed.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pivot_hpc.errors import PivotError, short_repr

MAX_HEADER_BYTES = 100_000_000  # safetensors refuses larger headers (MAX_HEADER_SIZE)
MAX_INDEX_BYTES = 64 << 20  # a weight map of 10^5 tensors is ~10 MB
INDEX_NAME = "model.safetensors.index.json"

# element bytes of every safetensors dtype (for checking offsets), and the ones GPS holds
ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
SUPPORTED = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


class ModelDirError(PivotError, ValueError):
    """A model directory that cannot be described: one line naming the file and the fix."""


@dataclass(frozen=True)
class HeaderTensor:
    """One tensor as a safetensors header declares it."""

    name: str
    dtype: str  # torch-style: "bfloat16", "float16", "float32"
    shape: tuple[int, ...]
    file: str  # file name inside the model directory
    begin: int  # absolute byte offsets of its data in that file
    end: int


def safetensors_files(model_dir: Path) -> tuple[list[str], dict[str, str] | None]:
    """(file names, weight map or None) of a directory: the index's files when it has
    `model.safetensors.index.json`, else every `*.safetensors` file, sorted."""
    index = model_dir / INDEX_NAME
    if index.is_file():
        data = read_json(index, MAX_INDEX_BYTES)
        weight_map = data.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelDirError(
                f"{index}: no 'weight_map' of tensor names to files; fix or remove the index"
            )
        for name, file in weight_map.items():
            # a plain file name of this directory: an index must not point elsewhere
            if (
                not isinstance(file, str)
                or not file.endswith(".safetensors")
                or os.sep in file
                or file.startswith(".")
            ):
                raise ModelDirError(
                    f"{index}: tensor {short_repr(name)} maps to {short_repr(file)}, not a .safetensors file of "
                    "this directory; fix the index"
                )
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (model_dir / f).is_file()]
        if missing:
            raise ModelDirError(
                f"{index}: names {missing[:3]} which are not in {model_dir}; copy the missing shards"
            )
        return files, weight_map
    files = sorted(p.name for p in model_dir.glob("*.safetensors") if p.is_file())
    if not files:
        raise ModelDirError(
            f"{model_dir}: no *.safetensors weights (pytorch_model.bin and other pickled "
            "formats are not read); save the model with safetensors"
        )
    return files, None


def read_headers(model_dir: Path) -> tuple[HeaderTensor, ...]:
    """Every tensor of the directory in file order (files by name, then by offset)."""
    files, weight_map = safetensors_files(model_dir)
    out: list[HeaderTensor] = []
    seen: dict[str, str] = {}
    for f in files:
        for t in read_header(model_dir / f):
            if t.name in seen:
                raise ModelDirError(
                    f"{model_dir}: tensor {short_repr(t.name)} is in both {seen[t.name]} and {f}; "
                    "remove the stray file"
                )
            seen[t.name] = f
            out.append(t)
    if weight_map is not None:
        wrong = [n for n, f in weight_map.items() if seen.get(n) != f]
        if wrong:
            n = wrong[0]
            raise ModelDirError(
                f"{model_dir / INDEX_NAME}: tensor {short_repr(n)} is mapped to {weight_map[n]} but "
                f"{'is in ' + seen[n] if n in seen else 'is in no file'} ({len(wrong)} such); "
                "fix the index or the shards"
            )
        extra = [n for n in seen if n not in weight_map]
        if extra:
            raise ModelDirError(
                f"{model_dir / INDEX_NAME}: {len(extra)} tensors of the shards are not in the "
                f"weight map (e.g. {short_repr(extra[0])}); fix the index"
            )
    return tuple(out)


def read_header(path: Path) -> list[HeaderTensor]:
    """The tensors one safetensors file declares, sorted by offset; validated."""
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            head = fh.read(8)
            if len(head) < 8:
                raise _corrupt(path, f"{size} bytes, shorter than the 8-byte header length")
            n = int.from_bytes(head, "little")
            if n > MAX_HEADER_BYTES:
                raise _corrupt(
                    path, f"header of {n} bytes, over safetensors' limit of {MAX_HEADER_BYTES}"
                )
            if 8 + n > size:
                raise _corrupt(path, f"header of {n} bytes in a file of {size} bytes (truncated?)")
            raw = fh.read(n)
    except OSError as exc:
        raise ModelDirError(
            f"{path}: cannot be read ({exc.strerror or exc}); check the file"
        ) from None
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        why = str(exc) if str(exc).startswith("duplicate key") else type(exc).__name__
        raise _corrupt(path, f"header is not JSON ({why[:200]})") from None
    if not isinstance(header, dict):
        raise _corrupt(path, "header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (
        isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())
    ):
        raise _corrupt(path, "__metadata__ is not a map of strings")
    data_bytes = size - 8 - n
    tensors = [_entry(path, name, e, 8 + n) for name, e in header.items()]
    tensors.sort(key=lambda t: (t.begin, t.end))
    pos = 8 + n
    for t in tensors:  # as safetensors' loader: back to back from the header's end
        if t.begin != pos:
            raise _corrupt(
                path,
                f"tensor {short_repr(t.name)} starts at data offset {t.begin - 8 - n}, expected {pos - 8 - n} (overlapping or gapped tensors)",
            )
        pos = t.end
    if pos - 8 - n != data_bytes:
        raise _corrupt(
            path,
            f"tensors hold {pos - 8 - n} bytes but the file has {data_bytes} after the header (truncated?)",
        )
    return tensors


def _entry(path: Path, name: str, e: Any, base: int) -> HeaderTensor:
    if not isinstance(e, dict):
        raise _corrupt(path, f"entry {short_repr(name)} is not an object")
    dtype, shape, offsets = e.get("dtype"), e.get("shape"), e.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in ITEMSIZE:
        raise _corrupt(path, f"tensor {short_repr(name)} has an unknown dtype {str(dtype)[:20]!r}")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise _corrupt(path, f"tensor {short_repr(name)} has no valid shape (a list of sizes >= 0)")
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(type(o) is int and o >= 0 for o in offsets)
        and offsets[0] <= offsets[1]
    ):
        raise _corrupt(path, f"tensor {short_repr(name)} has no valid data_offsets [begin, end]")
    numel = 1
    for d in shape:
        numel *= d
    if numel * ITEMSIZE[dtype] != offsets[1] - offsets[0]:
        raise _corrupt(
            path,
            f"tensor {short_repr(name)} is {shape} of {dtype} ({numel * ITEMSIZE[dtype]} bytes) but data_offsets span {offsets[1] - offsets[0]}",
        )
    if dtype not in SUPPORTED:
        raise ModelDirError(
            f"{path}: tensor {short_repr(name)} is {dtype}; pivot-hpc holds {', '.join(SUPPORTED)} "
            "tensors only (no quantised checkpoints): use a bf16, fp16 or fp32 checkpoint"
        )
    return HeaderTensor(
        name, SUPPORTED[dtype], tuple(shape), path.name, base + offsets[0], base + offsets[1]
    )


def read_json(path: Path, cap: int) -> dict:
    """A JSON object from a file of at most `cap` bytes; ModelDirError otherwise."""
    try:
        size = path.stat().st_size
        raw = path.read_bytes() if size <= cap else b""
    except OSError as exc:
        raise ModelDirError(
            f"{path}: cannot be read ({exc.strerror or exc}); check the file"
        ) from None
    if size > cap:
        raise ModelDirError(
            f"{path}: {size} bytes, over the {cap >> 20} MiB a model file may have; is it the "
            "right file?"
        )
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ModelDirError(
            f"{path}: not valid JSON ({type(exc).__name__}); fix or replace the file"
        ) from None
    if not isinstance(data, dict):
        raise ModelDirError(f"{path}: not a JSON object; fix or replace the file")
    return data


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _corrupt(path: Path, why: str) -> ModelDirError:
    return ModelDirError(f"{path}: not a valid safetensors file: {why}; re-save or re-download it")
