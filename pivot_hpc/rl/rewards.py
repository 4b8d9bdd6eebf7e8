"""Rewards of paper §8.1: R = R_verifiable (DAPO) + R_GenRM, weights configurable.

- Verifiable: DAPO-style extraction (the last "Answer: X" line, else the last \\boxed{X},
  read after the last tool observation of a multi-turn response — never inside one),
  then `math_verify.verify(parse(gold), parse(pred))`. Correct → correct_score (DAPO: +1),
  wrong or missing → wrong_score (DAPO: −1).
- GenRM: the GenRM sees the question, the response and (by default) the reference
  answer (`genrm_prompt`), writes a short
  rationale, then "Score: S" with S in [0, max]. `parse_genrm_score` takes the last
  such score; anything unparsable scores 0 and is counted. R_GenRM = S / max ∈ [0, 1].
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from pivot_hpc.agentic.tools import RESULT_CLOSE
from pivot_hpc.data.loaders import last_boxed
from pivot_hpc.rl.config import RewardConfig

GENRM_TEMPLATE = "{question}{response}\nJudge: "
GENRM_TEMPLATE_REF = "{question}{response}\nReference: {reference}\nJudge: "

_ANSWER = re.compile(r"Answer\s*:\s*([^\n]*)", re.IGNORECASE)
_SCORE = re.compile(r"Score\s*:\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)


def final_text(response: str) -> str:
    """What the policy wrote after its last tool observation ("<result>…</result>"): the
    final answer lives there. A calculator's result is not the policy's answer, and
    an answer written before a later call was superseded by it."""
    return response.rpartition(RESULT_CLOSE)[2]


def extract_answer(response: str) -> str | None:
    """DAPO's answer: the text after the last "Answer:"; else the last \\boxed{...};
    both read in `final_text` (after the last tool observation)."""
    response = final_text(response)
    found = [m.strip() for m in _ANSWER.findall(response)]
    found = [f for f in found if f]
    if found:
        return found[-1].rstrip(".").strip()
    boxed = last_boxed(response)
    return boxed.strip() if boxed else None


def _mv_kwargs() -> dict:
    # math-verify's parse/verify use signal.alarm, which only works in the main thread.
    if threading.current_thread() is threading.main_thread():
        return {}
    return {"parsing_timeout": None}


def is_correct(pred: str, gold: str) -> bool:
    from math_verify import parse, verify

    kw = _mv_kwargs()
    g = parse(f"${gold}$", **kw) or parse(gold, **kw)
    p = parse(f"${pred}$", **kw) or parse(pred, **kw)
    if not g or not p:
        return False
    vkw = {} if not kw else {"timeout_seconds": None}
    return bool(verify(g, p, **vkw))


def overlong_penalty(length: int, max_len: int, cfg: RewardConfig) -> float:
    """DAPO's soft overlong punishment of a response of `length` tokens (limit `max_len`):
    0 up to max_len − buffer, then linear down to −factor at max_len (and beyond)."""
    buffer = cfg.overlong_buffer_len
    if buffer <= 0:
        return 0.0
    over = length - (max_len - buffer)
    if over <= 0:
        return 0.0
    return -cfg.overlong_penalty_factor * min(over / buffer, 1.0)


def verifiable_reward(response: str, gold: str, cfg: RewardConfig | None = None) -> float:
    cfg = cfg or RewardConfig()
    pred = extract_answer(response)
    if pred is None:
        return cfg.wrong_score
    return cfg.correct_score if is_correct(pred, gold) else cfg.wrong_score


def score_answers(
    responses: list[str], golds: list[str], cfg: RewardConfig | None = None
) -> tuple[float, float]:
    """(mean verifiable reward, accuracy) of `responses` against their reference answers."""
    cfg = cfg or RewardConfig()
    rv = [verifiable_reward(r, g, cfg) for r, g in zip(responses, golds, strict=True)]
    n = max(len(rv), 1)
    return sum(rv) / n, sum(v == cfg.correct_score for v in rv) / n


def genrm_prompt(question: str, response: str, reference: str | None = None) -> str:
    """The GenRM's prompt; with `reference` (the dataset's ground truth) it is a
    reference-guided judge, which a tiny model learns reliably (see arithmetic.judgement)."""
    if reference is None:
        return GENRM_TEMPLATE.format(question=question, response=response)
    return GENRM_TEMPLATE_REF.format(question=question, response=response, reference=reference)


def parse_genrm_score(text: str, max_score: float = 10.0) -> float | None:
    """The last "Score: S" in the judgement, clamped to [0, max]; None if there is none."""
    found = _SCORE.findall(text)
    if not found:
        return None
    try:
        s = float(found[-1])
    except ValueError:
        return None
    return min(max(s, 0.0), max_score)


@dataclass(slots=True)
class GenRMStats:
    judged: int = 0
    unparsable: int = 0
    examples: list[str] = field(default_factory=list)  # a few unparsable judgements


def genrm_rewards(
    judgements: Sequence[str], cfg: RewardConfig | None = None, stats: GenRMStats | None = None
) -> list[float]:
    """R_GenRM ∈ [0, 1] for each judgement; unparsable → 0 (and counted in `stats`)."""
    cfg = cfg or RewardConfig()
    out = []
    for text in judgements:
        s = parse_genrm_score(text, cfg.genrm_max_score)
        if stats is not None:
            stats.judged += 1
            if s is None:
                stats.unparsable += 1
                if len(stats.examples) < 3:
                    stats.examples.append(text[-80:])
        out.append(0.0 if s is None else s / cfg.genrm_max_score)
    return out


def combine(
    r_verifiable: Sequence[float], r_genrm: Sequence[float], cfg: RewardConfig | None = None
) -> list[float]:
    """R = w_v·R_verifiable + w_g·R_GenRM (paper §8.1 uses w_v = w_g = 1)."""
    cfg = cfg or RewardConfig()
    if len(r_verifiable) != len(r_genrm):
        raise ValueError("combine: reward lists differ in length")
    return [
        cfg.verifiable_weight * v + cfg.genrm_weight * g
        for v, g in zip(r_verifiable, r_genrm, strict=True)
    ]
