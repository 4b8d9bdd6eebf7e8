"""The calculator check's multi-turn rollout (bench/calculator_eval.py), driven by a
scripted engine: turns end at "</calc>", the evaluator's observation is appended as
tokens with loss mask 0 and logprob placeholders, and the result trains as one batch."""

from __future__ import annotations

from pivot_hpc.bench.calculator_eval import rollouts
from pivot_hpc.engines.base import FinishReason, SeqResult
from pivot_hpc.models.tokenizer import build_tokenizer
from pivot_hpc.rl.batch import Trajectory, assemble
from pivot_hpc.rl.config import GRPOConfig
from pivot_hpc.rl.rewards import verifiable_reward


class Scripted:
    """Answers each request with the next scripted text for its prompt (logprob −0.5 per
    token), honouring the stop strings as the hf engine does."""

    def __init__(self, tok, script: dict[str, list[str]]) -> None:
        self.tok, self.script = tok, {k: list(v) for k, v in script.items()}
        self.pending: list[SeqResult] = []
        self.seen: list[str] = []

    def add(self, seq_id, prompt, sampling) -> None:
        text = self.tok.decode(prompt[1:])
        self.seen.append(text)
        question = text.split("\n")[0] + "\n"
        reply = self.script[question].pop(0)
        stopped = False
        for stop in sampling.stop:
            if stop in reply:
                reply, stopped = reply[: reply.index(stop) + len(stop)], True
        ids = self.tok.encode(reply, add_special_tokens=False)[: sampling.max_tokens]
        reason: FinishReason = "stop"
        if len(ids) == sampling.max_tokens:
            reason = "length"
        elif not stopped:
            ids.append(self.tok.eos_token_id)
        self.pending.append(SeqResult(seq_id, list(prompt), ids, [-0.5] * len(ids), reason))

    def has_unfinished(self) -> bool:
        return bool(self.pending)

    def step(self) -> list[SeqResult]:
        done, self.pending = self.pending, []
        return done


def test_a_call_its_observation_and_the_answer_make_one_masked_response() -> None:
    tok = build_tokenizer()
    q1, q2, q3, q4 = "47+38+96=?\n", "10+20+30=?\n", "1+2+3=?\n", "4+5+6=?\n"
    engine = Scripted(
        tok,
        {
            q1: ["<calc>47+38+96</calc>", "Answer: 181"],
            q2: ["Answer: 50"],  # no call: one turn, mask all ones
            q3: ["<calc>import os</calc>", "Answer: 6"],  # the evaluator says why not
            q4: ["<tool_call>nope</tool_call>", "Answer: 15"],  # malformed: refused
        },
    )
    prompts = [
        [tok.bos_token_id, *tok.encode(q, add_special_tokens=False)] for q in (q1, q2, q3, q4)
    ]
    out = rollouts(engine, tok, prompts, temperature=1.0)
    r1, r2, r3, r4 = out
    assert r1.text == "<calc>47+38+96</calc><result>181</result>Answer: 181"
    assert (r1.calls, r1.expressions, r2.calls) == (1, ["47+38+96"], 0)
    assert (r3.calls, r3.refused, r4.calls, r4.refused) == (1, 0, 0, 1)
    # the second turn's prompt is the first turn's tokens plus the observation's, as is
    assert engine.seen[4] == q1 + "<calc>47+38+96</calc><result>181</result>"
    assert r3.text.startswith("<calc>import os</calc><result>error: ")
    assert r4.text.startswith("<tool_call>nope</tool_call><result>error: ")
    obs = [tok.decode([t]) for t, m in zip(r1.response_ids, r1.loss_mask, strict=True) if not m]
    assert "".join(obs) == "<result>181</result>"
    assert all(lp == (-0.5 if m else 0.0) for lp, m in zip(r1.logprobs, r1.loss_mask, strict=True))
    assert r2.loss_mask == [1] * len(r2.response_ids)
    assert [
        verifiable_reward(r.text, g) > 0 for r, g in zip(out, ("181", "60", "6", "15"), strict=True)
    ] == [True, False, True, True]
    batch = assemble(
        [
            Trajectory(i, 1.0, p, r.response_ids, r.logprobs, 0, r.truncated, r.loss_mask)
            for i, (p, r) in enumerate(zip(prompts, out, strict=True))
        ],
        GRPOConfig(),
    )
    assert batch.loss_mask == [r.loss_mask for r in out]


def test_the_turns_share_one_token_budget() -> None:
    tok = build_tokenizer()
    q = "47+38+96=?\n"
    engine = Scripted(tok, {q: ["<calc>47+38+96</calc>", "Answer: 181 and more words"]})
    prompt = [tok.bos_token_id, *tok.encode(q, add_special_tokens=False)]
    (r,) = rollouts(engine, tok, [prompt], temperature=1.0, max_tokens=30)
    assert sum(r.loss_mask) == 30 and r.truncated  # 21 for the call, 9 for the answer
