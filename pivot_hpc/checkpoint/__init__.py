"""Checkpoints that lose nothing (docs/design.md §9): policy weights (HF safetensors, from GPS),
training state (megatron dist_checkpointing), RL state (step, data cursor, replay buffer,
partial sequences with their tokens), per-rank RNG states. Written to a temporary
directory and renamed, so a checkpoint is complete or absent."""
