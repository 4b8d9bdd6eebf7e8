"""Held-out evaluation of the live policy: greedy accuracy on a fixed validation set.

Per-step training rewards are noisy (a few prompts, sampled responses); whether RL is
working shows in a fixed set of unseen problems answered greedily by the current policy.
The coordinator reads the policy from GPS and decodes the set with the `hf` engine on its
own rank — at the start, every `loop.eval_every_steps` steps and at the end. Only for the
CPU runs (`hf` rollout engine, or vLLM's CPU build): a GPU run evaluates on its GPU engines.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pivot_hpc.data.problem import Problem
from pivot_hpc.engines.base import SamplingParams
from pivot_hpc.models.prompting import prompter_of
from pivot_hpc.rl.rewards import score_answers


@dataclass(slots=True)
class Evaluation:
    version: int
    accuracy: float
    mean_verifiable: float
    problems: int
    seconds: float


def validation_problems(cfg, train: list[Problem]) -> list[Problem]:
    """The validation set: the configured file, or synthetic problems unseen in training."""
    n = cfg.loop.eval_problems
    data = cfg.rl.data
    if data.validation is None or n == 0:
        return []
    if data.validation != "synthetic":
        from pivot_hpc.data.loaders import Columns, usable_problems

        columns = Columns(data.prompt_key, data.answer_key)
        return usable_problems(data.validation, "rl.data.validation", columns)[0][:n]
    from pivot_hpc.data.arithmetic import problems

    seen = {p.prompt for p in train}
    fresh = problems(
        4 * n + 64,
        seed=data.synthetic_seed + 7919,
        max_digits=cfg.models.max_digits,
        operands=cfg.models.operands,
    )
    return [p for p in fresh if p.prompt not in seen][:n]


class Evaluator:
    def __init__(self, cfg, gps, policy_dir, tok, problems: list[Problem]) -> None:
        from pivot_hpc.engines.hf.engine import make_hf_engine

        self.cfg = cfg
        self.gps = gps
        # the policy's tokenizer or Prompter: prompts encoded as in training
        self.text = prompter_of(tok, chat=cfg.rl.data.apply_chat_template)
        self.tok = self.text.tok
        self.problems = problems
        self.prompts = [self.text.encode(p.prompt, p.messages) for p in problems]
        self.engine = make_hf_engine(
            str(policy_dir),
            kv_capacity_tokens=cfg.rollout.kv_capacity_tokens,
            max_batch=cfg.engines.rollout.max_batch,
            num_threads=1,
        )
        self.sampling = SamplingParams(
            temperature=0.0,
            max_tokens=cfg.rl.max_response_tokens,
            stop_token_ids=self.text.stop_ids,
        )
        self.history: list[Evaluation] = []
        self.turns = None  # tools.enabled: trajectories with tool calls (evaluation_turns.py)
        if cfg.tools.enabled:
            from pivot_hpc.runtime.evaluation_turns import EvalTurns

            self.turns = EvalTurns(self.tok, self.sampling, cfg.tools)

    def due(self, version: int) -> bool:
        every = self.cfg.loop.eval_every_steps
        return bool(self.problems) and every > 0 and version % every == 0

    def run(self) -> Evaluation:
        from pivot_hpc.engines.hf.engine import generate_all
        from pivot_hpc.gps import Parallelism

        t0 = time.perf_counter()
        tensors, version = self.gps.read("policy", [0], Parallelism(), device="cpu")
        self.engine.load_weights({k: torch.as_tensor(v) for k, v in tensors.items()}, version)
        if self.turns is not None:
            from pivot_hpc.runtime.host_tools import local_service

            texts = self.turns.answers(self.engine, self.prompts, local_service())
        else:
            results = generate_all(self.engine, self.prompts, self.sampling)
            texts = [self.text.decode(r.token_ids) for r in results]
        mean, accuracy = score_answers(texts, [p.answer for p in self.problems], self.cfg.rl.reward)
        ev = Evaluation(
            version=version,
            accuracy=accuracy,
            mean_verifiable=mean,
            problems=len(texts),
            seconds=time.perf_counter() - t0,
        )
        self.history.append(ev)
        return ev
