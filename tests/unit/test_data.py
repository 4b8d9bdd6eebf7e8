"""Synthetic task, tokenizer, and DAPO/AIME-style loaders with malformed-row counting."""

from __future__ import annotations

import json
import random

import pytest

from pivot_hpc.data import arithmetic
from pivot_hpc.data.loaders import load_problems
from pivot_hpc.models.tokenizer import build_tokenizer, load_tokenizer
from pivot_hpc.rl.rewards import parse_genrm_score, verifiable_reward


def test_worked_solutions_are_correct_and_verifiable():
    rng = random.Random(0)
    for _ in range(200):
        a, b = arithmetic.sample_operands(rng, 3)
        sol = arithmetic.solution(a, b)
        assert sol.endswith(f"Answer: {a + b}")
        assert verifiable_reward(sol, str(a + b)) == 1.0
    assert arithmetic.solution(47, 38) == "7+8=15,4+3+1=8.Answer: 85"
    assert arithmetic.solution(5, 95) == "5+5=10,0+9+1=10.Answer: 100"


def test_problems_deterministic_per_seed():
    assert arithmetic.problems(20, seed=3) == arithmetic.problems(20, seed=3)
    assert arithmetic.problems(20, seed=3) != arithmetic.problems(20, seed=4)


def test_judgements_score_correctness():
    rng = random.Random(1)
    q = arithmetic.question(47, 38)
    good = arithmetic.solution(47, 38)
    assert parse_genrm_score(arithmetic.judgement(q, good)) == 10
    for _ in range(50):
        bad = arithmetic.corrupt(good, rng, q)
        expected = 10 if bad.endswith("Answer: 85") else 0
        assert parse_genrm_score(arithmetic.judgement(q, bad)) == expected
        assert parse_genrm_score(arithmetic.judgement(q, bad, reference="85")) == expected
    assert arithmetic.judgement(q, good, reference="85") == "says 85; ref 85. Score: 10"
    assert arithmetic.judgement(q, "Answer: 86", reference="85") == "says 86; ref 8f. Score: 0"
    assert arithmetic.judgement(q, "no answer", reference="85") == "says none; ref if. Score: 0"
    assert arithmetic.judgement(q, good).startswith("check 7+8=15,4+3+1=8 so 85; says 85.")


def test_char_tokenizer_roundtrip(tmp_path):
    tok = build_tokenizer()
    text = "12+34=?\n4+2=6.Answer: 46 \\boxed{x}  ~"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text) and tok.decode(ids) == text
    tok.save_pretrained(tmp_path)
    tok2 = load_tokenizer(tmp_path)
    assert tok2.encode(text, add_special_tokens=False) == ids
    assert (tok2.pad_token_id, tok2.bos_token_id, tok2.eos_token_id) == (0, 1, 2)
    assert len(tok2) == 99


def _write_jsonl(path, rows):
    with path.open("w") as f:
        for r in rows:
            f.write(r if isinstance(r, str) else json.dumps(r))
            f.write("\n")


GOOD_DAPO = {
    "data_source": "math_dapo",
    "prompt": [{"role": "user", "content": "Solve x+1=3."}],
    "ability": "MATH",
    "reward_model": {"ground_truth": "2", "style": "rule-lighteval/MATH_v2"},
    "extra_info": {"index": "abc"},
}


def test_dapo_and_aime_rows_with_malformed_ones_counted(tmp_path):
    path = tmp_path / "train.jsonl"
    _write_jsonl(
        path,
        [
            GOOD_DAPO,
            {"problem": "AIME: find n.", "answer": "204", "id": 7},
            {"problem": "From a solution", "solution": "... so \\boxed{\\frac{3}{4}}."},
            "{not json",
            {"prompt": [{"role": "user", "content": "no truth"}]},
            {"answer": "5"},
            [1, 2, 3],
            {"question": "x" * 50, "answer": "1"},
            "",
        ],
    )
    probs, rep = load_problems(path, max_prompt_chars=40)
    assert [p.answer for p in probs] == ["2", "204", "\\frac{3}{4}"]
    assert probs[0].prompt == "Solve x+1=3." and probs[0].uid == "abc"
    assert probs[1].uid == "7"
    assert rep.rows == 8 and rep.kept == 3 and rep.n_malformed == 5
    assert rep.malformed == {
        "invalid JSON": 1,
        "no ground truth": 1,
        "no prompt": 1,
        "not an object": 1,
        "prompt too long": 1,
    }
    assert "5 malformed" in rep.summary()


