"""The GPU device check (tests/gpu/device_check.py) and the direct GPS copy path it measures.

- On any machine: `pinned.copy_runs` (the node-local Read into torch arenas: merged
  contiguous copies, per-row and span+gather strided runs) equals `LocalCopy`'s plain copy,
  and the device check's whole `--cpu-dry-run` passes (every section's code on CPU).
- With CUDA: each section of the device check at small sizes, asserting correctness
  (Megatron vs HF logits, GPS bytes read into VRAM), the full live run of
  configs/gpu/device-check.yaml, and the `sglang` adapter where SGLang is installed.
"""

from __future__ import annotations

import json
import mmap
import os

import numpy as np
import pytest
import torch

from pivot_hpc.gps.catalog import PAPER_MODELS
from pivot_hpc.gps.pinned import DMA_OVERHEAD_BYTES, HostRegistration, copy_runs, plan_runs
from pivot_hpc.gps.transport import Arena, Batch, LocalCopy
from tests.gpu import device_check as dc

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def _batch(*ops: tuple[int, int, int, int, int]) -> Batch:
    cols = list(zip(*ops, strict=True))
    return Batch(*(np.array(c, dtype=np.int64) for c in cols))


def _reference(buf: np.ndarray, batch: Batch, nbytes: int) -> np.ndarray:
    arena = Arena(nbytes)
    arena.host[:] = 0
    LocalCopy(buf).get(0, arena, batch)
    return arena.host


def _covered(batch: Batch, nbytes: int) -> np.ndarray:
    """Arena bytes that are some run's destination (merged copies also fill the alignment
    padding between runs, which holds nothing)."""
    mask = np.zeros(nbytes, dtype=bool)
    for a, n in zip(
        batch.arena_off.tolist(), (batch.nrows * batch.row_bytes).tolist(), strict=True
    ):
        mask[a : a + n] = True
    return mask


def _direct(buf: np.ndarray, batch: Batch, nbytes: int, **kw) -> np.ndarray:
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    copy_runs(torch.from_numpy(buf), dst, batch, **kw)
    return dst.numpy()


def test_direct_copy_equals_local_copy_on_every_run_kind():
    rng = np.random.default_rng(0)
    far = DMA_OVERHEAD_BYTES + 4096  # rows further apart than one DMA's cost: one copy each
    buf = rng.integers(0, 256, 3 * far + 200_000, dtype=np.uint8)
    batch = _batch(
        # (host_off, nrows, row_bytes, stride, arena_off)
        (0, 1, 100, 100, 0),  # contiguous, 64 B before the next one in both buffers ...
        (164, 1, 100, 100, 164),  # ... but not merged: a strided run lands in that gap
        (5000, 3, 20, 96, 100),  # (short strided rows, inside the gap above)
        (310, 1, 100, 100, 300),  # contiguous, same 64-B gap in both buffers ...
        (474, 1, 36, 36, 464),  # ... so merged with the previous one
        (1000, 4, 50, 50, 576),  # rows back to back: one contiguous copy
        (6000, 30, 24, 96, 800),  # short strided rows: span copy + gather on the device
        (9000, 3, 40, far, 1600),  # rows far apart: one copy per row
    )
    assert len(plan_runs(batch)[0]) == 4
    used = _covered(batch, 1800)
    want = _reference(buf, batch, 1800)[used]
    assert np.array_equal(_direct(buf, batch, 1800)[used], want)
    # a scratch buffer smaller than one span: the span copies go in chunks of rows
    assert np.array_equal(_direct(buf, batch, 1800, scratch_bytes=200)[used], want)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_direct_copy_reads_every_tp_shard_of_a_model(tp):
    spec = PAPER_MODELS["tiny-qwen2"]
    offs, total = dc.packed_layout(spec)
    buf = np.empty(total, dtype=np.uint8)
    dc._pattern(buf)
    window = torch.from_numpy(buf)
    for rank in range(tp):
        batch, boxes, nbytes = dc.shard_batch(spec, offs, tp, rank)
        dst = torch.zeros(nbytes, dtype=torch.uint8)
        copy_runs(window, dst, batch, scratch_bytes=4096)
        assert dc.verify_shards(buf, dst.numpy(), boxes)
        used = _covered(batch, nbytes)
        assert np.array_equal(dst.numpy()[used], _reference(buf, batch, nbytes)[used])


