"""Held-out evaluation with tools (tools.enabled): greedy trajectories, as training rolls out.

The same turns as the coordinator's loop (runtime/live_turns.py): each turn from the context
so far, a call cut at its closing tag and run in this rank's own sandbox service (rank 0 is
node 0's host rank: `local_service()`, never in-process), its observation appended as ids,
until the policy answers or a limit ends the trajectory. The verifiable reward then reads
the final answer, as in training.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

from pivot_hpc.agentic.config import ToolsConfig
from pivot_hpc.agentic.messages import ToolCall, ToolResult
from pivot_hpc.engines.base import SamplingParams
from pivot_hpc.models.tokenizer import decode_response
from pivot_hpc.runtime.live_turns import LiveTurns

SERVICE_WAIT_S = 60.0  # for all of one turn's calls (each has its own deadline, seconds)


class EvalTurns(LiveTurns):
    def __init__(self, tok, sampling: SamplingParams, tools: ToolsConfig) -> None:
        self.tok = tok
        self.rollout_sampling = sampling
        self.setup_turns(tools)

    def text(self, ids: list[int]) -> str:
        return decode_response(self.tok, ids)

    def answers(self, engine, prompts: list[list[int]], service) -> list[str]:
        """The final answer's text of each prompt's greedy trajectory."""
        samples = [
            SimpleNamespace(sample_id=i, payload=SimpleNamespace(traj=self.new_trajectory(i, p)))
            for i, p in enumerate(prompts)
        ]
        active = list(samples)
        call_id = 0
        base = 1 << 30  # engine sequence ids apart from anything else it ran
        while active:
            for s in active:
                prompt, sampling = self.rollout_turn(s)
                engine.add(base + s.sample_id, prompt, sampling=sampling)
            results = {}
            while engine.has_unfinished():
                for r in engine.step():
                    results[r.seq_id - base] = r
            calls: dict[int, object] = {}
            going = []
            for s in active:
                r = results[s.sample_id]
                turn = self.turn(s, len(r.token_ids), r, call_id)
                if turn.kind == "call":
                    deadline = self.tools.call_timeout_s
                    service.submit(
                        ToolCall(
                            call_id, s.sample_id, turn.tool, turn.args_json, deadline, turn.history
                        )
                    )
                    calls[call_id] = s
                    call_id += 1
                elif turn.kind == "again":
                    going.append(s)
            for result in _collect(service, set(calls)):
                s = calls[result.call_id]
                if self.observe(s, result) is not None:
                    going.append(s)
            active = going
            base += len(prompts)
        return [self.text(self.answer_ids(s.payload)) for s in samples]


def _collect(service, waiting: set[int]) -> list[ToolResult]:
    out: list[ToolResult] = []
    deadline = time.monotonic() + SERVICE_WAIT_S
    while waiting and time.monotonic() < deadline:
        for r in service.poll():
            if r.call_id in waiting:
                waiting.discard(r.call_id)
                out.append(r)
        time.sleep(0.005)
    # a call the service never answered: the model sees it as unavailable
    out += [ToolResult(c, "unavailable", "no answer", 0.0) for c in sorted(waiting)]
    return out
