"""GPS model catalog: canonical tensors, TP/PP partition rules, fused-weight converters."""

from __future__ import annotations

import numpy as np
import pytest

from pivot_hpc.gps import PAPER_MODELS, GPSError, ModelSpec, Parallelism
from pivot_hpc.gps.fused import fuse_qkv_megatron, fuse_rows, split_qkv_megatron, split_rows


@pytest.mark.parametrize(
    ("name", "billions"),
    [("qwen2.5-1.5b", 1.54), ("qwen2.5-7b", 7.62), ("qwen2.5-32b", 32.76), ("qwen2.5-72b", 72.71)],
)
def test_paper_models_have_published_parameter_counts(name, billions):
    assert PAPER_MODELS[name].num_params / 1e9 == pytest.approx(billions, abs=0.01)


def test_from_hf_config_reads_qwen2_and_llama_keys():
    cfg = {
        "model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 512,
        "vocab_size": 346, "tie_word_embeddings": True, "head_dim": 64, "dtype": "bfloat16",
    }  # fmt: skip
    spec = ModelSpec.from_hf_config(cfg, name="tiny")
    assert spec == PAPER_MODELS["tiny-llama"].__class__(**{**spec.__dict__})
    names = [t.name for t in spec.tensors]
    assert "lm_head.weight" not in names and "model.layers.1.self_attn.q_proj.bias" not in names
    qwen = ModelSpec.from_hf_config({**cfg, "model_type": "qwen2"})
    assert "model.layers.0.self_attn.k_proj.bias" in [t.name for t in qwen.tensors]


def _tensor(spec, name):
    return spec.tensors[spec.index[name]]


def test_tp_rules_column_row_vocab_replicated():
    m = PAPER_MODELS["qwen2.5-72b"]
    q = _tensor(m, "model.layers.0.self_attn.q_proj.weight")
    o = _tensor(m, "model.layers.0.self_attn.o_proj.weight")
    emb = _tensor(m, "model.embed_tokens.weight")
    norm = _tensor(m, "model.layers.0.input_layernorm.weight")
    assert m.shard_box(q, 8, 3) == (3 * 1024, 4 * 1024, 0, 8192)  # 8 heads of 128 rows
    assert m.shard_box(o, 8, 3) == (0, 8192, 3 * 1024, 4 * 1024)  # columns, by heads
    assert m.shard_box(emb, 8, 7) == (7 * 19008, 152064, 0, 8192)
    assert m.shard_box(norm, 8, 5) == (0, 8192, 0, 1)
    assert m.shard_shape(norm, 8, 5) == (8192,)


def test_kv_heads_are_replicated_when_tp_exceeds_them():
    m = PAPER_MODELS["qwen2.5-1.5b"]  # 2 KV heads of 128
    k = _tensor(m, "model.layers.0.self_attn.k_proj.weight")
    boxes = [m.shard_box(k, 4, r)[:2] for r in range(4)]
    assert boxes == [(0, 128), (0, 128), (128, 256), (128, 256)]


def test_vocab_that_tp_does_not_divide_is_ceil_split():
    m = PAPER_MODELS["tiny-qwen2"]  # vocab 346
    e = _tensor(m, "model.embed_tokens.weight")
    rows = [m.shard_box(e, 4, r)[:2] for r in range(4)]
    assert rows == [(0, 87), (87, 174), (174, 261), (261, 346)]


def test_pipeline_stages_and_tied_embedding_on_both_ends():
    m = PAPER_MODELS["qwen2.5-1.5b"]  # 28 layers, tied
    assert [len(m.stage_layers(3, s)) for s in range(3)] == [10, 9, 9]
    emb = _tensor(m, "model.embed_tokens.weight")
    assert m.stages_of(emb, 4) == (0, 3)
    last = {m.tensors[i].name for i in m.stage_tensors(4, 3)}
    assert {"model.norm.weight", "model.embed_tokens.weight"} <= last
    untied = PAPER_MODELS["qwen2.5-7b"]
    assert "lm_head.weight" in {untied.tensors[i].name for i in untied.stage_tensors(2, 1)}
    assert "lm_head.weight" not in {untied.tensors[i].name for i in untied.stage_tensors(2, 0)}


def test_parallelism_coordinates_are_tp_fastest_then_dp_then_pp():
    p = Parallelism(tp=2, pp=2, dp=3)
    seen = {p.coords(i) for i in range(p.size)}
    assert len(seen) == 12
    assert p.coords(1) == (0, 0, 1) and p.coords(2) == (1, 0, 0) and p.coords(6) == (0, 1, 0)
    assert all(p.index(*p.coords(i)) == i for i in range(p.size))


@pytest.mark.parametrize(
    ("model", "par", "text"),
    [
        ("qwen2.5-7b", Parallelism(tp=8), "num_attention_heads=28 is not divisible by tp=8"),
        ("tiny-qwen2", Parallelism(tp=3), "not divisible by tp=3"),
        ("tiny-qwen2", Parallelism(pp=3), "pp=3 exceeds num_hidden_layers=2"),
    ],
)
def test_parallelism_that_does_not_divide_is_rejected(model, par, text):
    with pytest.raises(GPSError, match=text):
        PAPER_MODELS[model].check(par)
    with pytest.raises(GPSError, match="must be an integer >= 1"):
        Parallelism(tp=0)


def test_fused_qkv_is_split_per_head_group_not_naively():
    nh, nkv, d, h, tp = 8, 4, 4, 16, 2
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((n * d, h)) for n in (nh, nkv, nkv))
    full = fuse_qkv_megatron(q, k, v, d)  # Megatron layout of the whole weight
    for r in range(tp):
        qs = q[r * nh // tp * d : (r + 1) * nh // tp * d]
        ks = k[r * nkv // tp * d : (r + 1) * nkv // tp * d]
        vs = v[r * nkv // tp * d : (r + 1) * nkv // tp * d]
        shard = fuse_qkv_megatron(qs, ks, vs, d)
        per = full.shape[0] // tp
        assert np.array_equal(shard, full[r * per : (r + 1) * per])  # groups are contiguous
        sglang = fuse_rows(qs, ks, vs)  # SGLang's per-rank qkv_proj
        naive = fuse_rows(q, k, v)  # the full fused weight, cut into tp equal row blocks
        assert not np.array_equal(sglang, naive[r * per : (r + 1) * per])
        assert not np.array_equal(shard, sglang)  # Megatron interleaves per KV group
        back = split_qkv_megatron(shard, nh // tp, nkv // tp, d)
        assert all(np.array_equal(a, b) for a, b in zip(back, (qs, ks, vs), strict=True))
        assert all(
            np.array_equal(a, b)
            for a, b in zip(
                split_rows(sglang, [len(qs), len(ks), len(vs)]), (qs, ks, vs), strict=True
            )
        )
