"""The `sglang` engine: one SGLang Engine per replica leader (GPU; faked on CPU in tests)."""
