"""The multi-operand task answered with a calculator call (issue 37 §6): warm-up data in
the turn loop's own syntax, the observation out of the loss, the reward reading the final
answer, and the default task (data, cache keys) untouched."""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import asdict

import pytest

from pivot_hpc.agentic.tools import RESULT_CLOSE, RESULT_OPEN, Invocation, build_registry
from pivot_hpc.data import arithmetic, calculator_task
from pivot_hpc.models.config import ModelsConfig
from pivot_hpc.models.tokenizer import build_tokenizer, decode_response
from pivot_hpc.models.zoo import FORMAT_VERSION, model_dir, spec_key
from pivot_hpc.recipes.sft import Teacher, encode_target, genrm_example, sft_batch
from pivot_hpc.rl.rewards import extract_answer, verifiable_reward

TERMS = (47, 38, 96)


def test_the_teachers_call_is_what_the_registry_reads_and_the_evaluator_answers() -> None:
    segs = calculator_task.tool_solution(TERMS)
    assert calculator_task.text(segs) == "<calc>47+38+96</calc><result>181</result>Answer: 181"
    call, obs, answer = segs
    registry = build_registry(["calculator"])
    assert any(call[0].endswith(s) for s in registry.stop_strings())  # a turn ends there
    parsed = registry.parse_call(call[0])
    assert isinstance(parsed, Invocation) and parsed.args == {"expression": "47+38+96"}
    assert obs == (f"{RESULT_OPEN}181{RESULT_CLOSE}", 0) and call[1] == answer[1] == 1
    # the head-sum forgets carries: right only when no column carries
    assert calculator_task.mental_solution(TERMS) == [("Answer: 161", 1)]
    assert calculator_task.carry_dropped_sum((12, 31, 25)) == 68


def test_the_char_tokenizer_keeps_every_tag_and_masks_exactly_the_observation() -> None:
    tok = build_tokenizer()
    segs = calculator_task.tool_solution(TERMS)
    ids, mask = encode_target(tok, segs)
    assert decode_response(tok, ids) == calculator_task.text(segs)  # round trip
    assert ids[-1] == tok.eos_token_id and len(mask) == len(ids)
    hidden = "".join(tok.decode([t]) for t, m in zip(ids, mask, strict=True) if m == 0)
    assert hidden == "<result>181</result>"


def test_warm_up_batches_carry_the_mask_and_slip_at_the_configured_rate() -> None:
    tok = build_tokenizer()
    teacher = Teacher(max_digits=2, operands=3, calculator=True, tool_slip=0.3)
    b = sft_batch(tok, "policy", random.Random(0), 400, teacher)
    assert b.loss_mask is not None
    called = sum(0 in m for m in b.loss_mask)
    assert 0.62 < called / 400 < 0.78  # 70% call the tool
    # every problem is three two-digit numbers
    qs = [tok.decode(p[1:]) for p in b.prompt_ids]
    assert all(len(arithmetic.terms(q)) == 3 for q in qs)
    assert all(10 <= t <= 99 for q in qs for t in arithmetic.terms(q))
    # the default task's batches stay single-turn (no mask)
    plain = sft_batch(tok, "policy", random.Random(0), 16, Teacher(carry_slip=0.65))
    assert plain.loss_mask is None


def test_the_genrm_warm_up_judges_the_final_answer_of_tool_responses() -> None:
    rng = random.Random(3)
    teacher = Teacher(max_digits=2, operands=3, calculator=True)
    seen = set()
    for _ in range(200):
        prompt, [(judged, _)] = genrm_example(rng, teacher)
        q = prompt.split("\n")[0] + "\n"
        gold = str(sum(arithmetic.terms(q)))
        response = prompt[len(q) :].split("\nReference:")[0]
        right = extract_answer(response) == gold
        assert judged.endswith("Score: 10" if right else "Score: 0"), (prompt, judged)
        seen.add((right, "<calc>" in response))
    assert seen == {(True, True), (False, True), (True, False), (False, False)}


@pytest.mark.parametrize(
    ("response", "right"),
    [
        ("<calc>47+38+96</calc><result>181</result>Answer: 181", True),
        ("<calc>47+38+96</calc><result>181</result>Answer: 171", False),
        # the calculator's result is not the policy's answer, nor an answer it superseded
        ("Answer: 181<calc>47+38+96</calc><result>181</result>", False),
        ("<calc>1+1</calc><result>2</result><calc>47+38+96</calc><result>181</result>", False),
        ("Answer: 181", True),
    ],
)
def test_the_verifiable_reward_reads_the_answer_after_the_last_observation(
    response: str, right: bool
) -> None:
    assert (verifiable_reward(response, "181") > 0) is right


def test_the_default_task_and_its_cache_keys_are_unchanged() -> None:
    cfg = ModelsConfig()
    for kind in ("policy", "genrm"):
        spec = asdict(getattr(cfg, kind))
        del spec["sft"]["tool_slip"]  # the key as it was before the option existed
        blob = {"kind": kind, "spec": spec, "seed": 0, "max_digits": 2, "v": FORMAT_VERSION}
        want = hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode())
        assert model_dir(cfg, kind).name == f"{kind}-{want.hexdigest()[:16]}"
    tools = ModelsConfig(operands=3, calculator=True)
    assert model_dir(tools, "policy") != model_dir(cfg, "policy")
    assert spec_key("policy", cfg.policy, 0, 2, operands=3) != spec_key(
        "policy", cfg.policy, 0, 2, operands=3, calculator=True
    )
    assert [p.uid for p in arithmetic.problems(3)] == ["15+43", "48+71", "74+2"]


@pytest.mark.parametrize(
    ("override", "says"),
    [("models.operands=1", ">= 2 numbers"), ("models.policy.sft.tool_slip=1.5", "a share")],
)
def test_the_task_keys_are_validated_by_name(override: str, says: str) -> None:
    from pivot_hpc.config import ConfigError
    from pivot_hpc.job.config import load_config

    with pytest.raises(ConfigError, match=override.split("=")[0].replace(".", r"\.")) as e:
        load_config(None, [override])
    assert says in str(e.value)


def test_the_tools_config_loads_with_its_task() -> None:
    from pathlib import Path

    from pivot_hpc.job.config import load_config

    cfg = load_config(Path(__file__).parents[2] / "configs" / "tiny-tools.yaml")
    assert (cfg.models.operands, cfg.models.calculator, cfg.tools.enabled) == (3, True, True)
    assert cfg.tools.tools == ("calculator",) and cfg.models.policy.sft.tool_slip == 0.3
    assert model_dir(cfg.models, "policy") != model_dir(ModelsConfig(), "policy")
