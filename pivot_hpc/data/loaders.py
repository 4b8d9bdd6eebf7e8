"""DAPO-Math-17k-style training rows and AIME-style validation rows from local files.

Accepted row shapes (JSON Lines, or Parquet with the same columns):
- DAPO-Math-17k: {"prompt": [{"role": "user", "content": "..."}] | "...",
                  "reward_model": {"ground_truth": "34", ...}, "extra_info": {"index": ...}}
- AIME-style:    {"problem" | "question": "...", "answer": "..."}  (or a "solution" whose
                  last \\boxed{...} is the answer)
A row that does not fit is skipped and counted by reason in the LoadReport; a load never
raises on bad rows, only on a missing or unreadable file.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pivot_hpc.data.problem import LoadReport, Problem


def _last_boxed(text: str) -> str | None:
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


def _prompt_of(row: dict) -> str | None:
    p = row.get("prompt")
    if isinstance(p, str):
        return p
    if isinstance(p, list | tuple):
        users = [m.get("content") for m in p if isinstance(m, dict) and m.get("role") == "user"]
        users = [u for u in users if isinstance(u, str)]
        return users[-1] if users else None
    for key in ("problem", "question"):
        if isinstance(row.get(key), str):
            return row[key]
    return None


def _answer_of(row: dict) -> str | None:
    rm = row.get("reward_model")
    if isinstance(rm, dict) and rm.get("ground_truth") not in (None, ""):
        return str(rm["ground_truth"])
    for key in ("answer", "ground_truth"):
        v = row.get(key)
        if isinstance(v, str | int | float) and not isinstance(v, bool) and str(v).strip():
            return str(v).strip()
    sol = row.get("solution")
    if isinstance(sol, str):
        return _last_boxed(sol)
    return None


def row_to_problem(row: Any, index: int, max_prompt_chars: int | None = None) -> Problem | str:
    """A Problem, or the reason the row is malformed."""
    if not isinstance(row, dict):
        return "not an object"
    prompt = _prompt_of(row)
    if prompt is None or not prompt.strip():
        return "no prompt"
    answer = _answer_of(row)
    if answer is None:
        return "no ground truth"
    if max_prompt_chars is not None and len(prompt) > max_prompt_chars:
        return "prompt too long"
    extra = row.get("extra_info")
    uid = row.get("id", extra.get("index") if isinstance(extra, dict) else None)
    return Problem(
        prompt=prompt, answer=answer, uid=str(uid if uid is not None else index), question=prompt
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
    path: str | Path, max_prompt_chars: int | None = None
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
        res = row_to_problem(row, i, max_prompt_chars)
        if isinstance(res, str):
            report.skip(i, res)
        else:
            out.append(res)
    report.kept = len(out)
    return out, report
