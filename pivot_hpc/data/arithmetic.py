"""The synthetic reasoning task: multi-digit addition with a worked, column-wise answer.

    prompt   "47+38=?\n"
    response "7+8=15,4+3+1=8.Answer: 85"      (then EOS)

The answer line follows DAPO's format ("Answer: X"), so the same verifiable reward
(math-verify) scores this task and DAPO-Math-17k. A GenRM judgement is a short rationale
that compares the claim with the reference digit by digit, then a score out of 10:

    "says 85; ref 85. Score: 10"      (claim 85)
    "says 86; ref 8f. Score: 0"       (claim 86: the reference's differing 5 is written "f")

The multi-operand variant (models.operands > 2, "47+38+96=?\n") is answered without
working, or with a calculator call (models.calculator: data/calculator_task.py).
"""

from __future__ import annotations

import random
import re

from pivot_hpc.data.problem import Problem


def _columns(
    a: int, b: int, slip_col: int = -1, slip: int = 0, drop_carry: bool = False
) -> tuple[str, int]:
    """Column-wise addition, least significant first; `slip` is added to the sum of
    column `slip_col` (a plausible mistake whose carries and answer stay consistent);
    `drop_carry` forgets every carry (a systematic mistake, also self-consistent)."""
    xs, ys = str(a)[::-1], str(b)[::-1]
    carry, cols, digits = 0, [], []
    n = max(len(xs), len(ys))
    for i in range(n):
        x = int(xs[i]) if i < len(xs) else 0
        y = int(ys[i]) if i < len(ys) else 0
        s = max(0, x + y + carry + (slip if i == slip_col else 0))
        cols.append(f"{x}+{y}+{carry}={s}" if carry else f"{x}+{y}={s}")
        carry = 0 if drop_carry else s // 10
        digits.append(s % 10 if i < n - 1 else s)
    total = int("".join(str(d) for d in reversed(digits)))
    return ",".join(cols), total


def worked_solution(a: int, b: int) -> str:
    return _columns(a, b)[0]


def question(*terms: int) -> str:
    """The prompt: "47+38=?\n", or with more terms (models.operands) "47+38+96=?\n"."""
    return "+".join(str(t) for t in terms) + "=?\n"


def solution(a: int, b: int) -> str:
    return f"{worked_solution(a, b)}.Answer: {a + b}"


def has_carry(a: int, b: int) -> bool:
    """Whether some column of a + b carries into the next one."""
    return _columns(a, b, drop_carry=True)[1] != a + b


def carry_forgotten(a: int, b: int) -> str:
    """The solution of a student who never carries: "7+8=15,4+3=7.Answer: 75" for
    47+38. Self-consistent and systematic, so sampling shows it again and again — the
    kind of habit a verifiable reward exposes and RL removes."""
    cols, total = _columns(a, b, drop_carry=True)
    return f"{cols}.Answer: {total}"


def make_problem(*terms: int) -> Problem:
    q = question(*terms)
    return Problem(prompt=q, answer=str(sum(terms)), uid="+".join(map(str, terms)), question=q)


def sample_operands(rng: random.Random, max_digits: int) -> tuple[int, int]:
    da, db = rng.randint(1, max_digits), rng.randint(1, max_digits)
    return rng.randrange(10 ** (da - 1) if da > 1 else 0, 10**da), rng.randrange(
        10 ** (db - 1) if db > 1 else 0, 10**db
    )


def sample_terms(rng: random.Random, max_digits: int, n: int) -> tuple[int, ...]:
    """`n` numbers to add: two are drawn as `sample_operands` draws them (the same random
    sequence, so the two-operand task is unchanged); more have exactly `max_digits`
    digits each, so most columns carry and a mental sum is easy to get wrong."""
    if n == 2:
        return sample_operands(rng, max_digits)
    lo = 10 ** (max_digits - 1) if max_digits > 1 else 0
    return tuple(rng.randrange(lo, 10**max_digits) for _ in range(n))


def problems(n: int, seed: int = 0, max_digits: int = 2, operands: int = 2) -> list[Problem]:
    """`n` problems of `operands` numbers each (models.operands; 2 is the default task)."""
    rng = random.Random(seed)
    return [make_problem(*sample_terms(rng, max_digits, operands)) for _ in range(n)]


