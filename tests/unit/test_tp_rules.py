"""Tensor-parallel rules from tensor names (models/tp_rules.py) and the generic tp check."""

from __future__ import annotations

import pytest

from pivot_hpc.gps import PAPER_MODELS, GPSError, ModelSpec, Parallelism
from pivot_hpc.gps.catalog import TensorSpec
from pivot_hpc.models.tp_rules import place, text_prefix

H, NH, NKV, D, FF = 64, 8, 2, 8, 96  # hidden, heads, KV heads, head dim, MLP width


def rule(name: str, shape: tuple[int, ...], prefix: str | None = "model."):
    return place(name, shape, prefix, heads=NH, kv_heads=NKV, layers=2)


@pytest.mark.parametrize(
    ("name", "shape", "kind", "dim", "units"),
    [
        ("model.layers.0.self_attn.q_proj.weight", (NH * D, H), "column", 0, [NH]),
        ("model.layers.0.self_attn.q_proj.bias", (NH * D,), "column", 0, [NH]),
        ("model.layers.1.self_attn.k_proj.weight", (NKV * D, H), "column", 0, [NKV]),
        ("model.layers.1.self_attn.v_proj.bias", (NKV * D,), "column", 0, [NKV]),
        ("model.layers.0.self_attn.o_proj.weight", (H, NH * D), "row", 1, [NH]),
        ("model.layers.0.self_attn.o_proj.bias", (H,), "replicated", None, []),
        ("model.layers.0.mlp.gate_proj.weight", (FF, H), "column", 0, [FF]),
        ("model.layers.0.mlp.up_proj.weight", (FF, H), "column", 0, [FF]),
        ("model.layers.0.mlp.down_proj.weight", (H, FF), "row", 1, [FF]),
        ("model.layers.0.mlp.experts.3.gate_proj.weight", (16, H), "column", 0, [16]),
        ("model.layers.0.mlp.experts.3.down_proj.weight", (H, 16), "row", 1, [16]),
        ("model.layers.0.mlp.shared_expert.up_proj.weight", (32, H), "column", 0, [32]),
        ("model.layers.0.block_sparse_moe.experts.1.w2.weight", (H, 16), "row", 1, [16]),
        # fused: each part cut on its own
        (
            "model.layers.0.self_attn.qkv_proj.weight",
            ((NH + 2 * NKV) * D, H),
            "column",
            0,
            [NH, NKV, NKV],
        ),
        ("model.layers.0.mlp.gate_up_proj.weight", (2 * FF, H), "column", 0, [FF, FF]),
        ("model.embed_tokens.weight", (103, H), "vocab", 0, [103]),
        ("lm_head.weight", (103, H), "vocab", 0, [103]),
        # replicated by rule
        ("model.layers.0.input_layernorm.weight", (H,), "replicated", None, []),
        ("model.layers.0.self_attn.q_norm.weight", (D,), "replicated", None, []),
        ("model.layers.0.mlp.gate.weight", (4, H), "replicated", None, []),
        ("model.layers.0.mlp.shared_expert_gate.weight", (1, H), "replicated", None, []),
        ("model.norm.weight", (H,), "replicated", None, []),
    ],
)
def test_known_names_get_their_rule(name, shape, kind, dim, units):
    r = rule(name, shape).rule
    assert (r.kind, r.dim, [p.units for p in r.parts], r.known) == (kind, dim, units, True)


@pytest.mark.parametrize(
    ("name", "shape"),
    [
        ("model.layers.0.mlp.experts.gate_up_proj", (4, 32, H)),  # 3-D fused experts
        ("model.layers.0.mlp.experts.down_proj", (4, H, 16)),
        ("model.layers.0.self_attn.query_key_value.weight", (3 * NH * D, H)),  # layouts differ
        ("model.layers.0.linear_attn.in_proj_qkv.weight", (192, H)),  # not qkv_proj
        ("model.layers.0.linear_attn.conv1d.weight", (192, 1, 4)),
        ("model.layers.0.self_attn.q_proj.weight", (NH * D + 1, H)),  # heads do not divide it
        ("model.visual.blocks.0.attn.q_proj.weight", (NH * D, H)),  # a tower's own heads
        ("mtp.layers.0.self_attn.q_proj.weight", (NH * D, H)),
        ("model.layers.7.self_attn.q_proj.weight", (NH * D, H)),  # beyond num_hidden_layers
        ("model.layers.0.mlp.experts.e_score_correction_bias", (4,)),
    ],
)
def test_unknown_tensors_are_whole(name, shape):
    p = rule(name, shape)
    assert p.rule.dim is None and not p.rule.known
    assert p.place in ("layer", "other")


