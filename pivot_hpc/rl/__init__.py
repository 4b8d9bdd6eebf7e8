"""The RL math: GRPO advantages and loss, verifiable and GenRM rewards (paper §2.1, §8.1)."""
