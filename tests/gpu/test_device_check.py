"""The device check (tests/gpu/run_device_check.sh, device_check.py) and the direct GPS copy
path it measures.

- On any machine (CI): `pinned.copy_runs` (the node-local Read into torch arenas: merged
  contiguous copies, per-row and span+gather strided runs) equals `LocalCopy`'s plain copy;
  `run_device_check.sh --dry-run` fits the single-H200 check machine's limits (≤ 8 result
  files, the JSON report's schema, the SGLang/vLLM line, < 60 s); a section over its budget
  is recorded as timed out while the others still run; a wheel for another Python is
  refused before anything runs. Slow: `--cpu-full` (every section's code on CPU, the live
  run stopped mid-generation, checkpointed and resumed).
- With CUDA: each section at small sizes (Megatron and SDPA vs HF logits, GPS bytes read
  into VRAM, the hf engine), the memory plan against a measured step, and the live run
  with its checkpoint and resume.
"""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from pivot_hpc.gps.catalog import PAPER_MODELS
from pivot_hpc.gps.pinned import DMA_OVERHEAD_BYTES, HostRegistration, copy_runs, plan_runs
from pivot_hpc.gps.transport import Arena, Batch, LocalCopy
from tests.gpu import device_check as dc

SCRIPT = Path(dc.__file__).with_name("run_device_check.sh")
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


# ------------------------------------------------------------ the script, on any machine
def _script(mode: str, out: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), mode, *args],
        env={**os.environ, "OUT": str(out), "PYTHON": sys.executable, **env},
        capture_output=True,
        text=True,
        timeout=180,
    )


def _files(out: Path) -> list[str]:
    return sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())


@pytest.mark.slow  # 10-25 s: the full suite (CI) runs it
@pytest.mark.timeout(240)
def test_dry_run_fits_the_h200_check_machine(tmp_path):
    """`run_device_check.sh --dry-run` on CPU: the device run's path (arguments, every
    section in its own process under its budget, the report) in < 60 s, at most 8 files
    back, every section's status and reason in the JSON, and the SGLang/vLLM line."""
    out = tmp_path / "out"
    t0 = time.monotonic()
    proc = _script("--dry-run", out)
    wall = time.monotonic() - t0
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    assert wall < 60, f"dry run took {wall:.1f} s"
    files = _files(out)
    assert len(files) <= dc.MAX_RESULT_FILES
    assert files == ["console.log", dc.JSON_NAME, dc.LOG_NAME]
    assert "SGLang and vLLM cannot be installed on the single-H200 check machine" in text
    assert "SGLang and vLLM cannot be installed" in (out / "console.log").read_text()

    report = json.loads((out / dc.JSON_NAME).read_text())
    assert {
        "schema", "mode", "started", "budget_s", "section_budgets_s", "seconds", "complete",
        "notice", "not_installable", "files", "sections", "failed", "table",
    } <= set(report)  # fmt: skip
    assert report["schema"] == dc.SCHEMA and report["mode"] == "dry-run"
    assert report["complete"] and not report["failed"] and report["seconds"] <= 60
    assert report["budget_s"] <= 60 and set(report["not_installable"]) == {"sglang", "vllm"}
    assert "SGLang and vLLM cannot be installed" in report["notice"]
    assert report["files"] == [dc.JSON_NAME, dc.LOG_NAME]
    sections = report["sections"]
    assert tuple(sections) == dc.SECTION_NAMES
    for name, r in sections.items():
        assert {"status", "ok", "summary", "seconds", "timeout_s", "sizes"} <= set(r), name
        assert r["status"] in ("pass", "skip"), (name, r)
        assert 0 < r["timeout_s"] <= 2 * dc.BUDGETS["dry-run"][name] + 1e-6
        if r["status"] == "skip":
            assert r["reason"], name  # a section that cannot run says why
    env = sections["env"]
    assert {"python", "torch", "megatron_core", "mpi4py", "sglang_installed"} <= set(env)
    assert {"vllm_installed", "not_installable"} <= set(env)
    assert sections["hf"]["runs"][0]["tokens_per_s"] > 0
    assert sections["gps"]["copy"]["bytes_equal"]
    assert sections["gps"]["store_read"]["ok"] is None  # dry run: no MPI world
    plan = sections["memplan"]["cases"][0]
    assert plan["planned_total_gib"] > plan["planned_allocated_gib"] > 0
    for name in ("megatron", "memplan", "live", "checkpoint"):
        assert sections[name]["status"] == "skip" and sections[name]["reason"]
    log = (out / dc.LOG_NAME).read_text()
    assert all(f"section {n}:" in log for n in dc.SECTION_NAMES)


