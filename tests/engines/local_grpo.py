"""A synchronous GRPO loop in one process: the test suite's reference of the RL math.

Not a second product path: `pivot-hpc run` is the one RL loop (coordinator, roles, GPS).
This fixture checks, in one process and in seconds, that the pieces it shares with that
loop (engines, rewards, advantages, the GRPO step) learn the tiny task:
rollout (hf engine, policy) → verifiable reward (math-verify) + GenRM reward (hf engine,
GenRM) → group advantages → Megatron GRPO step → weights exported (canonical tensors) and
loaded into the rollout engine as version v+1.
"""

from __future__ import annotations

import copy
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pivot_hpc.data.problem import Problem
from pivot_hpc.engines.base import SamplingParams, TrainBatch
from pivot_hpc.engines.hf.engine import HFEngine, generate_all
from pivot_hpc.models.config import ModelConfig
from pivot_hpc.models.qwen2 import model_config_of
from pivot_hpc.models.tokenizer import decode_response, encode_prompt
from pivot_hpc.rl.config import RLConfig
from pivot_hpc.rl.grpo import group_advantages, reference_logprobs
from pivot_hpc.rl.rewards import (
    GenRMStats,
    combine,
    genrm_prompt,
    genrm_rewards,
    overlong_penalty,
    score_answers,
    verifiable_reward,
)


@dataclass(slots=True)
class EvalResult:
    mean_verifiable: float
    accuracy: float
    n: int


@dataclass(slots=True)
class StepRecord:
    step: int
    mean_reward: float
    mean_verifiable: float
    mean_genrm: float
    accuracy: float
    metrics: dict[str, float]
    seconds: float


@dataclass(slots=True)
class LoopReport:
    steps: list[StepRecord] = field(default_factory=list)
    genrm: GenRMStats = field(default_factory=GenRMStats)


class Judge:
    """GenRM reward through an inference engine: prompt template → judgement → score."""

    def __init__(self, engine: HFEngine, tok, cfg: RLConfig) -> None:
        self.engine, self.tok, self.cfg = engine, tok, cfg
        self.stats = GenRMStats()
        self._next = 0

    def judgements(
        self,
        questions: Sequence[str],
        responses: Sequence[str],
        references: Sequence[str | None] | None = None,
    ) -> list[str]:
        rc = self.cfg.reward
        sp = SamplingParams(
            temperature=rc.genrm_temperature,
            max_tokens=rc.genrm_max_tokens,
            stop_token_ids=(self.tok.eos_token_id,),
        )
        refs = list(references) if references is not None else [None] * len(questions)
        prompts = [
            encode_prompt(self.tok, genrm_prompt(q, r, ref))
            for q, r, ref in zip(questions, responses, refs, strict=True)
        ]
        res = generate_all(self.engine, prompts, sp, first_id=self._next)
        self._next += len(prompts)
        return [decode_response(self.tok, r.token_ids) for r in res]

    def rewards(
        self,
        questions: Sequence[str],
        responses: Sequence[str],
        references: Sequence[str | None] | None = None,
    ) -> list[float]:
        judged = self.judgements(questions, responses, references)
        return genrm_rewards(judged, self.cfg.reward, self.stats)


