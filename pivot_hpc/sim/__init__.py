"""Discrete-event cluster simulator driving the same coordinator (docs/design.md §8)."""
