"""Does the tiny policy use its calculator? Tool-call rate and accuracy with vs without it.

Held-out problems of the run config's task (models.operands, models.calculator) go to the
policy through the hf engine, two turns as the turn loop will drive them (issue 37):

1. generate until the call's closing tag ("</calc>", the registry's stop strings) or EOS;
2. a well-formed call is evaluated by the whitelisting evaluator (`agentic.calculator`,
   the sandbox child's own code, here in-process) and its observation "<result>V</result>"
   is appended as tokens; the policy then writes its final answer.

Without tools the response is forced to start with "Answer: " (the no-tool answer's
format), so the policy must add in its head. Accuracy is the verifiable reward's
(`rl/rewards.py`: the answer after the last observation).

    python -m pivot_hpc.bench.calculator_eval configs/tiny-tools.yaml [key=value …]
        [--problems 256] [--temperatures 0 1]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from pivot_hpc.agentic.calculator import CalcError, evaluate, format_value
from pivot_hpc.agentic.tools import Invocation, Refusal, build_registry, render
from pivot_hpc.data.arithmetic import problems as make_problems
from pivot_hpc.data.problem import Problem
from pivot_hpc.engines.base import SamplingParams
from pivot_hpc.engines.hf.engine import HFEngine, generate_all
from pivot_hpc.models.tokenizer import decode_response, encode_prompt
from pivot_hpc.rl.config import RewardConfig
from pivot_hpc.rl.rewards import genrm_prompt, parse_genrm_score, verifiable_reward

NO_TOOL_PREFIX = "Answer: "
HELD_OUT_SEED = 7919  # apart from the warm-up's data stream and the training pool's seed


@dataclass(slots=True)
class CalculatorReport:
    problems: int
    temperature: float
    call_rate: float  # first turns that end in a well-formed calculator call
    malformed_rate: float  # first turns that open a call the registry refuses
    call_exact_rate: float  # calls whose expression is the question's sum, verbatim
    accuracy_with_tools: float  # calls executed, observations appended, final answers read
    accuracy_without_tools: float  # forced to answer at once ("Answer: …")
    accuracy_when_calling: float  # among the responses that called the tool
    example: str  # one whole response with tools


@dataclass(slots=True)
class Rollout:
    """One multi-turn response, token in / token out: generated and observation ids in
    order, the behaviour logprobs (0.0 at observations) and the loss mask."""

    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    text: str = ""  # generated text and observations, as the reward reads it
    calls: int = 0  # well-formed calls run
    refused: int = 0  # calls the registry refused (their error is the observation)
    expressions: list[str] = field(default_factory=list)
    truncated: bool = False  # the last turn stopped at its token limit

    def add(self, ids: list[int], logprobs: list[float], text: str, in_loss: int) -> None:
        self.response_ids += ids
        self.logprobs += logprobs if in_loss else [0.0] * len(ids)
        self.loss_mask += [in_loss] * len(ids)
        self.text += text


def _observation(parsed: Invocation | Refusal) -> str:
    if isinstance(parsed, Refusal):
        return render(parsed.body)
    try:
        body = format_value(evaluate(parsed.args["expression"]))
    except CalcError as exc:
        body = f"error: {exc}"
    return render(body)


def rollouts(
    engine: HFEngine,
    tok,
    prompts: list[list[int]],
    *,
    temperature: float,
    max_tokens: int = 64,
    max_turns: int = 4,
    first_id: int = 0,
) -> list[Rollout]:
    """Multi-turn responses to `prompts`: each turn generates until a call's closing tag
    or EOS; a call is evaluated in-process by the calculator (the sandbox's program) and
    its observation appended as tokens; a turn without a call ends the response. The
    turns share `max_tokens` generated tokens per response."""
    registry = build_registry(["calculator"])
    stop = tuple(registry.stop_strings())
    out = [Rollout() for _ in prompts]
    live = list(range(len(prompts)))
    next_id = first_id
    for turn in range(max_turns):
        if not live:
            break
        asks = [(i, max_tokens - sum(out[i].loss_mask)) for i in live]
        asks = [(i, room) for i, room in asks if room > 0]
        results = []
        for i, room in asks:  # one engine pass; each with its own room left
            sp = SamplingParams(
                temperature=temperature,
                max_tokens=room,
                stop_token_ids=(tok.eos_token_id,),
                stop=stop,
            )
            engine.add(next_id, prompts[i] + out[i].response_ids, sampling=sp)
            results.append((i, next_id))
            next_id += 1
        done = {}
        while engine.has_unfinished():
            for r in engine.step():
                done[r.seq_id] = r
        live = []
        for i, sid in results:
            r = done[sid]
            text = decode_response(tok, r.token_ids)
            out[i].add(list(r.token_ids), list(r.logprobs), text, 1)
            parsed = registry.parse_call(text)
            if parsed is None or turn == max_turns - 1:
                out[i].truncated = r.finish_reason == "length"
                continue
            if isinstance(parsed, Invocation):
                out[i].calls += 1
                out[i].expressions.append(parsed.args["expression"])
            else:
                out[i].refused += 1
            obs = _observation(parsed)
            out[i].add(tok.encode(obs, add_special_tokens=False), [], obs, 0)
            live.append(i)
    return out


def measure(
    model, tok, items: list[Problem], temperature: float = 0.0, seed: int = 0
) -> CalculatorReport:
    engine = HFEngine(model, tokenizer=tok, seed=seed)
    prompts = [encode_prompt(tok, p.prompt, p.messages) for p in items]
    with_tools = rollouts(engine, tok, prompts, temperature=temperature)
    forced_prefix = tok.encode(NO_TOOL_PREFIX, add_special_tokens=False)
    forced = generate_all(
        engine,
        [p + forced_prefix for p in prompts],
        SamplingParams(temperature=temperature, max_tokens=16, stop_token_ids=(tok.eos_token_id,)),
        first_id=10 * len(prompts),
    )
    ok = [verifiable_reward(r.text, p.answer) > 0 for r, p in zip(with_tools, items, strict=True)]
    ok_plain = [
        verifiable_reward(NO_TOOL_PREFIX + decode_response(tok, r.token_ids), p.answer) > 0
        for r, p in zip(forced, items, strict=True)
    ]
    calls = [i for i, r in enumerate(with_tools) if r.calls]
    exact = sum(
        1 for i in calls if with_tools[i].expressions[0].strip() + "=?\n" == items[i].prompt
    )
    n = len(items)
    show = calls[0] if calls else 0
    return CalculatorReport(
        problems=n,
        temperature=temperature,
        call_rate=len(calls) / n,
        malformed_rate=sum(1 for r in with_tools if r.refused) / n,
        call_exact_rate=exact / max(len(calls), 1),
        accuracy_with_tools=sum(ok) / n,
        accuracy_without_tools=sum(ok_plain) / n,
        accuracy_when_calling=sum(ok[i] for i in calls) / max(len(calls), 1),
        example=items[show].prompt + with_tools[show].text,
    )


def judge_agreement(
    policy, genrm, tok, items: list[Problem], temperature: float = 1.0, seed: int = 0
) -> dict[str, float]:
    """How often the GenRM's reference-guided score (> half the maximum = right) agrees
    with the verifiable reward on the policy's multi-turn responses."""
    rc = RewardConfig()
    prompts = [encode_prompt(tok, p.prompt, p.messages) for p in items]
    outs = rollouts(
        HFEngine(policy, tokenizer=tok, seed=seed), tok, prompts, temperature=temperature
    )
    right = [verifiable_reward(o.text, p.answer, rc) > 0 for o, p in zip(outs, items, strict=True)]
    judge_prompts = [
        encode_prompt(tok, genrm_prompt(p.question or p.prompt, o.text, p.answer))
        for o, p in zip(outs, items, strict=True)
    ]
    sp = SamplingParams(
        temperature=0.0, max_tokens=rc.genrm_max_tokens, stop_token_ids=(tok.eos_token_id,)
    )
    judged = generate_all(HFEngine(genrm, seed=seed), judge_prompts, sp)
    scores = [
        parse_genrm_score(decode_response(tok, r.token_ids), rc.genrm_max_score) for r in judged
    ]
    agree = [
        s is not None and (s > rc.genrm_max_score / 2) == ok
        for s, ok in zip(scores, right, strict=True)
    ]
    n = len(items)
    return {
        "genrm_agreement": sum(agree) / n,
        "genrm_unparsable": sum(s is None for s in scores) / n,
        "policy_accuracy": sum(right) / n,
    }


def held_out(models_cfg, n: int) -> list[Problem]:
    return make_problems(
        n, seed=HELD_OUT_SEED, max_digits=models_cfg.max_digits, operands=models_cfg.operands
    )


def main(argv: list[str] | None = None) -> int:
    from pivot_hpc.job.config import load_config
    from pivot_hpc.models.zoo import load_model
    from pivot_hpc.recipes.tiny_models import ensure_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", type=Path)
    ap.add_argument("overrides", nargs="*", help="a.b=c config overrides")
    ap.add_argument("--problems", type=int, default=256)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument(
        "--genrm", action="store_true", help="also the GenRM's agreement with the verifier"
    )
    args = ap.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    torch.set_num_threads(2)
    model, tok = load_model(ensure_model(cfg.models, "policy"))
    items = held_out(cfg.models, args.problems)
    for t in args.temperatures:
        print(json.dumps(asdict(measure(model, tok, items, temperature=t))), flush=True)
    if args.genrm:
        genrm, _ = load_model(ensure_model(cfg.models, "genrm"))
        print(json.dumps(judge_agreement(model, genrm, tok, items)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