class FakeCudart:
    """Stands in for `torch.cuda.cudart()` (the CUDA runtime boundary): records the calls
    and answers `code` to cudaHostRegister."""

    def __init__(self, code: int = 0) -> None:
        self.code = code
        self.calls: list[tuple] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.calls.append(("register", ptr, size, flags))
        return self.code

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr))
        return 0

    def cudaGetErrorString(self, err: int) -> str:
        return f"fake error {err}"


@pytest.mark.parametrize("code", [0, 712, 2])
def test_host_registration_pages_and_ownership(code, monkeypatch):
    fake = FakeCudart(code)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    pg = mmap.PAGESIZE
    buf = np.zeros(3 * pg + 100, dtype=np.uint8)[37 : 2 * pg + 50]  # unaligned at both ends
    reg = HostRegistration(buf)
    _, ptr, size, flags = fake.calls[0]
    start, end = buf.ctypes.data, buf.ctypes.data + buf.nbytes
    assert ptr % pg == 0 and size % pg == 0 and flags == 1  # whole pages, portable
    assert ptr <= start and end <= ptr + size and start - ptr < pg and ptr + size - end < pg
    # 0: ours, unregistered on close; 712 (already registered): pinned, left to its owner
    assert reg.ok == (code in (0, 712)) and reg.owned == (code == 0)
    assert (reg.error is None) == (code != 2) and (code != 2 or "fake error" in reg.error)
    reg.close()
    assert (("unregister", ptr) in fake.calls) == (code == 0)
    assert not reg.ok


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_cpu_dry_run_passes(tmp_path, monkeypatch):
    """Every section of the device check, on CPU with tiny sizes (gloo, torch CPU arenas;
    the live run with a tiny architecture; the sglang adapter over the tests' fake)."""
    monkeypatch.setenv("OUT", str(tmp_path))
    rc = dc.main(["--cpu-dry-run"])
    report = (tmp_path / "device_check.json").read_text()
    assert rc == 0, report[-4000:]
    assert '"mode": "cpu-dry-run"' in report
    sections = json.loads(report)["sections"]
    live = sections["live"]
    assert live["ok"] and live["rollout_tokens_per_s"] > 0 and live["reward_tokens_per_s"] > 0
    assert {"up rollout", "up reward", "up training"} <= set(live["shift_phases"])
    assert live["gps_read_gbps_rollout"]["median"] > 0
    assert sections["sglang"]["ok"] and sections["sglang"]["backend"] == "fake"


# --------------------------------------------------------------------- on a CUDA device
def _section(name: str) -> dict:
    out = dc.run_section(name, small=True, timeout=300, log_dir=os.environ.get("OUT"))
    assert out.get("ok") is not False, out.get("summary")
    return out


@needs_cuda
def test_megatron_on_cuda_matches_hf():
    r = _section("megatron")
    assert r["backend"] == "nccl" and r["param_device"].startswith("cuda")
    assert r["fp32_logits_max_diff"] <= 1e-3 and r["fp32_logprob_max_diff"] <= 1e-3
    assert r["bf16_param_dtype"] == "torch.bfloat16" and r["offload_all_pinned"]


@needs_cuda
def test_gps_copy_into_vram_reads_the_same_bytes():
    r = _section("gps_copy")
    assert r["registered"] and r["bytes_equal"]
    assert all(r[f"tp{tp}"]["bytes_equal"] for tp in (1, 2, 8))


@needs_cuda
def test_gps_store_read_into_vram():
    r = _section("gps_mpi")
    assert r["bytes_equal"] and r["on_device"].startswith("cuda")


@needs_cuda
def test_hf_engine_generates_on_cuda():
    r = _section("hf")
    assert all(run["tokens_per_s"] > 0 for run in r["runs"])


@needs_cuda
def test_live_run_shifts_every_gpu_between_roles():
    out = dc.run_section("live", timeout=dc.TIMEOUTS["live"], log_dir=os.environ.get("OUT"))
    assert out.get("ok"), out.get("summary")
    assert out["gps_read_gbps_rollout"]["into"] == "VRAM"


@needs_cuda
def test_sglang_adapter_for_real_where_installed():
    r = dc.run_section("sglang", timeout=dc.TIMEOUTS["sglang"], log_dir=os.environ.get("OUT"))
    if r.get("ok") is None:
        pytest.skip(r["summary"])  # "sglang not installed"
    assert r["ok"] and r["backend"] == "sglang", r.get("summary")
