"""Tiny Qwen2 models created offline by code: a policy and a GenRM, with a char tokenizer."""
