"""DAPO-Math-17k-style training rows and AIME-style validation rows from local files.

Accepted row shapes (JSON Lines, or Parquet with the same columns):
- DAPO-Math-17k: {"data_source": "...", "prompt": [{"role": "user", "content": "..."}] | "...",
                  "reward_model": {"ground_truth": "34", ...}, "extra_info": {"index": ...}}
- AIME-style:    {"problem" | "question": "...", "answer": "..."}  (or a "solution" whose
                  last \\boxed{...} is the answer); capitalised column names too
- anything else: name the columns (`Columns`, config rl.data.prompt_key/answer_key; a
  dotted key reaches into a nested column, e.g. "reward_model.ground_truth")
A row that does not fit is skipped and counted by reason in the LoadReport; a load never
raises on bad rows, only on a missing or unreadable file, or one past the caps below.

Caps: a dataset is held in memory, and a 424 KB Parquet file whose one dictionary-encoded
prompt repeats 2 M times expands to 4 GB of text. So files are read in batches (Parquet:
first a pass over Arrow buffers that measures what the rows would become, before any Python
object is made; JSONL: line by line, each line bounded) and refused past MAX_ROWS rows,
MAX_FIELD_CHARS characters in one value (MAX_LINE_CHARS in one JSONL line), or
MAX_TOTAL_CHARS characters in all. The caps sit well above published math datasets
(DAPO-Math-17k as published: 1.8 M rows, about 1 G characters).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pivot_hpc.data.problem import LoadReport, Problem

MAX_ROWS = 10_000_000
MAX_FIELD_CHARS = 1_000_000  # one prompt, answer or solution
MAX_LINE_CHARS = 4 * MAX_FIELD_CHARS  # one JSONL row, all its fields
MAX_TOTAL_CHARS = 2**31  # text of the columns the loader reads (Parquet) or keeps (JSONL)
MAX_VALUES = 50_000_000  # values of those columns: each becomes a Python object
PARQUET_BATCH_ROWS = 256  # memory of one batch stays ~MAX_FIELD_CHARS x this, at worst

# Top-level columns `row_to_problem` may look at besides the configured ones: the rest of
# a Parquet file is never decoded.
KNOWN_COLUMNS = (
    "prompt",
    "problem",
    "question",
    "Problem",
    "Question",
    "reward_model",
    "answer",
    "ground_truth",
    "Answer",
    "solution",
    "extra_info",
    "id",
)


class DatasetTooLarge(ValueError):
    """The file is past a cap of this loader (one line: the file, the cap, what to do)."""


@dataclass(frozen=True)
class Columns:
    """Where a row keeps its prompt and answer (tried before the known layouts)."""

    prompt: str = "prompt"
    answer: str = "reward_model.ground_truth"


def _get(row: dict, dotted: str) -> Any:
    value: Any = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _messages(value: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, list | tuple):
        return ()
    out = tuple(
        (m["role"], m["content"])
        for m in value
        if isinstance(m, dict)
        and isinstance(m.get("role"), str)
        and isinstance(m.get("content"), str)
    )
    return out if len(out) == len(value) else ()


def last_boxed(text: str) -> str | None:
    i = text.rfind("\\boxed{")
    if i < 0:
        return None
    depth, start = 0, i + len("\\boxed{")
    for j in range(start, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            if depth == 0:
                return text[start:j]
            depth -= 1
    return None


def _prompt_of(row: dict, key: str = "prompt") -> str | None:
    p = _get(row, key)
    if p is None:
        p = row.get("prompt")
    if isinstance(p, str):
        return p
    if isinstance(p, list | tuple):
        users = [m.get("content") for m in p if isinstance(m, dict) and m.get("role") == "user"]
        users = [u for u in users if isinstance(u, str)]
        return users[-1] if users else None
    for name in ("problem", "question", "Problem", "Question"):
        if isinstance(row.get(name), str):
            return row[name]
    return None


def _answer_of(row: dict, key: str = "reward_model.ground_truth") -> str | None:
    v = _get(row, key)
    if isinstance(v, str | int | float) and not isinstance(v, bool) and str(v).strip():
        return str(v).strip()
    rm = row.get("reward_model")
    if isinstance(rm, dict) and rm.get("ground_truth") not in (None, ""):
        return str(rm["ground_truth"])
    for name in ("answer", "ground_truth", "Answer"):
        v = row.get(name)
        if isinstance(v, str | int | float) and not isinstance(v, bool) and str(v).strip():
            return str(v).strip()
    sol = row.get("solution")
    if isinstance(sol, str):
        return last_boxed(sol)
    return None


def row_to_problem(
    row: Any, index: int, max_prompt_chars: int | None = None, columns: Columns = Columns()
) -> Problem | str:
    """A Problem, or the reason the row is malformed."""
    if not isinstance(row, dict):
        return "not an object"
    prompt = _prompt_of(row, columns.prompt)
    if prompt is None or not prompt.strip():
        return "no prompt"
    answer = _answer_of(row, columns.answer)
    if answer is None:
        return "no ground truth"
    if max_prompt_chars is not None and len(prompt) > max_prompt_chars:
        return "prompt too long"
    extra = row.get("extra_info")
    uid = row.get("id", extra.get("index") if isinstance(extra, dict) else None)
    chat = _get(row, columns.prompt)
    return Problem(
        prompt=prompt,
        answer=answer,
        uid=str(uid if uid is not None else index),
        question=prompt,
        messages=_messages(chat if chat is not None else row.get("prompt")),
    )


def _too_large(path: Path, what: str) -> DatasetTooLarge:
    return DatasetTooLarge(
        f"dataset file {str(path)!r} {what}; keep only the rows you train on (split or "
        "deduplicate the file; caps in pivot_hpc/data/loaders.py)"
    )


def _read_line(f: Any, path: Path, lineno: int) -> str:
    """The next line, never more than MAX_LINE_CHARS of it in memory."""
    line = f.readline(MAX_LINE_CHARS + 1)
    if len(line) > MAX_LINE_CHARS:
        raise _too_large(path, f"line {lineno + 1} is longer than {MAX_LINE_CHARS} characters")
    return line


def _jsonl_rows(path: Path, report: LoadReport) -> Iterator[tuple[int, Any]]:
    with path.open("r", encoding="utf-8", errors="replace") as f:
        i = 0
        while line := _read_line(f, path, i):
            if i >= MAX_ROWS:
                raise _too_large(path, f"has more than {MAX_ROWS} rows")
            if line.strip():
                try:
                    row = json.loads(line)
                except (ValueError, RecursionError) as exc:
                    # ValueError: JSONDecodeError, and ints past Python's int-str digit limit;
                    # RecursionError: a line of 100 000 '[' (counted, not a traceback)
                    report.rows += 1
                    deep = isinstance(exc, RecursionError)
                    report.skip(i, "nested too deeply" if deep else "invalid JSON")
                else:
                    yield i, row
            i += 1


def _needed_columns(names: list[str], columns: Columns) -> list[str]:
    wanted = {columns.prompt.split(".")[0], columns.answer.split(".")[0], *KNOWN_COLUMNS}
    return [n for n in names if n in wanted]


def _is_text(t: Any) -> bool:
    import pyarrow as pa

    return (
        pa.types.is_string(t)
        or pa.types.is_large_string(t)
        or pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
    )


def _measure(arr: Any) -> tuple[int, int, int]:
    """(characters, longest value, values) of Arrow array `arr` once made Python objects,
    from its buffers: string bytes (>= characters), nested lists and structs included."""
    import pyarrow as pa
    import pyarrow.compute as pc

    t = arr.type
    if pa.types.is_dictionary(t):
        if not _is_text(t.value_type):
            return _measure(arr.dictionary_decode())
        # each row costs its dictionary entry: measured without expanding the strings
        lengths = pc.take(pc.binary_length(arr.dictionary), arr.indices)
        return (*_sum_max(lengths), len(arr) - arr.null_count)
    if _is_text(t):
        return (*_sum_max(pc.binary_length(arr)), len(arr) - arr.null_count)
    if pa.types.is_struct(t):
        parts = [_measure(child) for child in arr.flatten()]
        chars = sum(p[0] for p in parts)
        return chars, max((p[1] for p in parts), default=0), sum(p[2] for p in parts) + len(arr)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        chars, longest, values = _measure(arr.flatten())  # maps are lists of structs
        return chars, longest, values + len(arr)
    return 0, 0, len(arr)  # numbers, booleans, nulls: one object each


def _sum_max(lengths: Any) -> tuple[int, int]:
    import pyarrow.compute as pc

    return int(pc.sum(lengths).as_py() or 0), int(pc.max(lengths).as_py() or 0)


def _check_parquet(path: Path, pf: Any, cols: list[str]) -> None:
    """Refuse the file past a cap before any of its rows becomes Python objects."""
    chars = values = 0
    for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=cols):
        for name, column in zip(batch.schema.names, batch.columns, strict=True):
            c, longest, v = _measure(column)
            if longest > MAX_FIELD_CHARS:
                raise _too_large(
                    path,
                    f"has a value of {longest} characters in column {name!r}, more than the "
                    f"cap of {MAX_FIELD_CHARS} per field",
                )
            chars, values = chars + c, values + v
        if chars > MAX_TOTAL_CHARS:
            raise _too_large(
                path, f"expands to more than the cap of {MAX_TOTAL_CHARS} characters of text"
            )
        if values > MAX_VALUES:
            raise _too_large(path, f"expands to more than the cap of {MAX_VALUES} values")


def _parquet_rows(path: Path, columns: Columns) -> Iterator[tuple[int, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        rows = pf.metadata.num_rows
        if rows > MAX_ROWS:
            raise _too_large(path, f"has {rows} rows, more than the cap of {MAX_ROWS}")
        cols = _needed_columns(pf.schema_arrow.names, columns)
        if not cols:  # nothing the loader could use: every row is "no prompt"
            yield from ((i, {}) for i in range(rows))
            return
        _check_parquet(path, pf, cols)
        i = 0
        for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=cols):
            for row in batch.to_pylist():
                yield i, row
                i += 1
    except pa.ArrowException as exc:  # ArrowNotImplementedError, ArrowTypeError, …
        if isinstance(exc, MemoryError):
            raise
        first = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        raise ValueError(
            f"dataset file {str(path)!r} is not a readable Parquet file ({first})"
        ) from None


def load_problems(
    path: str | Path, max_prompt_chars: int | None = None, columns: Columns = Columns()
) -> tuple[list[Problem], LoadReport]:
    """Read a .jsonl/.json-lines or .parquet file of problems; bad rows are counted."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file {str(path)!r} does not exist")
    report = LoadReport(source=str(path))
    if path.suffix == ".parquet":
        rows = _parquet_rows(path, columns)
    elif path.suffix in (".jsonl", ".json", ".ndjson"):
        rows = _jsonl_rows(path, report)
    else:
        raise ValueError(f"dataset file {str(path)!r}: use .jsonl or .parquet")
    out: list[Problem] = []
    kept_chars = 0
    for i, row in rows:
        report.rows += 1
        res = row_to_problem(row, i, max_prompt_chars, columns)
        if isinstance(res, str):
            report.skip(i, res)
            continue
        # what stays in memory (a JSONL file's total; Parquet was measured before)
        kept_chars += len(res.prompt) + len(res.answer)
        if kept_chars > MAX_TOTAL_CHARS:
            raise _too_large(path, f"holds more than the cap of {MAX_TOTAL_CHARS} characters")
        out.append(res)
    report.kept = len(out)
    return out, report


def usable_problems(
    path: str | Path, key: str, columns: Columns = Columns()
) -> tuple[list[Problem], LoadReport]:
    """`load_problems`, with one clear error naming config key `key` when the file cannot be
    read or not one row fits (so a run never starts on an empty dataset)."""
    from pivot_hpc.errors import PivotError

    try:
        found, report = load_problems(path, columns=columns)
    except (OSError, ValueError) as exc:
        raise PivotError(f"{key} = {str(path)!r}: {exc}") from None
    except MemoryError:
        raise PivotError(
            f"{key} = {str(path)!r}: ran out of memory reading it; use a smaller file"
        ) from None
    except RecursionError:  # a structure too deep for a Parquet row's Python conversion
        raise PivotError(f"{key} = {str(path)!r}: rows nested too deeply to read") from None
    if not found:
        raise PivotError(
            f"{key} = {str(path)!r}: no usable row ({report.summary()}); name its columns "
            f"with rl.data.prompt_key / rl.data.answer_key (now {columns.prompt!r} / "
            f"{columns.answer!r})"
        )
    return found, report
