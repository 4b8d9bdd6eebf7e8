"""SFT warm-up with the Megatron trainer: gives the tiny models their starting skill.

policy: question → worked solution (+EOS). Kept short on purpose so the policy starts
        with partial accuracy and RL has something to improve. With the calculator task
        (models.calculator): question → "<calc>…</calc>", the observation "<result>…
        </result>" (in the text, out of the loss, as in RL) and "Answer: S".
GenRM:  question + response (half correct, half corrupted) + reference → rationale +
        "Score: S".
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pivot_hpc.data import arithmetic, calculator_task
from pivot_hpc.data.calculator_task import Segment
from pivot_hpc.engines.base import TrainBatch
from pivot_hpc.models.config import ModelConfig, SFTConfig
from pivot_hpc.models.tokenizer import encode_prompt
from pivot_hpc.progress import Progress
from pivot_hpc.rl.config import TrainerConfig
from pivot_hpc.rl.rewards import genrm_prompt

Example = tuple[str, list[Segment]]  # (prompt text, target segments: (text, in the loss))


@dataclass(frozen=True, slots=True)
class Teacher:
    """What the warm-up data looks like: the task (models.max_digits, operands, calculator)
    and the policy teacher's habits (models.policy.sft.carry_slip, tool_slip)."""

    max_digits: int = 2
    carry_slip: float = 0.0
    operands: int = 2
    calculator: bool = False
    tool_slip: float = 0.0

    @property
    def default_task(self) -> bool:
        return self.operands == 2 and not self.calculator


def _task_answer(rng: random.Random, terms: tuple[int, ...], t: Teacher) -> list[Segment]:
    """The multi-operand / calculator task's target: with the tool, or (slipping) without."""
    mental = calculator_task.mental_solution(terms)
    if t.calculator:
        slip = t.tool_slip > 0 and rng.random() < t.tool_slip
        return mental if slip else calculator_task.tool_solution(terms)
    if t.carry_slip > 0 and rng.random() < t.carry_slip:
        return mental
    return [(f"Answer: {sum(terms)}", 1)]


def policy_example(rng: random.Random, t: Teacher) -> Example:
    if not t.default_task:
        terms = arithmetic.sample_terms(rng, t.max_digits, t.operands)
        return arithmetic.question(*terms), _task_answer(rng, terms, t)
    a, b = arithmetic.sample_operands(rng, t.max_digits)
    if t.carry_slip > 0 and arithmetic.has_carry(a, b) and rng.random() < t.carry_slip:
        return arithmetic.question(a, b), [(arithmetic.carry_forgotten(a, b), 1)]
    return arithmetic.question(a, b), [(arithmetic.solution(a, b), 1)]


def _wrong_answer(response: str, total: int, rng: random.Random) -> str:
    """`response` with its final answer replaced by a plausible wrong one."""
    head = response.rsplit("Answer: ", 1)[0]
    wrong = total + rng.choice([-11, -10, -9, -2, -1, 1, 2, 9, 10, 11, 20, -20])
    return f"{head}Answer: {max(wrong, 0) if wrong != total else total + 1}"


def genrm_example(rng: random.Random, t: Teacher) -> Example:
    if not t.default_task:
        # judged responses are the task's own: tool calls and mental answers, half wrong
        terms = arithmetic.sample_terms(rng, t.max_digits, t.operands)
        q = arithmetic.question(*terms)
        teacher = Teacher(t.max_digits, 0.0, t.operands, t.calculator, tool_slip=0.3)
        response = calculator_task.text(_task_answer(rng, terms, teacher))
        if rng.random() < 0.5:
            response = _wrong_answer(response, sum(terms), rng)
        ref = str(sum(terms))
        judged = arithmetic.judgement(q, response, reference=ref)
        return genrm_prompt(q, response, ref), [(judged, 1)]
    a, b = arithmetic.sample_operands(rng, t.max_digits)
    q = arithmetic.question(a, b)
    response = arithmetic.solution(a, b)
    if rng.random() < 0.5:
        response = arithmetic.corrupt(response, rng, q)
    ref = str(a + b)
    judged = arithmetic.judgement(q, response, reference=ref)
    return genrm_prompt(q, response, ref), [(judged, 1)]


EXAMPLES: dict[str, Callable[[random.Random, Teacher], Example]] = {
    "policy": policy_example,
    "genrm": genrm_example,
}


def encode_target(tok, segments: list[Segment]) -> tuple[list[int], list[int]]:
    """Response ids (+EOS) and their loss mask: each segment encoded on its own, as the
    turn loop appends generated tokens and observations (never re-encoded together)."""
    ids: list[int] = []
    mask: list[int] = []
    for text, in_loss in segments:
        part = tok.encode(text, add_special_tokens=False)
        ids += part
        mask += [in_loss] * len(part)
    return [*ids, tok.eos_token_id], [*mask, 1]


def sft_batch(tok, kind: str, rng: random.Random, n: int, teacher: Teacher) -> TrainBatch:
    make = EXAMPLES[kind]
    prompts, responses, masks = [], [], []
    for _ in range(n):
        p, target = make(rng, teacher)
        prompts.append(encode_prompt(tok, p))
        ids, mask = encode_target(tok, target)
        responses.append(ids)
        masks.append(mask)
    # no observation in the batch: no mask (the single-turn batch it always was)
    masked = any(0 in m for m in masks)
    return TrainBatch(
        prompt_ids=prompts, response_ids=responses, loss_mask=masks if masked else None
    )


def run_sft(
    hf_model,
    tok,
    kind: str,
    arch: ModelConfig,
    sft: SFTConfig,
    *,
    seed: int = 0,
    max_digits: int = 2,
    operands: int = 2,
    calculator: bool = False,
    progress: bool = True,
) -> list[float]:
    """Train `hf_model` in place through the Megatron engine; returns the loss curve."""
    from pivot_hpc.engines.megatron.engine import MegatronTrainEngine

    engine = MegatronTrainEngine(
        arch,
        TrainerConfig(
            lr=sft.lr,
            warmup_steps=sft.warmup_steps,
            weight_decay=sft.weight_decay,
            micro_batch_size=sft.batch_size,
            seed=seed,
        ),
    )
    engine.load_weights(hf_model.state_dict())
    teacher = Teacher(max_digits, sft.carry_slip, operands, calculator, sft.tool_slip)
    rng = random.Random(f"sft-{kind}-{seed}")
    losses = []
    with Progress(
        sft.steps, f"SFT warm-up of the tiny {kind}", unit="steps", enabled=progress
    ) as bar:
        for _ in range(sft.steps):
            batch = sft_batch(tok, kind, rng, sft.batch_size, teacher)
            m = engine.train_step(batch, loss="sft")
            losses.append(m["nll"])
            bar.update(1, nll=f"{m['nll']:.3f}")
    with torch.no_grad():
        hf_model.load_state_dict(engine.export_weights(), strict=False)
    return losses
