"""SFT warm-up with the Megatron trainer: gives the tiny models their starting skill.

policy: question → worked solution (+EOS). Kept short on purpose so the policy starts
        with partial accuracy and RL has something to improve.
GenRM:  question + response (half correct, half corrupted) + reference → rationale +
        "Score: S".
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from pivot_hpc.data import arithmetic
from pivot_hpc.engines.base import TrainBatch
from pivot_hpc.models.config import ModelConfig, SFTConfig
from pivot_hpc.models.tokenizer import encode_prompt
from pivot_hpc.progress import Progress
from pivot_hpc.rl.config import TrainerConfig
from pivot_hpc.rl.rewards import genrm_prompt

Example = tuple[str, str]  # (prompt text, target text)


def policy_example(rng: random.Random, max_digits: int, carry_slip: float = 0.0) -> Example:
    a, b = arithmetic.sample_operands(rng, max_digits)
    if carry_slip > 0 and arithmetic.has_carry(a, b) and rng.random() < carry_slip:
        return arithmetic.question(a, b), arithmetic.carry_forgotten(a, b)
    return arithmetic.question(a, b), arithmetic.solution(a, b)


def genrm_example(rng: random.Random, max_digits: int, carry_slip: float = 0.0) -> Example:
    a, b = arithmetic.sample_operands(rng, max_digits)
    q = arithmetic.question(a, b)
    response = arithmetic.solution(a, b)
    if rng.random() < 0.5:
        response = arithmetic.corrupt(response, rng, q)
    ref = str(a + b)
    return genrm_prompt(q, response, ref), arithmetic.judgement(q, response, reference=ref)


EXAMPLES: dict[str, Callable[[random.Random, int, float], Example]] = {
    "policy": policy_example,
    "genrm": genrm_example,
}


def sft_batch(
    tok, kind: str, rng: random.Random, n: int, max_digits: int, carry_slip: float = 0.0
) -> TrainBatch:
    make = EXAMPLES[kind]
    prompts, responses = [], []
    for _ in range(n):
        p, t = make(rng, max_digits, carry_slip)
        prompts.append(encode_prompt(tok, p))
        responses.append([*tok.encode(t, add_special_tokens=False), tok.eos_token_id])
    return TrainBatch(prompt_ids=prompts, response_ids=responses)


def run_sft(
    hf_model,
    tok,
    kind: str,
    arch: ModelConfig,
    sft: SFTConfig,
    *,
    seed: int = 0,
    max_digits: int = 2,
    progress: bool = True,
) -> list[float]:
    """Train `hf_model` in place through the Megatron engine; returns the loss curve."""
    from pivot_hpc.engines.megatron_engine import MegatronTrainEngine

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
    rng = random.Random(f"sft-{kind}-{seed}")
    losses = []
    with Progress(
        sft.steps, f"SFT warm-up of the tiny {kind}", unit="steps", enabled=progress
    ) as bar:
        for _ in range(sft.steps):
            batch = sft_batch(tok, kind, rng, sft.batch_size, max_digits, sft.carry_slip)
            m = engine.train_step(batch, loss="sft")
            losses.append(m["nll"])
            bar.update(1, nll=f"{m['nll']:.3f}")
    with torch.no_grad():
        hf_model.load_state_dict(engine.export_weights(), strict=False)
    return losses
