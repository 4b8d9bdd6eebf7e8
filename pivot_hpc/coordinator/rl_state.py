"""RL bookkeeping: samples, batches, the replay buffer, policy versions and staleness.

Step s trains on batch s (batch_prompts prompts × n samples) and publishes policy
version s+1. Batch s may start rolling out once s ≤ version + staleness, so every sample
of batch s is generated from a policy at most `staleness` versions behind the one that
trains on it (staleness 0 = synchronous, as colocated deployments run).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from pivot_hpc.errors import PivotError


class ConservationError(PivotError, RuntimeError):
    """A sample was lost or processed twice — a bug, reported loudly."""


@dataclass(slots=True)
class Sample:
    sample_id: int  # also its sequence id in both role schedulers
    step: int  # the batch it belongs to
    prompt_index: int  # data cursor position of its prompt
    group: int  # 0..n-1 within the prompt
    prompt_len: int
    payload: Any = None  # sim: target lengths; live: prompt tokens, sampling params
    version_start: int = -1  # policy version when its rollout started
    response_len: int = 0  # tokens the policy generated
    judgement_len: int = 0  # tokens the GenRM generated
    reward_context: int = 0  # context length of its reward sequence (set after rollout)
    reward_verifiable: float = float("nan")
    reward_genrm: float = float("nan")
    rolled_out: bool = False
    rewarded: bool = False
    trained_at: int = -1  # version that trained on it
    # Tool-calling rollouts (coordinator/turns.py): rollout turns finished so far, and the
    # context the next turn's sequence starts from (prompt + earlier turns and tool
    # observations; 0: the prompt alone, a one-turn rollout)
    turn: int = 0
    context_len: int = 0
    tool_calls: int = 0  # tool calls its trajectory made

    @property
    def reward(self) -> float:
        return self.reward_verifiable + self.reward_genrm

    @property
    def turn_context(self) -> int:
        """Context length the current rollout turn's sequence starts from."""
        return self.context_len or self.prompt_len


class SampleSource(Protocol):
    """Where samples come from: the dataset (live) or a workload generator (simulator)."""

    def make(self, sample_id: int, step: int, prompt_index: int, group: int) -> Sample: ...

    def on_rollout(self, sample: Sample, generated: int, result: Any) -> int:
        """Record the rollout's output; return the context length of its reward sequence."""
        ...


