"""Inference and training engines behind two small protocols (DESIGN.md §5)."""
