"""`pivot-hpc profile` (fit + held-out report + loadable YAML) and `bench engine --json`."""

from __future__ import annotations

import json

import pytest

from pivot_hpc.cli.main import main
from pivot_hpc.engines.profile import (
    apply_profiles,
    fit_prefill,
    fit_samples,
    load_profile,
    prefill_sweep,
    sweep,
)
from pivot_hpc.job.config import load_config


def test_sweep_and_fit(tiny_model):
    samples = sweep(tiny_model, [1, 4, 16, 32], [8, 64, 128], steps=3)
    assert len(samples) == 12 and any(s.held_out for s in samples)
    assert all(s.latency_s > 0 and s.n_tok >= s.n_seq * 8 for s in samples)
    res = fit_samples(samples)
    assert res.fit.samples + res.held_out.samples == 12
    # Fit quality on real timings depends on machine load (tiny models step in ~1 ms), so
    # only the report's shape is checked here; tests/unit/test_throughput.py checks that
    # the fit recovers known constants.
    m = res.fit.model
    assert all(v >= 0 for v in (m.A, m.B, m.C, m.D)) and m.B + m.D > 0
    assert res.held_out.samples >= 1 and 0 <= res.held_out.median_rel_error < float("inf")


def test_sweep_measures_large_batches_after_a_chunked_prefill(tiny_model):
    """128 sequences do not all prefill in one engine step: the sweep measures once every
    one of them decodes (the brief start-up profile goes that far, see runtime/main.py)."""
    samples = sweep(tiny_model, [1, 128], [96], steps=2, num_threads=1)
    assert [s.n_seq for s in samples] == [1, 128]
    assert samples[1].n_tok >= 128 * 96


def test_prefill_sweep_measures_a_positive_cost_per_token(tiny_model):
    samples = prefill_sweep(tiny_model, [1, 8], [16, 256], repeats=3)
    assert [(p.n_seq, p.prompt_len) for p in samples] == [(1, 16), (1, 256), (8, 16), (8, 256)]
    assert all(p.latency_s > 0 for p in samples)
    # 2048 prompt tokens cost more than 16 (~10x on the tiny model), whatever the load
    assert samples[3].latency_s > samples[0].latency_s
    fit = fit_prefill(samples)
    assert fit.s_per_token > 0 and fit.intercept_s >= 0 and fit.samples == 4


def test_profile_cli_writes_loadable_constants(tmp_path, capsys):
    rc = main(
        [
            "profile",
            "--model",
            "random",
            "--batch-sizes",
            "1,8,32",
            "--context-lens",
            "8,64,128",
            "--steps",
            "3",
            "--out",
            str(tmp_path),
            "--json",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("A", "B", "C", "D", "r2", "held_out_r2", "held_out_median_rel_error"):
        assert key in out
    path = tmp_path / "hf-random.yaml"
    assert out["profile"] == str(path) and path.is_file()
    tc = load_profile(path)
    assert tc.B + tc.D > 0
    # prefill measured by default (batches 1 and 4 × the context lengths), into the file
    assert out["prefill_s_per_token"] > 0
    assert tc.prefill_s_per_token == pytest.approx(out["prefill_s_per_token"])
    cfg = load_config(None, [f"engines.reward.throughput_profile={path}"])
    given = cfg
    cfg = apply_profiles(cfg)
    assert given.reward.throughput.A != out["A"] or out["A"] == 1e-8  # not changed in place
    assert cfg.reward.throughput.A == pytest.approx(out["A"])
    assert cfg.rollout.throughput.A != cfg.reward.throughput.A or out["A"] == 1e-8
    assert cfg.reward.throughput.prefill_s_per_token == pytest.approx(out["prefill_s_per_token"])
    assert cfg.rollout.throughput.prefill_s_per_token is None


@pytest.mark.slow  # a benchmark, and vLLM's import when it is the first to need it
def test_bench_engine_json(capsys):
    rc = main(
        ["bench", "engine", "--json", "--batch-sizes", "1,64", "--new-tokens", "8", "--repeat", "1"]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    for b in ("1", "64"):
        row = out["batch"][b]
        assert row["tokens_per_s"] > 0 and row["hf_generate_tokens_per_s"] > 0
        assert row["outputs_match"]
    assert out["ratio_batch64"] == pytest.approx(out["batch"]["64"]["ratio"])
    # vLLM beside them (tests/vllm_support.py: installed in CI); without it, null and why
    if out["vllm_skipped"] is None:
        for b in ("1", "64"):
            assert out[f"vllm_tokens_per_s_batch{b}"] > 0 and out["batch"][b]["vllm_outputs_match"]
        assert out["ratio_vllm_vs_hf_batch64"] == pytest.approx(
            out["vllm_tokens_per_s_batch64"] / out["batch"]["64"]["tokens_per_s"]
        )
        assert out["vllm_startup_s"] > 0
    else:
        assert out["vllm_tokens_per_s_batch64"] is None and out["ratio_vllm_vs_hf_batch64"] is None
