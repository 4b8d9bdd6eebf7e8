"""The model layer (models/description.py): a Hugging Face directory described from its
config and safetensors headers alone, checked against what `transformers` builds."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch

from pivot_hpc.models import safetensors_headers
from pivot_hpc.models.description import describe, description_of
from pivot_hpc.models.limits import model_limits
from pivot_hpc.models.weights import TensorReader
from pivot_hpc.recipes.tiny_arch_dirs import ARCHITECTURES, create_arch_model


def checkpoint_names(model) -> dict[str, tuple[tuple[int, ...], str]]:
    """What `save_pretrained` writes, from the model's own state_dict: transformers 5 keeps
    MoE experts fused in memory ([E, 2I, H] gate_up, [E, H, I] down) and saves them per
    expert; a tied model saves no lm_head."""
    out = {}
    tied = model.config.get_text_config().tie_word_embeddings
    for name, t in model.state_dict().items():
        dtype = str(t.dtype).removeprefix("torch.")
        if name == "lm_head.weight" and tied:
            continue
        if name.endswith("experts.gate_up_proj"):
            base, half = name.removesuffix("gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = ((half, t.shape[2]), dtype)
                out[f"{base}{e}.up_proj.weight"] = ((half, t.shape[2]), dtype)
        elif name.endswith("experts.down_proj"):
            base = name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = (tuple(t.shape[1:]), dtype)
        else:
            out[name] = (tuple(t.shape), dtype)
    return out


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_description_matches_what_transformers_builds_and_loads(arch, arch_dirs):
    d = arch_dirs[arch]
    desc = describe(d)
    model = create_arch_model(arch, dtype="bfloat16", seed=7)
    got = {t.name: (t.shape, t.dtype) for t in desc.tensors}
    assert got == checkpoint_names(model)
    assert desc.architectures == (type(model).__name__,)
    # and transformers itself finds exactly these tensors in the directory
    _, info = type(model).from_pretrained(d, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    # file order: by file, then by offset, back to back
    ends = [t.begin for t in desc.tensors[1:]]
    assert ends == [t.end for t in desc.tensors[:-1]]


FACTS = {
    # arch: heads, kv, head_dim, intermediate, experts, top-k, moe width, tied, lm_head
    "qwen2": (8, 4, 16, 128, 0, 0, None, False, True),
    "qwen2-tied": (8, 4, 16, 128, 0, 0, None, True, False),
    "qwen3": (8, 4, 16, 128, 0, 0, None, False, True),
    "llama3": (8, 4, 16, 128, 0, 0, None, False, True),
    "mistral": (8, 4, 16, 128, 0, 0, None, False, True),
    "qwen3-moe": (8, 4, 16, 128, 4, 2, 32, False, True),
    "glm4": (8, 4, 16, 128, 0, 0, None, False, True),
    "phi3": (8, 4, 16, 128, 0, 0, None, False, True),
    "qwen3.5-moe": (8, 4, 16, None, 4, 2, 32, False, True),
    "qwen3.5-moe-vl": (8, 4, 16, None, 4, 2, 32, False, True),
}


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_config_facts(arch, arch_dirs):
    d = describe(arch_dirs[arch])
    got = (
        d.num_attention_heads, d.num_key_value_heads, d.head_dim, d.intermediate_size,
        d.num_experts, d.num_experts_per_tok, d.moe_intermediate_size,
        d.tie_word_embeddings, d.has_lm_head,
    )  # fmt: skip
    assert got == FACTS[arch]
    assert (d.hidden_size, d.num_hidden_layers, d.vocab_size) == (128, 2, 128)
    assert (d.dtype, d.weights_dtype) == ("bfloat16", "bfloat16")
    assert d.max_position_embeddings == 512 and d.eos_token_ids == (2,)
    assert model_limits(arch_dirs[arch]) == (512, [2])


def test_rope_nested_configs_and_hybrid_layers(arch_dirs):
    llama = describe(arch_dirs["llama3"])
    assert llama.rope_theta == 500000.0
    assert llama.rope_scaling is not None and llama.rope_scaling["rope_type"] == "llama3"
    assert llama.rope_scaling["factor"] == 8.0
    assert describe(arch_dirs["qwen3"]).rope_scaling is None
    assert describe(arch_dirs["glm4"]).partial_rotary_factor == 0.5
    vl = describe(arch_dirs["qwen3.5-moe-vl"])  # the decoder's numbers live in text_config
    assert "text_config" in vl.config and "hidden_size" not in vl.config
    assert (vl.model_type, vl.text_model_type) == ("qwen3_5_moe", "qwen3_5_moe_text")
    assert vl.text_prefix == "model.language_model."
    assert vl.layer_types == ("linear_attention", "full_attention") and vl.kv_layers == 1
    text = describe(arch_dirs["qwen3.5-moe"])
    assert text.text_prefix == "model." and text.shared_expert_intermediate_size == 32
    # the vision tower and the linear-attention projections have no rule: whole
    assert any(n.startswith("model.visual.") for n in vl.whole_tensors)
    assert all(".linear_attn." in n for n in text.whole_tensors)


def test_description_reads_headers_only(arch_dirs, monkeypatch):
    """No weights: safetensors' and torch's loaders are off, and of each file only the
    8-byte length and the header are read."""
    import safetensors
    import safetensors.torch

    def refuse(*a, **k):
        raise AssertionError("the description loaded weights")

    for mod, fn in [(safetensors, "safe_open"), (safetensors.torch, "load_file"),
                    (safetensors.torch, "load"), (torch, "load")]:  # fmt: skip
        monkeypatch.setattr(mod, fn, refuse)
    read: dict[str, int] = {}
    real_open = open

    class Counting:
        def __init__(self, f, name):
            self.f, self.name = f, name

        def read(self, n=-1):
            data = self.f.read(n)
            read[self.name] = read.get(self.name, 0) + len(data)
            return data

        def __getattr__(self, a):
            return getattr(self.f, a)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(
        safetensors_headers,
        "open",
        lambda p, m="r": Counting(real_open(p, m), str(p)),
        raising=False,
    )
    d = arch_dirs["qwen3-moe"]
    desc = describe(d)
    f = d / "model.safetensors"
    header = int.from_bytes(f.read_bytes()[:8], "little")
    assert read == {str(f): 8 + header}
    assert 8 + header < f.stat().st_size / 10 and len(desc.tensors) == 45


def test_sharded_directory_with_an_index(tmp_path):
    model = create_arch_model("qwen3-moe", seed=1)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(files) > 2 and (tmp_path / "model.safetensors.index.json").is_file()
    desc = describe(tmp_path)
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert {t.name: t.file for t in desc.tensors} == weight_map
    assert {t.name: t.shape for t in desc.tensors} == {
        n: s for n, (s, _) in checkpoint_names(model).items()
    }


def test_cached_per_directory_and_stamps(arch_dirs, tmp_path, caplog):
    d = tmp_path / "m"
    shutil.copytree(arch_dirs["qwen3.5-moe"], d)
    with caplog.at_level(logging.INFO, logger="pivot_hpc.models.description"):
        first = description_of(d)
        assert description_of(d) is first
    logged = [r for r in caplog.records if "held and read whole" in r.getMessage()]
    assert len(logged) == 1 and "8 of 56 tensors" in logged[0].getMessage()
    cfg = d / "config.json"
    c = json.loads(cfg.read_text())
    c["max_position_embeddings"] = 1024
    cfg.write_text(json.dumps(c))
    os.utime(cfg, ns=(cfg.stat().st_atime_ns, cfg.stat().st_mtime_ns + 10**9))
    again = description_of(d)
    assert again is not first and again.max_position_embeddings == 1024


def test_eos_ids_from_config_then_generation_config(arch_dirs, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(arch_dirs["glm4"], d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "eos_token_id": [5, 2]}))
    gen = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [2, 9]}))
    assert describe(d).eos_token_ids == (5, 2, 9)
    assert model_limits(d) == (512, [5, 2, 9])


def test_tensor_reader_maps_one_tensor_at_a_time(arch_dirs, monkeypatch):
    import safetensors.torch
    from safetensors import safe_open

    d = arch_dirs["glm4"]
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        ref = {n: f.get_tensor(n) for n in f.keys()}
    monkeypatch.setattr(safetensors.torch, "load_file", lambda *a, **k: pytest.fail("whole file"))
    with TensorReader(d) as get:
        for name, t in ref.items():
            got = get(name)
            assert got.dtype == t.dtype and torch.equal(got.view(torch.int16), t.view(torch.int16))
        with pytest.raises(safetensors_headers.ModelDirError, match="no tensor 'nope'"):
            get("nope")