_Q = re.compile(r"^\s*(\d+)\+(\d+)=\?")
_TERMS = re.compile(r"^\s*(\d+(?:\+\d+)+)=\?")


def operands(q: str) -> tuple[int, int] | None:
    m = _Q.match(q)
    return (int(m.group(1)), int(m.group(2))) if m else None


def terms(q: str) -> tuple[int, ...] | None:
    """The numbers a question adds, however many ("47+38+96=?" → (47, 38, 96))."""
    m = _TERMS.match(q)
    return tuple(int(x) for x in m.group(1).split("+")) if m else None


def corrupt(response: str, rng: random.Random, q: str | None = None) -> str:
    """A plausible wrong response. With the question given, most are self-consistent:
    one column summed wrong (carries and answer follow from it) or a misread operand —
    the errors a weak policy makes — so a judge cannot score by copying the response's
    own columns; the rest change the final answer, slip a digit, or drop the answer."""
    kind = rng.random()
    ops = operands(q) if q is not None else None
    if ops is not None and kind < 0.35:
        a, b = ops
        n = max(len(str(a)), len(str(b)))
        cols, total = _columns(a, b, rng.randrange(n), rng.choice([-2, -1, 1, 1, 2, 3]))
        if total != a + b:
            return f"{cols}.Answer: {total}"
    if ops is not None and kind < 0.55:
        a, b = ops
        which = rng.randrange(2)
        x = str((a, b)[which])
        i = rng.randrange(len(x))
        d = (int(x[i]) + rng.randint(1, 9)) % 10
        if i == 0 and d == 0 and len(x) > 1:
            d = 1 + (d % 9)
        y = int(x[:i] + str(d) + x[i + 1 :])
        return solution(y, b) if which == 0 else solution(a, y)
    m = re.search(r"Answer: (\d+)$", response)
    if kind < 0.8 and m:
        v = int(m.group(1))
        wrong = v + rng.choice([-11, -10, -9, -2, -1, 1, 2, 9, 10, 11])
        return response[: m.start(1)] + str(max(0, wrong) if wrong != v else v + 1)
    if kind < 0.92 and m:
        digits = [i for i, c in enumerate(response[: m.start()]) if c.isdigit()]
        i = rng.choice(digits)
        r = list(response)
        r[i] = str((int(r[i]) + rng.randint(1, 9)) % 10)
        v = int(m.group(1)) + rng.choice([-1, 1, 10])
        return "".join(r[: m.start(1)]) + str(max(v, 0))
    return response.split(".Answer")[0]


_MARK = "abcdefghij"  # digit d that does not match is written as _MARK[d]


def marked_copy(true: str, claimed: str) -> str:
    """The claimed answer copied digit by digit, each digit that differs from the true
    answer's digit at the same place written as a letter (a=0 … j=9); a claim of another
    length is all letters. One token per digit keeps every lookup at a fixed offset, so
    a tiny judge learns the comparison; the score then only asks "is there a letter"."""
    if not claimed.isdigit():
        return "none"
    if len(claimed) != len(true):
        return "".join(_MARK[int(c)] for c in claimed)
    return "".join(c if c == t else _MARK[int(c)] for t, c in zip(true, claimed, strict=True))


def judgement(q: str, response: str, max_score: int = 10, reference: str | None = None) -> str:
    """The GenRM's target text: a short rationale, then the score.

    Reference-guided (the GenRM prompt carries the reference answer, as DAPO rows do):
        "says 86; ref 8f. Score: 0"      (claim 86 vs reference 85: the 5 is written "f")
    Without a reference the judge must redo the sum first:
        "check 7+8=15,4+3+1=8 so 85; says 8g. Score: 0"
    """
    ts = terms(q)
    assert ts is not None
    m = re.search(r"Answer:\s*(\d+)\s*$", response)
    claimed = m.group(1) if m else "none"
    true = str(sum(ts))
    score = max_score if m is not None and claimed == true else 0
    if reference is not None:
        # copy the claim first (nothing nearby to confuse it with), then the reference
        # marked against it: every lookup is at a fixed offset or after a fixed label
        return f"says {claimed}; ref {marked_copy(claimed, reference)}. Score: {score}"
    a, b = ts  # the worked check exists for two operands only (the default task)
    says = marked_copy(true, claimed)
    return f"check {worked_solution(a, b)} so {true}; says {says}. Score: {score}"