def test_a_section_over_its_budget_is_recorded_and_the_rest_still_run(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    rc = dc.main(["--dry-run", "--only", "env,megatron", "--budgets", "env=0.2"])
    assert rc == 1
    report = json.loads((tmp_path / dc.JSON_NAME).read_text())
    env, mg = report["sections"]["env"], report["sections"]["megatron"]
    assert env["status"] == "timeout" and "ran over its budget" in env["reason"]
    assert env["timeout_s"] <= 0.4 + 1e-6
    assert mg["status"] == "skip"  # still ran after the timeout
    assert report["failed"] == ["env"] and report["complete"]
    assert "TIMEOUT after" in (tmp_path / dc.LOG_NAME).read_text()


def test_budget_allotment():
    budgets = {"a": 10, "b": 20, "c": 30}
    # on schedule: up to twice its budget, never into what the later sections need
    assert dc.allot("a", ["b", "c"], 60, budgets, 2) == 10
    assert dc.allot("a", ["b", "c"], 100, budgets, 2) == 20
    assert dc.allot("b", ["c"], 45, budgets, 2) == 20  # behind: its own budget at most
    assert dc.allot("b", ["c"], 21, budgets, 2) == 19  # ... leaving the later ones a floor
    assert dc.allot("c", [], 1, budgets, 2) is None  # nothing left: not started
    assert dc.allot("c", [], 500, budgets, 2) == 60
    # the device budgets fit 540 s with the install's time to spare
    assert sum(dc.BUDGETS["device"].values()) <= dc.TOTAL_BUDGET_S["device"] - 30
    assert sum(dc.BUDGETS["dry-run"].values()) <= dc.TOTAL_BUDGET_S["dry-run"]


def test_a_wheel_for_another_python_is_refused(tmp_path):
    """The review's failure: a cp311 megatron-core wheel that the H200 machine's Python
    3.12 cannot install. The script refuses it before any section runs."""
    wheels = tmp_path / "whl"
    wheels.mkdir()
    (wheels / "megatron_core-0.16.1-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    (wheels / "math_verify-0.9.0-py3-none-any.whl").write_bytes(b"")
    proc = _script("--dry-run", tmp_path / "out", DEVICE_CHECK_WHEELS=str(wheels))
    assert proc.returncode != 0
    assert "not a wheel for CPython 3.12" in proc.stdout + proc.stderr
    assert not (tmp_path / "out" / dc.JSON_NAME).exists()


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_cpu_full_run_passes(tmp_path, monkeypatch):
    """Every section on CPU with tiny sizes: Megatron and SDPA vs HF (gloo), GPS store.read
    in a singleton MPI world, the live run under mpirun stopped by SIGTERM mid-generation,
    its checkpoint (in-flight sequences) and the resume."""
    monkeypatch.setenv("OUT", str(tmp_path))
    rc = dc.main(["--cpu-full"])
    report = json.loads((tmp_path / dc.JSON_NAME).read_text())
    sections = report["sections"]
    assert rc == 0, {n: r.get("summary") for n, r in sections.items()}
    assert report["mode"] == "cpu-full"
    assert sections["megatron"]["sdpa_fp32_logits_max_diff"] <= 1e-3
    assert sections["gps"]["store_read"]["bytes_equal"]
    live = sections["live"]
    assert live["rc"] == 3 and live["rollout_tokens_per_s"] > 0 and live["reward_tokens_per_s"] > 0
    assert {"up rollout", "up reward", "up training"} <= set(live["shift_phases"])
    assert live["gps_read_gbps_rollout"]["median"] > 0
    ckpt = sections["checkpoint"]
    assert ckpt["ok"] and ckpt["in_flight_sequences"] > 0 and ckpt["rc"] == 0


# --------------------------------------------------------------------- on a CUDA device
def _section(name: str, mode: str = "small", timeout: float = 300) -> dict:
    log = Path(os.environ["OUT"]) / dc.LOG_NAME if os.environ.get("OUT") else None
    out = dc.run_section(name, mode=mode, timeout=timeout, log_file=log)
    assert out["status"] in ("pass", "skip"), out.get("summary")
    return out


@needs_cuda
def test_megatron_and_sdpa_on_cuda_match_hf():
    r = _section("megatron")
    assert r["backend"] == "nccl" and r["param_device"].startswith("cuda")
    assert r["fp32_logits_max_diff"] <= 1e-3 and r["fp32_logprob_max_diff"] <= 1e-3
    assert r["sdpa_fp32_logits_max_diff"] <= 1e-3 and r["sdpa_fp32_logprob_max_diff"] <= 1e-3
    assert r["bf16_param_dtype"] == "torch.bfloat16" and r["offload_all_pinned"]


@needs_cuda
def test_gps_read_into_vram_reads_the_same_bytes():
    r = _section("gps")
    c, s = r["copy"], r["store_read"]
    assert c["registered"] and c["bytes_equal"]
    assert all(c[f"tp{tp}"]["bytes_equal"] for tp in (1, 2, 8))
    assert s["bytes_equal"] and s["on_device"].startswith("cuda")


@needs_cuda
def test_hf_engine_generates_on_cuda():
    r = _section("hf")
    assert all(run["tokens_per_s"] > 0 for run in r["runs"])


@needs_cuda
def test_memory_plan_against_a_measured_training_step():
    """`pivot-hpc plan`'s training figures against real Megatron steps (device sizes):
    the allocator-side plan bounds the measured peak from above, not far off."""
    log = Path(os.environ["OUT"]) / dc.LOG_NAME if os.environ.get("OUT") else None
    r = dc.run_section("memplan", mode="device", timeout=300, log_file=log)
    assert r["status"] in ("pass", "fail"), r.get("summary")
    for c in r["cases"]:
        assert 0.7 <= c["ratio_allocated"] <= 1.15, c


@needs_cuda
def test_live_run_checkpoint_and_resume_on_cuda(tmp_path):
    log = Path(os.environ["OUT"]) / dc.LOG_NAME if os.environ.get("OUT") else None
    live = dc.run_section("live", mode="device", timeout=600, work=tmp_path, log_file=log)
    assert live["status"] == "pass", live.get("summary")
    assert live["gps_read_gbps_rollout"]["into"] == "VRAM"
    ckpt = dc.run_section("checkpoint", mode="device", timeout=400, work=tmp_path, log_file=log)
    assert ckpt["status"] == "pass", ckpt.get("summary")
