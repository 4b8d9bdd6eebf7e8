"""One prompt with its verifiable ground truth, and the report of a dataset load."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Problem:
    prompt: str  # the text the policy sees (already templated)
    answer: str  # ground truth for the verifiable reward
    uid: str = ""
    question: str = ""  # the bare question (what the GenRM sees); defaults to prompt
    # the chat as published ((role, content), …); a tokenizer with a chat template turns
    # it into the prompt, one without sees `prompt`
    messages: tuple[tuple[str, str], ...] = ()


@dataclass(slots=True)
class LoadReport:
    """Rows read, rows kept, and why the others were skipped (never a crash mid-run)."""

    source: str
    rows: int = 0
    kept: int = 0
    malformed: Counter = field(default_factory=Counter)  # reason -> count
    examples: list[str] = field(default_factory=list)  # first few "row N: reason"

    def skip(self, row: int, reason: str) -> None:
        self.malformed[reason] += 1
        if len(self.examples) < 5:
            self.examples.append(f"row {row}: {reason}")

    @property
    def n_malformed(self) -> int:
        return sum(self.malformed.values())

    def summary(self) -> str:
        if not self.n_malformed:
            return f"{self.source}: {self.kept}/{self.rows} rows"
        why = ", ".join(f"{k}: {v}" for k, v in self.malformed.most_common())
        return f"{self.source}: {self.kept}/{self.rows} rows kept; {self.n_malformed} malformed ({why})"
