"""The calibration table: every (hardware, model, tp) pair's costs, each with its provenance.

`pivot-hpc calibration` prints it; tests check that it is complete and that the catalog
reproduces the engine-level measurements it was calibrated on.
"""

from __future__ import annotations

from typing import Any

from pivot_hpc.sim.calibration import MEASUREMENTS, REFERENCES, calibration
from pivot_hpc.sim.catalog import (
    HARDWARE,
    MODELS,
    CatalogError,
    InferenceCosts,
    inference_costs,
)

TPS = (1, 2, 4, 8)


def pair_row(model: str, hw: str, tp: int, costs: InferenceCosts) -> dict[str, Any]:
    """One pair's numbers and where each comes from."""
    m, h = MODELS[model], HARDWARE[hw]
    e = calibration(hw).engine
    d = costs.decode
    assert d is not None
    kv = m.kv_bytes_per_token_per_gpu(tp)
    replicated = " (KV heads replicated: kv_heads < tp)" if m.kv_heads < tp else ""
    fit = "fitted: A-D least squares over the simulated engine's L(n, tok), n ≤ cap"
    values = {
        "A": costs.model.A,
        "B": costs.model.B,
        "C": costs.model.C,
        "D": costs.model.D,
        "engine_A": d.A,
        "engine_B_1": d.B(1),
        "engine_C": d.C,
        "engine_S": d.S,
        "engine_D": d.D,
        "kv_capacity_tokens": costs.kv_capacity_tokens,
        "max_running": costs.max_running,
        "prefill_s_per_token": costs.prefill_s_per_token,
        **{f"shift_up.{k}": v for k, v in costs.shift_up_s.items()},
        **{f"shift_down.{k}": v for k, v in costs.shift_down_s.items()},
        "weight_update_s": costs.weight_update_s,
    }
    src = {
        "A": fit,
        "B": fit,
        "C": fit,
        "D": fit,
        "engine_A": f"derived: {kv:.0f} KV bytes/token/GPU{replicated} / "
        f"(eta_attention {e.eta_attention.value} x {h.hbm_tb_s} TB/s)",
        "engine_B_1": f"derived: weight bytes read at n=1 / tp / (eta_weights "
        f"{e.eta_weights.value} x {h.hbm_tb_s} TB/s)"
        + (f"; MoE: E(1-(1-k/E)^n) of {m.experts} experts touched" if m.experts else ""),
        "engine_C": f"derived: 2 x {m.active_params / 1e9:.2f}B active params / (tp x "
        f"{h.bf16_tflops} TFLOP/s x eta_decode_compute {e.eta_decode_compute.value})",
        "engine_S": f"derived: 2 x {m.state_bytes_per_seq / 1e6:.1f} MB recurrent state per "
        "sequence / tp / weight bandwidth"
        if m.state_bytes_per_seq
        else "derived: no recurrent state (0)",
        "engine_D": "derived: step_overhead_s + 2 all-reduces per layer (tp > 1) x allreduce_s",
        "kv_capacity_tokens": f"derived: (hbm_usable {e.hbm_usable.value} x {h.hbm_gb} GB - "
        "weights/tp - state pool) / KV bytes per token per GPU",
        "max_running": costs.sources.get("engine.max_running_requests", ""),
        "prefill_s_per_token": f"derived: 2 x active params / (tp x peak x eta_prefill "
        f"{e.eta_prefill.value})",
        "shift_up.read_s": "derived: weight bytes / shift.host_read_gb_s",
        "shift_up.reload_s": "shift.engine_start_s",
        "shift_down.discard_s": "shift.engine_stop_s",
        "weight_update_s": "derived: weight bytes / shift.host_read_gb_s",
    }
    for key in ("A", "B", "C", "D", "kv_capacity_tokens", "prefill_s_per_token"):
        if costs.sources.get(key, "").startswith("profile"):
            src[key] = costs.sources[key]
    return {"hardware": hw, "model": model, "tp": tp, "values": values, "sources": src}


def pairs(hw: str) -> list[dict[str, Any]]:
    """Every catalog model at every tp that fits on `hw`."""
    out = []
    for model in sorted(MODELS):
        for tp in TPS:
            try:
                costs = inference_costs(MODELS[model], HARDWARE[hw], tp)
            except CatalogError:
                continue
            out.append(pair_row(model, hw, tp, costs))
    return out


def factors(hw: str) -> list[dict[str, Any]]:
    return [{"name": n, "value": v, "source": s} for n, v, s in calibration(hw).rows()]


def checks() -> list[dict[str, Any]]:
    """Catalog predictions against the engine-level measurements (fit points and held-out
    checks)."""
    out = []
    for m in MEASUREMENTS:
        costs = inference_costs(MODELS[m.model], HARDWARE[m.hardware], m.tp)
        pred = costs.latency(m.n_seq, m.n_seq * m.context)
        out.append(
            {
                "name": m.name,
                "hardware": m.hardware,
                "model": m.model,
                "tp": m.tp,
                "predicted_s": pred,
                "measured_s": m.latency_s,
                "ratio": pred / m.latency_s,
                # fit points are tested within ±20 %; held-out checks report their miss
                "fitted": m.fitted,
                "source": m.source,
            }
        )
    return out


def table(hw: str) -> dict[str, Any]:
    return {
        "hardware": hw,
        "factors": factors(hw),
        "pairs": pairs(hw),
        "checks": checks(),
        "references": {str(k): v for k, v in REFERENCES.items()},
    }
