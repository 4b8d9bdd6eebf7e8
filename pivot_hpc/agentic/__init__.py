"""Multi-turn, tool-calling rollouts (issue 37), as standalone pieces not yet wired into
the runtime, coordinator or scheduler (docs/agentic.md):

- `trajectory`: token-in/token-out trajectories, the loss mask, limits, checkpoint data,
  the resume rule, and how observations become tokens (chat-template delta or wrapper);
- `tools`: tool declarations (`schema`: their JSON-schema subset), the registry, reading
  a call from generated text, the observation text;
- `sandbox`: one call in a confined, short-lived child; `server`: a node's pool of them;
- `calculator`: the whitelisting arithmetic evaluator (also the calculator child's program);
- `messages`: `ToolCall` / `ToolResult`, for runtime/protocol.py;
- `config`: `ToolsConfig`.
"""
