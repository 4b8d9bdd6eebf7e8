"""Recipes over the engines: tiny-model creation with SFT warm-up, a single-process GRPO
loop (the fast learning check)."""
