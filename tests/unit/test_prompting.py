"""Each model's own text <-> ids (models/prompting.py), with tiny stand-ins of real
tokenizers (recipes/tiny_tokenizers.py): ChatML without a BOS (Qwen2.5/Qwen3), Llama 3's
BOS added by the tokenizer and written by its template, several end ids in
generation_config.json; and a run whose policy and GenRM have different tokenizers: the
GenRM reads its prompt and writes its judgement in its own vocabulary."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pivot_hpc.data.problem import Problem
from pivot_hpc.engines.base import SeqResult
from pivot_hpc.errors import ConfigError
from pivot_hpc.models.prompting import load_prompter, prompter_of
from pivot_hpc.models.role_check import check_dir
from pivot_hpc.models.tokenizer import build_tokenizer, encode_prompt
from pivot_hpc.recipes.tiny_arch_dirs import build_arch_dir
from pivot_hpc.rl.config import RLConfig
from pivot_hpc.rl.rewards import genrm_prompt
from pivot_hpc.runtime.live_samples import LiveSamples

QUESTION = "What is 2+3? "


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {k: build_arch_dir("qwen3", root / k, tokenizer=k) for k in ("char", "chatml", "llama3")}


def test_the_tiny_char_tokenizer_keeps_the_tiny_jobs_prompts(dirs) -> None:
    p = load_prompter(dirs["char"])
    tok = build_tokenizer()
    assert p.stop_ids == (tok.eos_token_id,) and not p.has_template
    want = [tok.bos_token_id, *tok.encode(QUESTION, add_special_tokens=False)]
    assert p.encode(QUESTION) == want == encode_prompt(tok, QUESTION)


def test_chatml_has_no_bos_and_ends_on_either_end_token(dirs) -> None:
    p = load_prompter(dirs["chatml"])
    tok = p.tok
    assert tok.bos_token_id is None
    im_end, eot = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert p.stop_ids == (im_end, eot)  # the tokenizer's EOS first, then generation_config's
    text = tok.decode(p.encode(QUESTION))
    assert text.startswith("<|im_start|>system\n") and text.endswith(
        f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    )
    plain = load_prompter(dirs["chatml"], chat=False).encode(QUESTION)
    assert tok.decode(plain) == QUESTION  # no BOS invented, although config.json names one
    assert p.decode([*tok.encode("5", add_special_tokens=False), im_end]) == "5"
    # the old helper no longer puts a None in front of a BOS-less tokenizer's prompt
    assert None not in encode_prompt(tok, QUESTION)


def test_llama3_gets_exactly_one_bos_with_or_without_its_template(dirs) -> None:
    p = load_prompter(dirs["llama3"])
    tok = p.tok
    bos = tok.bos_token_id
    templated = p.encode(QUESTION)
    plain = load_prompter(dirs["llama3"], chat=False).encode(QUESTION)
    for ids in (templated, plain):
        assert ids[0] == bos and ids.count(bos) == 1
    assert tok.decode(templated).endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    eot, end = tok.convert_tokens_to_ids(["<|eot_id|>", "<|end_of_text|>"])
    assert set(p.stop_ids) == {eot, end} and p.stop_ids[0] == eot
    # messages always go through the template, even with chat off
    chat = load_prompter(dirs["llama3"], chat=False).encode("", [("user", QUESTION)])
    assert chat == templated


def test_policy_and_genrm_each_read_and_write_with_their_own_tokenizer(dirs) -> None:
    policy, genrm = load_prompter(dirs["chatml"]), load_prompter(dirs["llama3"])
    src = LiveSamples([Problem(QUESTION, "5")], policy, RLConfig(), genrm_tok=genrm)
    assert src.rollout_sampling.stop_token_ids == policy.stop_ids
    assert src.judge_sampling.stop_token_ids == genrm.stop_ids
    s = src.make(0, 0, 0, 0)
    assert s.payload.prompt_ids == policy.encode(QUESTION)
    response = policy.tok.encode("The answer is 5.", add_special_tokens=False)
    res = SeqResult(0, s.payload.prompt_ids, [*response, policy.stop_ids[0]], [0.0] * 16, "stop", 1)
    src.on_rollout(s, len(res.token_ids), res)
    judge_text = genrm.tok.decode(s.payload.judge_ids)
    want = genrm_prompt(QUESTION, "The answer is 5.", "5")
    assert judge_text.startswith("<|begin_of_text|><|start_header_id|>user")
    assert want.strip() in judge_text  # the response, re-encoded in the GenRM's vocabulary
    judgement = [*genrm.tok.encode("Score: 10", add_special_tokens=False), genrm.stop_ids[0]]
    verdict = SeqResult(0, s.payload.judge_ids, judgement, [0.0] * len(judgement), "stop", 1)
    _, rg = src.reward(s, verdict)
    assert s.payload.judgement == "Score: 10" and rg == 1.0
    assert src.genrm_stats.unparsable == 0


def test_chat_templates_can_be_turned_off_per_role(dirs) -> None:
    cfg = RLConfig()
    cfg.data.apply_chat_template = False
    cfg.reward.genrm_chat_template = False
    policy, genrm = load_prompter(dirs["chatml"]), load_prompter(dirs["llama3"])
    src = LiveSamples([Problem(QUESTION, "5")], policy, cfg, genrm_tok=genrm)
    s = src.make(0, 0, 0, 0)
    assert policy.tok.decode(s.payload.prompt_ids) == QUESTION
    assert prompter_of(policy, chat=False).encode(QUESTION) == s.payload.prompt_ids


def test_a_tokenizer_the_runtime_cannot_use_is_refused_before_launch(dirs, tmp_path) -> None:
    from pivot_hpc.job.config import load_config

    cfg = load_config("configs/tiny.yaml", [])
    bad = shutil.copytree(dirs["chatml"], tmp_path / "bigger-vocab")
    big = build_arch_dir("qwen3", tmp_path / "small-model", vocab_size=64)  # 64 < 99 tokens
    for f in ("config.json", "model.safetensors", "generation_config.json"):
        shutil.copyfile(big / f, bad / f)
    with pytest.raises(ConfigError) as err:
        check_dir(cfg, "models.genrm_path", bad, [("reward", 1)], False)
    msg = str(err.value)
    assert "\n" not in msg and "vocab_size 64" in msg and "models.genrm_path" in msg
    noeos = shutil.copytree(dirs["chatml"], tmp_path / "no-eos")

    for name in ("config.json", "generation_config.json"):
        data = json.loads((noeos / name).read_text())
        data.pop("eos_token_id", None)
        (noeos / name).write_text(json.dumps(data))
    data = json.loads((noeos / "tokenizer_config.json").read_text())
    data["eos_token"] = None
    (noeos / "tokenizer_config.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="no end-of-sequence token"):
        check_dir(cfg, "models.genrm_path", noeos, [("reward", 1)], False)
