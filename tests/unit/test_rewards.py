"""Verifiable reward (DAPO extraction + math-verify), GenRM parsing, reward combination."""

from __future__ import annotations

import pytest

from pivot_hpc.rl.config import RewardConfig
from pivot_hpc.rl.rewards import (
    GenRMStats,
    combine,
    extract_answer,
    genrm_prompt,
    genrm_rewards,
    parse_genrm_score,
    verifiable_reward,
)


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("7+8=15,4+3+1=8.Answer: 85", "85"),
        ("first Answer: 3\nthen\nAnswer: 4", "4"),  # the last answer line counts
        ("so the result is \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("Answer: 12.", "12"),
        ("no answer here", None),
        ("Answer:   ", None),
    ],
)
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


def test_verifiable_reward_dapo_scores():
    assert verifiable_reward("work.Answer: 85", "85") == 1.0
    assert verifiable_reward("work.Answer: 86", "85") == -1.0
    assert verifiable_reward("no answer", "85") == -1.0
    # math-verify equivalence, not string equality
    assert verifiable_reward("Answer: $\\frac{2}{4}$", "\\frac{1}{2}") == 1.0
    assert verifiable_reward("\\boxed{0.5}", "\\frac12") == 1.0
    cfg = RewardConfig(correct_score=1.0, wrong_score=0.0)
    assert verifiable_reward("Answer: 7", "8", cfg) == 0.0


def test_verifiable_reward_off_main_thread():
    import threading

    out = []
    t = threading.Thread(target=lambda: out.append(verifiable_reward("Answer: 42", "42")))
    t.start()
    t.join(30)
    assert out == [1.0]


def test_parse_genrm_score():
    assert parse_genrm_score("check ... Score: 10") == 10.0
    assert parse_genrm_score("Score: 3 then revised. Score: 7") == 7.0
    assert parse_genrm_score("score: 4.5") == 4.5
    assert parse_genrm_score("Score: 15") == 10.0  # clamped
    assert parse_genrm_score("Score: -2") == 0.0
    assert parse_genrm_score("Score: ten") is None
    assert parse_genrm_score("") is None


def test_genrm_rewards_count_unparsable():
    stats = GenRMStats()
    r = genrm_rewards(["x Score: 10", "garbage", "Score: 5", "Score:"], RewardConfig(), stats)
    assert r == [1.0, 0.0, 0.5, 0.0]
    assert stats.judged == 4 and stats.unparsable == 2
    assert stats.examples == ["garbage", "Score:"]


def test_combine_weights():
    assert combine([1.0, -1.0], [0.5, 1.0]) == [1.5, 0.0]  # R = R_DAPO + R_GenRM
    cfg = RewardConfig(verifiable_weight=2.0, genrm_weight=0.5)
    assert combine([1.0], [1.0], cfg) == [2.5]
    with pytest.raises(ValueError):
        combine([1.0], [], cfg)


def test_genrm_prompt_contains_question_and_response():
    p = genrm_prompt("1+2=?\n", "1+2=3.Answer: 3")
    assert p.startswith("1+2=?\n1+2=3.Answer: 3") and p.endswith("Judge: ")
    assert "Reference" not in p
    p = genrm_prompt("1+2=?\n", "1+2=3.Answer: 3", reference="3")
    assert p.endswith("\nReference: 3\nJudge: ")