class LocalGRPO:
    def __init__(
        self, policy, genrm, tok, cfg: RLConfig | None = None, arch: ModelConfig | None = None
    ):
        from pivot_hpc.engines.megatron.engine import MegatronTrainEngine

        self.cfg = cfg or RLConfig()
        # genrm=None: verifiable reward only (needs rl.reward.genrm_weight 0)
        if genrm is None and self.cfg.reward.genrm_weight != 0:
            raise ValueError("LocalGRPO without a GenRM needs rl.reward.genrm_weight = 0")
        self.tok = tok
        self.rollout = HFEngine(policy, seed=self.cfg.trainer.seed)
        self.judge = (
            None if genrm is None else Judge(HFEngine(genrm, num_threads=None), tok, self.cfg)
        )
        self.trainer = MegatronTrainEngine(
            arch or model_config_of(policy),
            self.cfg.trainer,
            self.cfg.grpo,
            max_response_tokens=self.cfg.max_response_tokens,
        )
        self.trainer.load_weights(policy.state_dict())
        # KL reference: a frozen copy of the initial policy (only when the KL term is on)
        self.reference = copy.deepcopy(policy).eval() if self.cfg.grpo.kl_coef > 0 else None
        self.rng = random.Random(self.cfg.trainer.seed)
        self._next_seq = 0
        self.report = LoopReport()

    def generate(self, problems: Sequence[Problem], sampling: SamplingParams):
        prompts = [encode_prompt(self.tok, p.prompt, p.messages) for p in problems]
        res = generate_all(self.rollout, prompts, sampling, first_id=self._next_seq)
        self._next_seq += len(prompts)
        return prompts, res

    def evaluate(
        self,
        problems: Sequence[Problem],
        temperature: float = 0.0,
        samples: int = 1,
        seed: int | None = 1234,
    ) -> EvalResult:
        """Mean verifiable reward and accuracy over `samples` responses per problem, greedy
        (temperature 0) or sampled. A fixed `seed` gives every evaluation the same random
        numbers, so before/after differences are not swamped by sampling noise."""
        sp = SamplingParams(
            temperature=temperature,
            max_tokens=self.cfg.max_response_tokens,
            stop_token_ids=(self.tok.eos_token_id,),
        )
        saved = self.rollout.gen
        if seed is not None:
            self.rollout.gen = torch.Generator().manual_seed(seed)
        try:
            batch = [p for p in problems for _ in range(samples)]
            _, res = self.generate(batch, sp)
        finally:
            self.rollout.gen = saved
        mean, acc = score_answers(
            [decode_response(self.tok, r.token_ids) for r in res],
            [p.answer for p in batch],
            self.cfg.reward,
        )
        return EvalResult(mean, acc, len(res))

    def step(self, problems: Sequence[Problem], samples_per_prompt: int = 8) -> StepRecord:
        """One GRPO step on `problems`, `samples_per_prompt` responses each (one group)."""
        t0 = time.perf_counter()
        g = self.cfg.grpo
        n = samples_per_prompt
        group = [p for p in problems for _ in range(n)]
        gids = [i for i in range(len(problems)) for _ in range(n)]
        sp = SamplingParams(
            temperature=g.temperature,
            max_tokens=self.cfg.max_response_tokens,
            stop_token_ids=(self.tok.eos_token_id,),
        )
        prompts, res = self.generate(group, sp)
        texts = [decode_response(self.tok, r.token_ids) for r in res]
        rv = [
            verifiable_reward(t, p.answer, self.cfg.reward)
            for t, p in zip(texts, group, strict=True)
        ]
        refs = [p.answer if self.cfg.reward.genrm_reference else None for p in group]
        questions = [p.question or p.prompt for p in group]
        rg = self.judge.rewards(questions, texts, refs) if self.judge else [0.0] * len(texts)
        rewards = combine(rv, rg, self.cfg.reward)
        limit = self.cfg.max_response_tokens
        rewards = [
            x + overlong_penalty(len(r.token_ids), limit, self.cfg.reward)
            for x, r in zip(rewards, res, strict=True)
        ]
        adv = group_advantages(rewards, gids, normalize_std=g.normalize_std)
        batch = TrainBatch(
            prompt_ids=prompts,
            response_ids=[r.token_ids for r in res],
            advantages=adv,
            old_logprobs=[r.logprobs for r in res],
            versions=[r.version for r in res],
            ref_logprobs=self._ref_logprobs(prompts, [r.token_ids for r in res]),
            truncated=[r.finish_reason == "length" for r in res] if g.mask_truncated else None,
        )
        metrics = self.trainer.train_step(batch)
        self.rollout.load_weights(self.trainer.export_weights(), self.trainer.version)
        n = len(group)  # responses this step
        rec = StepRecord(
            step=self.trainer.steps,
            mean_reward=sum(rewards) / n,
            mean_verifiable=sum(rv) / n,
            mean_genrm=sum(rg) / n,
            accuracy=sum(v == self.cfg.reward.correct_score for v in rv) / n,
            metrics=metrics,
            seconds=time.perf_counter() - t0,
        )
        self.report.steps.append(rec)
        if self.judge is not None:
            self.report.genrm = self.judge.stats
        return rec

    def _ref_logprobs(self, prompts: list[list[int]], responses: list[list[int]]):
        if self.reference is None:
            return None
        return reference_logprobs(self.reference, prompts, responses, self.cfg.grpo.temperature)

    def train(
        self,
        problems: Sequence[Problem],
        steps: int,
        prompts_per_step: int = 16,
        samples_per_prompt: int = 8,
    ) -> LoopReport:
        pool = list(problems)
        for _ in range(steps):
            self.step(self.rng.sample(pool, prompts_per_step), samples_per_prompt)
        return self.report
