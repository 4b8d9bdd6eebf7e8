"""Each record a checkpoint holds, checked as input before any rank uses it.

The codec (checkpoint/codec.py) rebuilds only registered dataclasses, but a constructor
takes whatever it is given: a trajectory with a token id of -5, a string where a count
belongs. Left to the ranks, that ends deep in the job (an IndexError in torch.embedding on
the training rank, an MPI abort), and then in a loop, because "running the same command"
loads the same checkpoint again. So:

- every record is checked as it is decoded (`RECORD_CHECKS`, registered with the codec by
  runtime/checkpointing.py): a trajectory through `Trajectory.from_dict`'s own checks, the
  others field by field;
- before any rank starts (the launcher, and world rank 0 under srun or submitit), the state
  files are decoded whole (runtime/resume_check.py `check_resume`): the RL state's shape,
  every token id within its model's vocabulary, every sequence within its model's
  positions, each rank's RNG states loadable.

Each refusal is one line naming the checkpoint, the file and what is wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pivot_hpc.agentic.tools import MAX_CALL_CHARS
from pivot_hpc.agentic.trajectory import CallRecord, Segment, Trajectory, TrajectoryLimits
from pivot_hpc.coordinator.rl_state import Sample
from pivot_hpc.data.problem import Problem
from pivot_hpc.engines.base import SeqResult
from pivot_hpc.rl.rewards import GenRMStats
from pivot_hpc.runtime.live_payload import LivePayload

FINISH_REASONS = ("stop", "length", "abort")  # engines/base.FinishReason
ROLES = {"rollout": "policy", "reward": "genrm"}  # a partial sequence's role: its model


# ---------------------------------------------------------------------- field checks
def _int(what: str, v: Any, low: int = 0) -> None:
    if type(v) is not int or v < low:
        raise ValueError(f"{what}: expected a whole number >= {low}, got {_short(v)}")


def _number(what: str, v: Any) -> None:
    if type(v) not in (int, float):
        raise ValueError(f"{what}: expected a number, got {_short(v)}")


def _bool(what: str, v: Any) -> None:
    if type(v) is not bool:
        raise ValueError(f"{what}: expected true or false, got {_short(v)}")


def _str(what: str, v: Any, *, optional: bool = False) -> None:
    if not (type(v) is str or (optional and v is None)):
        raise ValueError(f"{what}: expected a string, got {_short(v)}")


def _ids(what: str, v: Any) -> None:
    if type(v) is not list or not all(type(t) is int and t >= 0 for t in v):
        bad = next((t for t in v if type(t) is not int or t < 0), v) if type(v) is list else v
        raise ValueError(f"{what}: expected a list of token ids, holds {_short(bad)}")


def _numbers(what: str, v: Any, n: int) -> None:
    if type(v) is not list or len(v) != n or not all(type(x) in (int, float) for x in v):
        raise ValueError(f"{what}: expected {n} numbers, one per token")


def _short(v: Any) -> str:
    text = repr(v) if not isinstance(v, list | dict | str) or len(v) < 8 else type(v).__name__
    return text[:60]


# ---------------------------------------------------------------------- record checks
def check_limits(r: TrajectoryLimits) -> None:
    for name in ("max_turns", "max_context_tokens", "max_tool_output_tokens"):
        _int(f"limits.{name}", getattr(r, name), 1)


def check_segment(s: Segment) -> None:
    if s.kind not in ("gen", "obs"):
        raise ValueError(f"segment kind {_short(s.kind)}: expected 'gen' or 'obs'")
    _ids("segment token_ids", s.token_ids)
    if s.logprobs is not None:
        _numbers("segment logprobs", s.logprobs, len(s.token_ids))
    if s.version is not None:
        _int("segment version", s.version)
    _bool("segment truncated", s.truncated)


def check_call(c: CallRecord) -> None:
    _int("call call_id", c.call_id)
    _str("call tool", c.tool)
    _str("call args_json", c.args_json)
    # a call is reissued on resume exactly as saved: no longer than a live call may be
    if len(c.args_json) > MAX_CALL_CHARS:
        raise ValueError(f"call args_json: {len(c.args_json)} characters, over {MAX_CALL_CHARS}")
    _bool("call idempotent", c.idempotent)
    _bool("call replayable", c.replayable)
    _str("call status", c.status, optional=True)
    if c.seconds is not None:
        _number("call seconds", c.seconds)


def check_trajectory(t: Trajectory) -> None:
    """`Trajectory.from_dict`'s checks (checkpoint data is input), on the decoded record."""
    if not (
        isinstance(t.limits, TrajectoryLimits)
        and type(t.segments) is list
        and all(isinstance(s, Segment) for s in t.segments)
        and type(t.calls) is list
        and all(isinstance(c, CallRecord) for c in t.calls)
    ):
        raise ValueError("limits, segments and calls must be its own records")
    try:
        Trajectory.from_dict(t.to_dict())
    except (TypeError, AttributeError) as exc:
        raise ValueError(f"trajectory: malformed ({exc!s:.100})") from None