def test_without_a_text_decoder_every_split_but_the_vocabulary_is_off():
    assert text_prefix(["transformer.wte.weight", "transformer.h.0.attn.c_attn.weight"]) is None
    assert not rule("transformer.h.0.mlp.gate_proj.weight", (FF, H), None).rule.known
    assert rule("lm_head.weight", (103, H), None).rule.kind == "vocab"


def test_text_prefix_is_the_decoder_beside_its_layers():
    names = [
        "model.visual.embed_tokens.weight",  # a tower's embedding, no layers beside it
        "model.language_model.embed_tokens.weight",
        "model.language_model.layers.0.mlp.up_proj.weight",
    ]
    assert text_prefix(names) == "model.language_model."


def test_kv_heads_replicate_and_fused_parts_are_cut_part_by_part():
    k = rule("model.layers.0.self_attn.k_proj.weight", (NKV * D, H)).rule
    assert [k.ranges(NKV * D, 4, r) for r in range(4)] == [[(0, 8)], [(0, 8)], [(8, 16)], [(8, 16)]]  # fmt: skip
    qkv = rule("model.layers.0.self_attn.qkv_proj.weight", ((NH + 2 * NKV) * D, H)).rule
    # rank 1 of 2: q heads 4..7, k head 1, v head 1 (v starts after q's 64 and k's 16 rows)
    assert qkv.ranges(96, 2, 1) == [(32, 64), (72, 80), (88, 96)]
    gu = rule("model.layers.0.mlp.gate_up_proj.weight", (2 * FF, H)).rule
    assert gu.ranges(2 * FF, 4, 3) == [(72, 96), (168, 192)]
    emb = rule("model.embed_tokens.weight", (103, H)).rule
    assert [emb.ranges(103, 4, r) for r in range(4)] == [[(0, 26)], [(26, 52)], [(52, 78)], [(78, 103)]]  # fmt: skip


def test_problems_name_the_number_and_tp():
    q = rule("model.layers.0.self_attn.q_proj.weight", (NH * D, H)).rule
    assert q.problem(3) == "num_attention_heads=8 is not divisible by tp=3"
    k = rule("model.layers.0.self_attn.k_proj.weight", (NKV * D, H)).rule
    assert "tp=3 and num_key_value_heads=2 must divide one another" in (k.problem(3) or "")
    assert k.problem(8) is None  # replicated over 4 ranks each


def _spec(tensors: list[tuple[str, tuple[int, ...]]]) -> ModelSpec:
    ts = []
    for name, shape in tensors:
        p = rule(name, shape)
        ts.append(TensorSpec(name, shape, "float32", p.rule, p.layer, p.place))
    return ModelSpec(
        hidden_size=H, num_hidden_layers=2, num_attention_heads=NH, num_key_value_heads=NKV,
        intermediate_size=0, vocab_size=103, dtype="float32", name="m",
        tensor_list=tuple(ts), described_dtype="float32",
    )  # fmt: skip


def test_check_is_generic_over_every_split_tensor():
    m = _spec(
        [
            ("model.embed_tokens.weight", (103, H)),
            ("model.layers.0.self_attn.q_proj.weight", (NH * D, H)),
            ("model.layers.0.mlp.experts.0.gate_proj.weight", (12, H)),  # 12 channels
            ("model.layers.0.linear_attn.in_proj_qkv.weight", (100, H)),  # whole: no constraint
        ]
    )
    assert m.valid_tp(16) == [1, 2, 4]
    m.check(Parallelism(tp=4))
    with pytest.raises(GPSError) as info:
        m.check(Parallelism(tp=8))
    msg = str(info.value)
    assert "size 12 of dim 0 is not divisible by tp=8" in msg
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in msg and "[1, 2, 4]" in msg
    assert "\n" not in msg


def test_paper_models_keep_their_rules_and_messages():
    m = PAPER_MODELS["qwen2.5-7b"]
    with pytest.raises(GPSError, match=r"num_attention_heads=28 is not divisible by tp=8.*choose tp among \[1, 2, 4\]"):  # fmt: skip
        m.check(Parallelism(tp=8))
    t = m.tensors[m.index["model.layers.3.mlp.down_proj.weight"]]
    assert (t.tp_kind, t.split_dim, t.units, t.layer, t.part) == ("row", 1, 18944, 3, "layer")
