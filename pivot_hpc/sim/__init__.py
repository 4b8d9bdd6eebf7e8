"""Discrete-event cluster simulator driving the same coordinator (DESIGN.md §8)."""
