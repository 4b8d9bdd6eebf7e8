"""The simulator's calibration: a complete table with sources, engine-level checks against
the paper's Figure 8 snapshots and Figure 12 shift ranges, and the model fixes (KV
replication, MoE expert counts, DeltaNet state, running cap) against hand-computed values."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pivot_hpc.sim.calibration import CALIBRATIONS, FIGURE10_PER_GPU_MAX, MEASUREMENTS
from pivot_hpc.sim.catalog import (
    HARDWARE,
    MODELS,
    TrainingTerms,
    inference_costs,
    training_costs,
)
from pivot_hpc.sim.table import checks, pairs

PAIR_KEYS = {
    "A",
    "B",
    "C",
    "D",
    "kv_capacity_tokens",
    "max_running",
    "prefill_s_per_token",
    "shift_up.read_s",
    "shift_up.reload_s",
    "shift_down.discard_s",
    "weight_update_s",
}


@pytest.mark.parametrize("hw", sorted(HARDWARE))
def test_calibration_table_is_complete_with_a_source_for_every_number(hw: str) -> None:
    for name, value, source in CALIBRATIONS[hw].rows():
        assert value > 0, name
        assert source.split(":", 1)[0] in ("measured", "fitted", "assumed"), (name, source)
        assert len(source.split(":", 1)[1].strip()) > 10, name
    rows = pairs(hw)
    models_seen = {r["model"] for r in rows}
    assert models_seen == set(MODELS)  # every catalog model fits at some tp
    for row in rows:
        assert PAIR_KEYS <= set(row["values"]), row["model"]
        for key in row["values"]:
            assert row["sources"].get(key), (row["model"], row["tp"], key)
        v = row["values"]
        assert v["kv_capacity_tokens"] > 0 and v["A"] > 0 and v["B"] + v["D"] > 0


def test_fit_points_within_20_percent_and_figure8_held_out() -> None:
    """Engine-level decode benchmarks are the fit points (±20 %); Figure 8's snapshots are
    held out: their miss is reported by `pivot-hpc calibration`, not fitted (the second
    calibration, docs/results/2026-12-03-sim-calibration.md: the paper's engine under veRL
    runs 2-5x slower than the standalone SGLang benchmarks of the same models)."""
    by_name = {c["name"]: c for c in checks()}
    for c in by_name.values():
        if c["fitted"]:
            assert 0.8 <= c["ratio"] <= 1.2, c
    assert {"qwen3-8b-batch1", "qwen3-32b-batch1", "infersim-qwen3-30b-a3b-decode"} <= {
        n for n, c in by_name.items() if c["fitted"]
    }
    for name in ("figure8-rollout", "figure8-reward"):
        assert not by_name[name]["fitted"]
        assert 0 < by_name[name]["ratio"] < 1.2, by_name[name]  # faster, never slower
    names = {m.name for m in MEASUREMENTS}
    assert {"figure8-rollout", "figure8-reward"} <= names


def test_decode_attention_is_the_cited_kernel_efficiency() -> None:
    """η_attention on H20 is FlashInfer's measured 0.70-0.78 [7], not a value fitted to
    one Figure 8 snapshot at an assumed context (0.05 before the second calibration)."""
    e = CALIBRATIONS["h20"].engine
    assert 0.70 <= e.eta_attention.value <= 0.78
    assert e.eta_attention.source.startswith("measured")


def test_best_per_gpu_rates_stay_within_published_h20_decode() -> None:
    """Group 2 on H20: the best a GPU does stays within the engine-level decode
    measurements — SGLang's 2,749 tok/s/GPU for the GenRM at ~100 sequences/GPU [4] and
    2,682 for Qwen3-8B in FP8 at batch 64 [5] (a bf16 7B reads more bytes per token).
    Figure 10's per-GPU maxima (a trace of the paper's end-to-end run) are lower; the
    calibration report gives the comparison, they are not a ceiling."""
    h20 = HARDWARE["h20"]
    ro = inference_costs(MODELS["qwen2.5-7b"], h20, 1)
    rm = inference_costs(MODELS["qwen3-30b-a3b"], h20, 4)
    assert ro.best_rate(context=1000) <= 2682 * 1.2
    assert rm.best_rate(context=5000) / 4 <= 2749 * 1.2
    assert ro.best_rate(context=1000) > FIGURE10_PER_GPU_MAX["rollout"]  # held out: reported


# Paper Table 1 deployments of each model (inference) and Table 4 training sets.
INFERENCE_TP = {
    "qwen2.5-1.5b": 1,
    "qwen2.5-7b": 1,
    "glm-z1-9b": 1,
    "qwen3-30b-a3b": 4,
    "qwen2.5-32b": 4,
    "qwen2.5-72b": 8,
    "qwen3.5-122b-a10b": 8,
}
TRAINING = [("qwen2.5-1.5b", 16, 1), ("qwen2.5-7b", 8, 1), ("qwen2.5-32b", 32, 4)]
TRAINING += [("qwen2.5-72b", 64, 8)]


def test_shift_times_fall_inside_figure12_ranges() -> None:
    h20 = HARDWARE["h20"]
    up = {}
    for model, tp in INFERENCE_TP.items():
        c = inference_costs(MODELS[model], h20, tp)
        up[model] = sum(c.shift_up_s.values())
        assert 0.8 <= up[model] <= 10.0, (model, up[model])  # "about 1 s … about 9 s"
        assert sum(c.shift_down_s.values()) < 2.0  # "shift down remains below 2 s"
    assert up["qwen2.5-1.5b"] == pytest.approx(1.0, abs=0.3)
    assert up["qwen3.5-122b-a10b"] == pytest.approx(9.0, abs=1.0)
    assert up["qwen2.5-1.5b"] < up["qwen2.5-7b"] < up["qwen2.5-32b"] < up["qwen2.5-72b"]
    for model, gpus, tp in TRAINING:
        t = training_costs(MODELS[model], h20, gpus, tp)
        assert 1.5 <= sum(t.shift_up_s.values()) <= 9.0, model  # "about 2 s to 8.5 s"
        assert sum(t.shift_down_s.values()) < 6.0, model  # "below 6 s"


def test_kv_heads_are_replicated_when_fewer_than_tp() -> None:
    q35 = MODELS["qwen3.5-122b-a10b"]  # 2 KV heads of dim 256 in 12 attention layers
    assert q35.kv_bytes_per_token_per_gpu(1) == 2 * 12 * 2 * 256 * 2
    assert q35.kv_bytes_per_token_per_gpu(2) == 2 * 12 * 1 * 256 * 2
    assert q35.kv_bytes_per_token_per_gpu(8) == 2 * 12 * 1 * 256 * 2  # not 1/4 of a head
    q72 = MODELS["qwen2.5-72b"]  # 8 KV heads of dim 128, 80 layers
    assert q72.kv_bytes_per_token_per_gpu(8) == 2 * 80 * 1 * 128 * 2
    assert q72.kv_bytes_per_token_per_gpu(4) == 2 * 80 * 2 * 128 * 2
    # capacity: (0.85 × 96 GB − weights/8 − DeltaNet state pool) / bytes per token per GPU
    c = inference_costs(q35, HARDWARE["h20"], 8)
    state_pool = 36 * 32 * 128 * 128 * 4 / 8 * 256
    free = 0.85 * 96e9 - 122e9 * 2 / 8 - state_pool
    assert c.kv_capacity_tokens == int(free / 12288)


def test_moe_reads_the_experts_its_batch_touches() -> None:
    moe = MODELS["qwen3-30b-a3b"]  # 128 experts, 8 per token, 48 layers of width 768
    assert moe.expected_experts(1) == pytest.approx(8)
    assert moe.expected_experts(8) == pytest.approx(128 * (1 - (120 / 128) ** 8))
    assert moe.expected_experts(512) == pytest.approx(128, rel=1e-6)
    expert_bytes = 48 * 128 * 3 * 2048 * 768 * 2
    dense_bytes = moe.weight_bytes - expert_bytes
    assert moe.weight_bytes_read(1) == pytest.approx(dense_bytes + expert_bytes * 8 / 128)
    c = inference_costs(moe, HARDWARE["h20"], 4)
    bw = 4.0e12 * 0.34
    assert c.decode.B(1) == pytest.approx((dense_bytes + expert_bytes / 16) / 4 / bw)
    assert c.decode.B(1) < c.decode.B(8) < c.decode.B(256)
    dense = inference_costs(MODELS["qwen2.5-7b"], HARDWARE["h20"], 1)
    assert dense.decode.B(1) == dense.decode.B(256)


def test_recurrent_state_costs_time_per_sequence_and_memory() -> None:
    q35 = inference_costs(MODELS["qwen3.5-122b-a10b"], HARDWARE["h20"], 8)
    per_seq_state = 36 * 32 * 128 * 128 * 4
    assert q35.decode.S == pytest.approx(2 * per_seq_state / 8 / (4.0e12 * 0.34))
    assert inference_costs(MODELS["qwen2.5-72b"], HARDWARE["h20"], 8).decode.S == 0


def test_training_cost_by_terms() -> None:
    h20 = HARDWARE["h20"]
    q7 = MODELS["qwen2.5-7b"]
    base = training_costs(q7, h20, 8, 1, TrainingTerms(activation_recompute=False))
    full = training_costs(
        q7,
        h20,
        8,
        1,
        TrainingTerms(
            recompute_old_logprobs=True, activation_recompute=True, reference_forward=True
        ),
    )
    assert base.flops_per_token == pytest.approx(6 * q7.params)
    assert full.flops_per_token == pytest.approx(12 * q7.params)
    mfu = CALIBRATIONS["h20"].training.mfu_dense_small.value  # a 7B is "small" (< 10B)
    assert base.flops_per_s == pytest.approx(148e12 * 8 * mfu)
    # attention grows with the square of the sequence length
    fixed = base.publish_s + base.allreduce_s(8)
    assert base.step_time([4000]) - fixed > 2 * (base.step_time([2000]) - fixed)
    # data parallelism: twice the GPUs halve the compute, the all-reduce grows towards
    # twice the gradient shard over the link (8 GPUs: one node's NVLink; 16: InfiniBand)
    compute = base.step_time([4000] * 64) - fixed
    assert base.step_time([4000] * 64, 16) - base.publish_s - base.allreduce_s(16) == (
        pytest.approx(compute / 2)
    )
    assert base.allreduce_s(1 * base.tp) == 0.0
    assert base.allreduce_s(16) == pytest.approx(2 * 15 / 16 * q7.params * 2 / 50e9)


def test_calibration_cli_prints_table_and_json() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pivot_hpc", "calibration", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    t = json.loads(out.stdout)
    assert t["hardware"] == "h20" and t["pairs"] and t["checks"] and t["references"]


def test_h20_training_mfu_is_derived_for_h20_not_carried_over() -> None:
    """Training on H20 is the datasheet peak at a stated efficiency derived for H20 (its
    GEMMs take 5x longer than on H200 while memory and links do not), not H100/H200 MFU."""
    h20, h100 = CALIBRATIONS["h20"].training, CALIBRATIONS["h100"].training
    assert h20 is not h100
    for name in ("mfu_dense_small", "mfu_dense_large"):
        value = getattr(h20, name).value
        assert 0.5 <= value <= 0.8, name  # inside the derivation's 0.56-0.80 range
        assert value > getattr(h100, name).value, name
