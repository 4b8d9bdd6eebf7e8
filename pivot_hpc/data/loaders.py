"""DAPO-Math-17k-style training rows and AIME-style validation rows from local files.

Accepted row shapes (JSON Lines, or Parquet with the same columns):
- DAPO-Math-17k: {"data_source": "...", "prompt": [{"role": "user", "content": "..."}] | "...",
                  "reward_model": {"ground_truth": "34", ...}, "extra_info": {"index": ...}}
- AIME-style:    {"problem" | "question": "...", "answer": "..."}  (or a "solution" whose
                  last \\boxed{...} is the answer); capitalised column names too
- anything else: name the columns (`Columns`, config rl.data.prompt_key/answer_key; a
  dotted key reaches into a nested column, e.g. "reward_model.ground_truth")
A row that does not fit is skipped and counted by reason in the LoadReport; a load never
raises on bad rows, only on a missing or unreadable file.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pivot_hpc.data.problem import LoadReport, Problem


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


def _jsonl_rows(path: Path, report: LoadReport) -> Iterator[tuple[int, Any]]:
    with path.open("r", encoding="utf-8", errors="replace") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            try:
                yield i, json.loads(line)
            except json.JSONDecodeError:
                report.rows += 1
                report.skip(i, "invalid JSON")


def _parquet_rows(path: Path) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    yield from enumerate(table.to_pylist())


def load_problems(
    path: str | Path, max_prompt_chars: int | None = None, columns: Columns = Columns()
) -> tuple[list[Problem], LoadReport]:
    """Read a .jsonl/.json-lines or .parquet file of problems; bad rows are counted."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file {str(path)!r} does not exist")
    report = LoadReport(source=str(path))
    if path.suffix == ".parquet":
        rows = _parquet_rows(path)
    elif path.suffix in (".jsonl", ".json", ".ndjson"):
        rows = _jsonl_rows(path, report)
    else:
        raise ValueError(f"dataset file {str(path)!r}: use .jsonl or .parquet")
    out: list[Problem] = []
    for i, row in rows:
        report.rows += 1
        res = row_to_problem(row, i, max_prompt_chars, columns)
        if isinstance(res, str):
            report.skip(i, res)
        else:
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
    if not found:
        raise PivotError(
            f"{key} = {str(path)!r}: no usable row ({report.summary()}); name its columns "
            f"with rl.data.prompt_key / rl.data.answer_key (now {columns.prompt!r} / "
            f"{columns.answer!r})"
        )
    return found, report
