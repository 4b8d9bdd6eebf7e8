"""Live samples: prompts from the dataset, responses from the policy, judgements from the GenRM.

The rollout of a sample generates a response; its reward sequence is the GenRM prompt
built from question + response (+ reference answer when configured); the final reward is
R = w_v·R_verifiable (math-verify) + w_g·R_GenRM (parsed score), as in §8.1.

With tools enabled the rollout is a trajectory of turns (`LiveTurns`, runtime/live_turns.py,
driven by coordinator/turns.py): the verifiable reward reads the final answer (the last
turn, after the last observation), the GenRM the rendered trajectory, and training gets
the whole response with observation tokens masked out of the loss.
"""

from __future__ import annotations

import random
from typing import Any

from pivot_hpc.agentic.config import ToolsConfig
from pivot_hpc.coordinator.rl_state import Sample
from pivot_hpc.data.problem import Problem
from pivot_hpc.engines.base import SamplingParams
from pivot_hpc.models.prompting import prompter_of
from pivot_hpc.rl.batch import TrainBatch, Trajectory, assemble
from pivot_hpc.rl.config import RLConfig
from pivot_hpc.rl.rewards import (
    GenRMStats,
    genrm_prompt,
    genrm_rewards,
    overlong_penalty,
    verifiable_reward,
)
from pivot_hpc.runtime.live_payload import LivePayload
from pivot_hpc.runtime.live_turns import LiveTurns


class LiveSamples(LiveTurns):
    """A `SampleSource` over a problem list (data cursor order, deterministic for a seed);
    with `tools` enabled also a `TurnSource` (LiveTurns)."""

    def __init__(
        self,
        problems: list[Problem],
        tok,
        cfg: RLConfig,
        seed: int = 0,
        tools: ToolsConfig | None = None,
        *,
        genrm_tok=None,
    ) -> None:
        """`tok` / `genrm_tok`: the policy's and the GenRM's tokenizers, or their
        Prompters (models/prompting.py: every stop id their configs name); without
        `genrm_tok` the GenRM shares the policy's (the tiny job's two models do)."""
        if not problems:
            raise ValueError("no training problems: check rl.data.train")
        self.problems = problems
        self.policy = prompter_of(tok, chat=cfg.data.apply_chat_template)
        self.judge = prompter_of(
            tok if genrm_tok is None else genrm_tok, chat=cfg.reward.genrm_chat_template
        )
        self.tok = self.policy.tok  # the policy's (the turn loop tokenizes with it)
        self.cfg = cfg
        self.order = list(range(len(problems)))
        random.Random(seed).shuffle(self.order)
        self.genrm_stats = GenRMStats()
        self.rollout_sampling = SamplingParams(
            temperature=cfg.grpo.temperature,
            max_tokens=cfg.max_response_tokens,
            stop_token_ids=self.policy.stop_ids,
        )
        self.judge_sampling = SamplingParams(
            temperature=cfg.reward.genrm_temperature,
            max_tokens=cfg.reward.genrm_max_tokens,
            stop_token_ids=self.judge.stop_ids,
        )
        self.setup_turns(tools)

    def make(self, sample_id: int, step: int, prompt_index: int, group: int) -> Sample:
        p = self.problems[self.order[prompt_index % len(self.order)]]
        ids = self.policy.encode(p.prompt, p.messages)
        payload = LivePayload(p, ids, traj=self.new_trajectory(sample_id, ids))
        return Sample(sample_id, step, prompt_index, group, len(ids), payload)

    def text(self, ids: list[int]) -> str:
        """The policy's ids as text (responses, turns)."""
        return self.policy.decode(ids)

    def on_rollout(self, s: Sample, generated: int, result: Any) -> int:
        """Keep the response; build the GenRM prompt; return the reward context length."""
        pl: LivePayload = s.payload
        if pl.traj is not None:  # the whole trajectory, observations included
            result = self.trajectory_result(s)
        pl.response = result
        p = pl.problem
        ref = p.answer if self.cfg.reward.genrm_reference else None
        text = genrm_prompt(p.question or p.prompt, self.text(result.token_ids), ref)
        pl.judge_ids = self.judge.encode(text)  # the GenRM reads with its own tokenizer
        return len(pl.judge_ids)

    def reward(self, s: Sample, result: Any) -> tuple[float, float]:
        pl: LivePayload = s.payload
        pl.judgement = self.judge.decode(result.token_ids)
        rc = self.cfg.reward
        rv = verifiable_reward(self.text(self.answer_ids(pl)), pl.problem.answer, rc)
        (rg,) = genrm_rewards([pl.judgement], rc, self.genrm_stats)
        # DAPO's overlong shaping rides on the verifiable part (0 when off); a trajectory
        # counts the tokens the policy generated, not the tools'
        generated = len(pl.response.token_ids) if pl.traj is None else sum(pl.traj.loss_mask())
        shaped = overlong_penalty(generated, self.cfg.max_response_tokens, rc)
        return rc.verifiable_weight * rv + shaped, rc.genrm_weight * rg

    def batch(self, samples: list[Sample]) -> TrainBatch:
        """The step's batch (rl/batch.py decides advantages and masks; this says where
        each sample's tokens are)."""
        return assemble(
            [
                Trajectory(
                    prompt_index=s.prompt_index,
                    reward=s.reward,
                    prompt_ids=s.payload.prompt_ids,
                    response_ids=s.payload.response.token_ids,
                    logprobs=s.payload.response.logprobs,
                    version=s.payload.response.version,
                    truncated=s.payload.response.finish_reason == "length",
                    loss_mask=None if s.payload.traj is None else s.payload.traj.loss_mask(),
                )
                for s in samples
            ],
            self.cfg.grpo,
        )
