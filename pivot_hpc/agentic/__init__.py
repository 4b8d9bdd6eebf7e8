"""Multi-turn, tool-calling rollouts (issue 37). Wired so far: the `tools` config section
(checked before launch) and each node's sandbox service beside its host rank
(runtime/host_tools.py); not yet the coordinator's turn loop or the scheduler
(docs/guide/agentic.md):

- `trajectory`: token-in/token-out trajectories, the loss mask, limits, checkpoint data,
  the resume rule, and how observations become tokens (chat-template delta or wrapper);
- `tools`: tool declarations (`schema`: their JSON-schema subset), the registry, reading
  a call from generated text, the observation text;
- `sandbox`: one call in a confined, short-lived child; `server`: a node's pool of them;
  `service`: the process that hosts a node's pool, started before MPI, and its wire;
- `calculator`: the whitelisting arithmetic evaluator (also the child program of the
  calculator and of `calc_memory`, its stateful variant);
- `messages`: `ToolCall` / `ToolResult`, for runtime/protocol.py;
- `config`: `ToolsConfig`, the run config's `tools` section.
"""
