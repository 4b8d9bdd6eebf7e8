"""Config of multi-turn tool-calling rollouts: the run config's `tools` section."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from pivot_hpc.agentic.sandbox import SandboxLimits
from pivot_hpc.agentic.tools import BUILTIN_TOOLS, build_registry
from pivot_hpc.agentic.trajectory import TrajectoryLimits
from pivot_hpc.errors import fail


@dataclass(kw_only=True)
class ToolsConfig:
    """Rollouts in which the policy calls tools; each call runs in a sandboxed child
    process on its node (docs/guide/agentic.md)."""

    enabled: bool = False  # multi-turn rollouts with tool calls (false: one turn, no tools)
    # the built-in tools the policy may call: calculator, or calc_memory (stateful:
    # `ans` is the last result; both are called with <calc>, so declare one of them)
    tools: tuple[str, ...] = ("calculator",)
    max_turns: int = 4  # generation turns per trajectory; a call after the last one is not run
    # tokens of the whole trajectory (prompt, every turn and every observation); a turn may
    # only generate what is left
    max_context_tokens: int = 512
    max_tool_output_tokens: int = 64  # tokens of one observation, its <result> wrapper included
    # the side an observation too long is cut from: "right" keeps its beginning, "left"
    # its end
    truncation_side: Literal["left", "right"] = "right"
    call_timeout_s: float = 5.0  # wall clock of one call; its whole process group is killed then
    cpu_seconds: int = 2  # CPU time of one call (RLIMIT_CPU)
    memory_mb: int = 256  # address space of one call's process, the interpreter included
    max_output_bytes: int = 16384  # a call writing more is killed (an error observation)
    max_concurrent: int = 4  # tool calls running at once on one node; the rest queue
    # sandbox deaths in a row (crashed or unstartable children, not tool errors) after which
    # a node takes no more tool calls, with one line
    unhealthy_after_failures: int = 3

    def validate(self, path: str) -> None:
        if self.enabled and not self.tools:
            fail(f"{path}.tools", list(self.tools), "name at least one tool, or disable tools")
        unknown = [t for t in self.tools if t not in BUILTIN_TOOLS]
        if unknown:
            fail(f"{path}.tools", unknown, f"unknown tool; built in: {sorted(BUILTIN_TOOLS)}")
        if len(set(self.tools)) != len(self.tools):
            fail(f"{path}.tools", list(self.tools), "each tool once")
        try:  # two tools on one shorthand tag (calculator, calc_memory: <calc>)
            build_registry(self.tools)
        except ValueError as exc:
            fail(f"{path}.tools", list(self.tools), str(exc))
        for name in (
            "max_turns",
            "max_context_tokens",
            "max_tool_output_tokens",
            "cpu_seconds",
            "max_output_bytes",
            "max_concurrent",
            "unhealthy_after_failures",
        ):
            if getattr(self, name) < 1:
                fail(f"{path}.{name}", getattr(self, name), "must be >= 1")
        if self.max_tool_output_tokens >= self.max_context_tokens:
            fail(
                f"{path}.max_tool_output_tokens",
                self.max_tool_output_tokens,
                f"must be below {path}.max_context_tokens={self.max_context_tokens}",
            )
        if not math.isfinite(self.call_timeout_s) or self.call_timeout_s <= 0:
            fail(f"{path}.call_timeout_s", self.call_timeout_s, "must be > 0 seconds")
        if self.memory_mb < 32:
            fail(f"{path}.memory_mb", self.memory_mb, "the interpreter alone needs >= 32 MB")

    def sandbox_limits(self) -> SandboxLimits:
        return SandboxLimits(
            timeout_s=self.call_timeout_s,
            cpu_s=self.cpu_seconds,
            memory_mb=self.memory_mb,
            max_output_bytes=self.max_output_bytes,
        )

    def trajectory_limits(self) -> TrajectoryLimits:
        return TrajectoryLimits(
            max_turns=self.max_turns,
            max_context_tokens=self.max_context_tokens,
            max_tool_output_tokens=self.max_tool_output_tokens,
            truncation_side=self.truncation_side,
        )