def test_parquet_rows(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [
        {"problem": "p1", "answer": "1"},
        {"problem": "p2", "answer": None},
        {"problem": None, "answer": "3"},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "aime.parquet")
    probs, rep = load_problems(tmp_path / "aime.parquet")
    assert [p.prompt for p in probs] == ["p1"]
    assert rep.n_malformed == 2


def test_missing_or_unknown_files(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_problems(tmp_path / "nope.jsonl")
    (tmp_path / "x.csv").write_text("a")
    with pytest.raises(ValueError):
        load_problems(tmp_path / "x.csv")


def test_marked_copy():
    assert arithmetic.marked_copy("85", "85") == "85"
    assert arithmetic.marked_copy("85", "86") == "8g"
    assert arithmetic.marked_copy("121", "111") == "1b1"
    assert arithmetic.marked_copy("85", "185") == "bif"  # other length: all letters
    assert arithmetic.marked_copy("85", "none") == "none"


# ------------------------------------------------ published layouts, columns, chat templates
def dapo_parquet(path, rows):
    """A file in DAPO-Math-17k's exact parquet layout (struct and list-of-struct columns)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
            ("ability", pa.string()),
            ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
            ("extra_info", pa.struct([("index", pa.string())])),
        ]
    )
    table = pa.Table.from_pylist(
        [
            {
                "data_source": "math_dapo",
                "prompt": [{"content": q, "role": "user"}],
                "ability": "MATH",
                "reward_model": {"ground_truth": a, "style": "rule-lighteval/MATH_v2"},
                "extra_info": {"index": f"uid-{i}"},
            }
            for i, (q, a) in enumerate(rows)
        ],
        schema=schema,
    )
    pq.write_table(table, path)


CHAT = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_dapo_math_17k_parquet_as_published_with_a_chat_template(tmp_path):
    from pivot_hpc.models.tokenizer import encode_prompt

    path = tmp_path / "dapo-math-17k.parquet"
    dapo_parquet(path, [("What is 2+3? Answer: $Answer", "5"), ("Solve x+1=3.", "2")])
    found, report = load_problems(path)
    assert report.kept == 2 and [p.answer for p in found] == ["5", "2"]
    assert found[0].uid == "uid-0" and found[0].messages == (("user", found[0].prompt),)
    tok = build_tokenizer()
    plain = encode_prompt(tok, found[0].prompt, found[0].messages)  # no template: BOS + text
    assert plain == [tok.bos_token_id, *tok.encode(found[0].prompt, add_special_tokens=False)]
    tok.chat_template = CHAT
    templated = encode_prompt(tok, found[0].prompt, found[0].messages)
    want = f"<user>{found[0].prompt}\n<assistant>"
    assert tok.decode(templated) == want


def test_aime_files_as_published_and_named_columns(tmp_path):
    from pivot_hpc.data.loaders import Columns

    aime = tmp_path / "aime_2024.jsonl"
    rows = [{"ID": "2024-I-1", "Problem": "Find 1+1.", "Solution": "...", "Answer": 2}]
    aime.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (p,), _ = load_problems(aime)
    assert (p.prompt, p.answer, p.messages) == ("Find 1+1.", "2", ())
    custom = tmp_path / "custom.jsonl"
    custom.write_text(json.dumps({"q": "2*3?", "meta": {"gold": "6"}}) + "\n")
    assert load_problems(custom)[1].kept == 0  # nothing it knows
    (c,), _ = load_problems(custom, columns=Columns("q", "meta.gold"))
    assert (c.prompt, c.answer) == ("2*3?", "6")


def test_a_dataset_without_usable_rows_is_one_line_before_launch(tmp_path, capsys, monkeypatch):
    from pathlib import Path

    from pivot_hpc.cli.main import main

    tiny = str(Path(__file__).parents[2] / "configs" / "tiny.yaml")
    data = tmp_path / "custom.jsonl"
    data.write_text(json.dumps({"q": "2*3?", "meta": {"gold": "6"}}) + "\n")
    monkeypatch.setenv("PATH", str(tmp_path))  # no mpirun: a launch would fail loudly
    run = ["run", tiny, "--run-dir", str(tmp_path / "r"), f"rl.data.train={data}"]
    assert main(run) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "rl.data.train" in err and "prompt_key" in err
    assert main([*run, "rl.data.prompt_key=q", "rl.data.answer_key=meta.gold"]) == 2
    assert "mpirun not found" in capsys.readouterr().err  # the data passed: it got to launch