@dataclass
class RLState:
    steps: int
    batch_prompts: int
    samples_per_prompt: int
    staleness: int
    source: SampleSource
    version: int = 0
    released: int = 0  # batches released to rollout
    data_cursor: int = 0  # prompts consumed
    next_sample_id: int = 0
    batches: dict[int, list[Sample]] = field(default_factory=dict)
    rewarded_count: dict[int, int] = field(default_factory=dict)
    training_step: int | None = None  # batch being trained
    # DAPO dynamic sampling: uninformative groups are replaced by fresh prompts, at most
    # `resample_limit` per step; per step, groups dropped and prompts drawn in their place
    dynamic_sampling: bool = False
    resample_limit: int = 0
    filtered: dict[int, int] = field(default_factory=dict)
    resampled: dict[int, int] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return self.batch_prompts * self.samples_per_prompt

    @property
    def done(self) -> bool:
        return self.version >= self.steps

    def can_release(self) -> bool:
        return self.released < self.steps and self.released <= self.version + self.staleness

    def release(self) -> list[Sample]:
        """The next batch's samples (prompt-major order: sample ids ascend by prompt)."""
        if not self.can_release():
            raise ConservationError(
                f"batch {self.released} cannot be released at version {self.version} "
                f"(staleness bound {self.staleness}, {self.steps} steps)"
            )
        step = self.released
        out = []
        for _p in range(self.batch_prompts):
            for g in range(self.samples_per_prompt):
                s = self.source.make(self.next_sample_id, step, self.data_cursor, g)
                self.next_sample_id += 1
                out.append(s)
            self.data_cursor += 1
        self.batches[step] = out
        self.rewarded_count[step] = 0
        self.released += 1
        return out

    # ------------------------------------------------ what the deployment modes ask
    def rolled_out(self, step: int) -> bool:
        """Batch `step` is released and every one of its samples is rolled out."""
        return step in self.batches and all(s.rolled_out for s in self.batches[step])

    def awaits_rollout(self, step: int) -> bool:
        """Batch `step` holds samples not rolled out yet (dynamic sampling's replacements)."""
        return any(not s.rolled_out for s in self.batches.get(step, ()))

    def rewarded(self, step: int) -> bool:
        """Every sample of batch `step` is rewarded (or it was trained already)."""
        batch = self.batches.get(step)
        return batch is None or self.rewarded_count[step] == len(batch)

    def oldest_unrewarded(self) -> int:
        """The oldest released batch whose rewards are incomplete, else the next one."""
        return min((b for b in self.batches if not self.rewarded(b)), default=self.released)

    def rollout_done(self, s: Sample, response_len: int) -> None:
        if s.rolled_out:
            raise ConservationError(f"sample {s.sample_id} finished rollout twice")
        s.rolled_out = True
        s.response_len = response_len

    def reward_done(self, s: Sample, verifiable: float, genrm: float, judgement_len: int) -> None:
        if not s.rolled_out or s.rewarded:
            raise ConservationError(f"sample {s.sample_id} rewarded twice or before its rollout")
        s.rewarded = True
        s.reward_verifiable, s.reward_genrm, s.judgement_len = verifiable, genrm, judgement_len
        self.rewarded_count[s.step] += 1

    def resample(self, s: Sample) -> tuple[list[Sample], list[Sample]]:
        """Dynamic sampling, after `s` was rewarded: when every sample of its prompt group
        is rewarded and all got the same reward, the group leaves the batch (returned
        first; never trained, counted in `filtered`) and a fresh prompt's group takes its
        place (returned second; to roll out). ([], []) when the group stays."""
        step = s.step
        if not self.dynamic_sampling or self.resampled.get(step, 0) >= self.resample_limit:
            return [], []
        batch = self.batches[step]
        group = [x for x in batch if x.prompt_index == s.prompt_index]
        if not all(x.rewarded for x in group):
            return [], []
        if max(x.reward for x in group) - min(x.reward for x in group) > 1e-9:
            return [], []
        ids = {x.sample_id for x in group}
        batch[:] = [x for x in batch if x.sample_id not in ids]
        self.rewarded_count[step] -= len(group)
        self.filtered[step] = self.filtered.get(step, 0) + 1
        self.resampled[step] = self.resampled.get(step, 0) + 1
        fresh = []
        for g in range(self.samples_per_prompt):
            fresh.append(self.source.make(self.next_sample_id, step, self.data_cursor, g))
            self.next_sample_id += 1
        self.data_cursor += 1
        batch.extend(fresh)
        return group, fresh

    def resample_group(self, step: int, prompt_index: int) -> tuple[list[Sample], list[Sample]]:
        """Resume from a checkpoint, when a trajectory of the group of prompt `prompt_index`
        in batch `step` cannot continue (agentic/trajectory.py `resume_group`): the whole
        group leaves the batch (returned first: never trained, its rewards uncounted; GRPO's
        advantages need every sample of a group) and the same prompt is sampled again from
        scratch (returned second: fresh sample ids, the same group indices, in the same
        places of the batch, so the batch keeps its size and prompt-major order). Not counted
        in `filtered` or `resampled`: those are dynamic sampling's, and the data cursor does
        not move (the prompt is the same)."""
        if self.training_step is not None:
            raise ConservationError(f"group resampled while step {self.training_step} trains")
        batch = self.batches.get(step)
        group = [x for x in batch or () if x.prompt_index == prompt_index]
        if not group:
            raise ConservationError(f"batch {step} holds no group of prompt {prompt_index}")
        if any(x.trained_at >= 0 for x in group):
            raise ConservationError(f"group of prompt {prompt_index} resampled after training")
        fresh = {}
        for x in group:
            fresh[x.sample_id] = self.source.make(self.next_sample_id, step, prompt_index, x.group)
            self.next_sample_id += 1
        assert batch is not None
        batch[:] = [fresh.get(x.sample_id, x) for x in batch]
        self.rewarded_count[step] -= sum(x.rewarded for x in group)
        return group, list(fresh.values())

    def batch_ready(self) -> bool:
        """The next step's batch is fully rewarded (and no training is running)."""
        step = self.version
        return (
            self.training_step is None
            and step < self.steps
            and step in self.batches
            and self.rewarded_count[step] == self.batch_size
        )

    def begin_training(self) -> list[Sample]:
        if not self.batch_ready():
            raise ConservationError(f"batch {self.version} is not ready for training")
        self.training_step = self.version
        return self.batches[self.version]

    def end_training(self, step: int) -> list[Sample]:
        if self.training_step != step:
            raise ConservationError(f"training of step {step} ended, expected {self.training_step}")
        batch = self.batches.pop(step)
        for s in batch:
            if s.trained_at >= 0:
                raise ConservationError(f"sample {s.sample_id} trained twice")
            s.trained_at = self.version
        self.training_step = None
        self.version += 1
        return batch

    def replay_buffer(self) -> list[Sample]:
        """Rewarded samples not yet trained on."""
        return [s for b in self.batches.values() for s in b if s.rewarded]

    def in_flight(self) -> list[Sample]:
        return [s for b in self.batches.values() for s in b if not s.rewarded]

    # Fields a checkpoint saves (the sample source is rebuilt from the config).
    SAVED = (
        "version",
        "released",
        "data_cursor",
        "next_sample_id",
        "batches",
        "rewarded_count",
        "filtered",
        "resampled",
    )
    ADDED_LATER = ("filtered", "resampled")  # dicts absent from older checkpoints

    def state(self) -> dict[str, Any]:
        if self.training_step is not None:
            raise ConservationError(f"RL state saved while step {self.training_step} trains")
        return {k: getattr(self, k) for k in self.SAVED}

    def restore(self, state: dict[str, Any]) -> None:
        for k in self.SAVED:
            setattr(self, k, state[k] if k in state or k not in self.ADDED_LATER else {})