def check_seq_result(r: SeqResult) -> None:
    _int("sequence seq_id", r.seq_id)
    _ids("sequence prompt_ids", r.prompt_ids)
    _ids("sequence token_ids", r.token_ids)
    _numbers("sequence logprobs", r.logprobs, len(r.token_ids))
    if r.finish_reason not in FINISH_REASONS:
        raise ValueError(f"sequence finish_reason {_short(r.finish_reason)}")
    _int("sequence version", r.version)


def check_problem(p: Problem) -> None:
    for name in ("prompt", "answer", "uid", "question"):
        _str(f"problem {name}", getattr(p, name))
    if type(p.messages) is not tuple or not all(
        type(m) is tuple and len(m) == 2 and all(type(x) is str for x in m) for m in p.messages
    ):
        raise ValueError("problem messages: expected (role, content) pairs of strings")


def check_payload(p: LivePayload) -> None:
    if not isinstance(p.problem, Problem):
        raise ValueError(f"payload problem: a {type(p.problem).__name__}, not a Problem")
    _ids("payload prompt_ids", p.prompt_ids)
    if p.response is not None and not isinstance(p.response, SeqResult):
        raise ValueError(f"payload response: a {type(p.response).__name__}, not a SeqResult")
    _ids("payload judge_ids", p.judge_ids)
    _str("payload judgement", p.judgement)
    if p.traj is not None and not isinstance(p.traj, Trajectory):
        raise ValueError(f"payload traj: a {type(p.traj).__name__}, not a Trajectory")


_SAMPLE_INTS = {
    "sample_id": 0,
    "step": 0,
    "prompt_index": 0,
    "group": 0,
    "prompt_len": 0,
    "version_start": -1,
    "response_len": 0,
    "judgement_len": 0,
    "reward_context": 0,
    "trained_at": -1,
    "turn": 0,
    "context_len": 0,
    "tool_calls": 0,
}


# What a sample's payload may be: the live cluster's; a cluster adapter that checkpoints
# payloads of its own (the tests' simulated resumes) allows its type here.
_PAYLOADS: set[type] = {LivePayload}


def allow_payload(cls: type) -> None:
    """Let checkpointed samples carry payloads of `cls` (a codec-registered record)."""
    _PAYLOADS.add(cls)


def check_sample(s: Sample) -> None:
    for name, low in _SAMPLE_INTS.items():
        _int(f"sample {name}", getattr(s, name), low)
    for name in ("reward_verifiable", "reward_genrm"):
        _number(f"sample {name}", getattr(s, name))
    for name in ("rolled_out", "rewarded"):
        _bool(f"sample {name}", getattr(s, name))
    if s.payload is not None and type(s.payload) not in _PAYLOADS:
        allowed = sorted(c.__name__ for c in _PAYLOADS)
        raise ValueError(f"sample payload: a {type(s.payload).__name__}, not one of {allowed}")


def check_genrm_stats(g: GenRMStats) -> None:
    _int("genrm_stats judged", g.judged)
    _int("genrm_stats unparsable", g.unparsable)
    if type(g.examples) is not list or not all(type(x) is str for x in g.examples):
        raise ValueError("genrm_stats examples: expected a list of strings")


RECORD_CHECKS: dict[type, Callable[[Any], None]] = {
    Sample: check_sample,
    LivePayload: check_payload,
    Problem: check_problem,
    SeqResult: check_seq_result,
    GenRMStats: check_genrm_stats,
    Trajectory: check_trajectory,
    Segment: check_segment,
    CallRecord: check_call,
    TrajectoryLimits: check_limits,
}
