"""Inference and training engines behind two small protocols (docs/design.md §5)."""
