"""Profiling an inference engine: fit the throughput model constants (A, B, C, D).

Sweep (batch size N_seq × context length): fill a fresh engine with N_seq sequences of
that context, then time several decode steps; one sample per grid point is the median
step latency with its N_seq and N_tok (tokens in the KV cache during the step). Every
4th grid point (a checkerboard over the grid) is held out; the fit uses the rest, and
the report gives R² and the median relative error on both. Result: a small YAML file
that `load_profile` / `apply_profiles` put into `rollout.throughput` / `reward.throughput`.

Prefill (`prefill_sweep`, `fit_prefill`): batches of fresh random prompts of a few lengths,
each one token long (`max_tokens=1`), timed over the engine steps that admit, prefill and
finish them. A least-squares line latency = s·tokens + c (tokens = batch × prompt length)
gives `prefill_s_per_token` = s, the planner's cost of prefilling one token; the intercept
c (per-batch overhead, first-token sampling) is reported beside it, not used.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from pivot_hpc.engines.base import InferenceEngine, SamplingParams
from pivot_hpc.engines.hf.engine import HFEngine
from pivot_hpc.scheduler.config import ThroughputConfig
from pivot_hpc.scheduler.throughput import FitReport, evaluate_fit, fit_throughput_model

# engine steps a batch may take to prefill (chunked) before its decode steps are timed
WARMUP_STEPS = 64


@dataclass(slots=True)
class Sample:
    latency_s: float
    n_seq: int
    n_tok: int
    held_out: bool


@dataclass(slots=True)
class PrefillSample:
    latency_s: float  # admit + prefill + first token of the whole batch
    n_seq: int
    prompt_len: int

    @property
    def tokens(self) -> int:
        return self.n_seq * self.prompt_len


@dataclass(slots=True)
class PrefillFit:
    s_per_token: float  # slope: seconds per prompt token
    intercept_s: float  # seconds per batch, whatever its tokens (not used by the planner)
    r2: float
    samples: int


@dataclass(slots=True)
class ProfileResult:
    fit: FitReport  # on the fitting points
    held_out: FitReport  # the same model on the held-out points
    samples: list[Sample]
    prefill: PrefillFit | None = None  # None: prefill not measured
    prefill_samples: list[PrefillSample] = dataclasses.field(default_factory=list)


def _engine(model, factory, num_threads, max_batch: int, kv: int, max_len: int):
    if factory is not None:
        return factory(max_batch, kv, max_len)
    return HFEngine(
        model, kv_capacity_tokens=kv, max_batch=max_batch, max_seq_len=max_len,
        num_threads=num_threads,
    )  # fmt: skip


def sweep(
    model,
    batch_sizes: list[int],
    context_lens: list[int],
    steps: int = 5,
    seed: int = 0,
    progress=None,
    num_threads: int | None = None,
    engine_factory: Callable[[int, int, int], InferenceEngine] | None = None,
) -> list[Sample]:
    """`engine_factory(max_batch, kv_capacity_tokens, max_seq_len)`: the engine of a grid
    point (default: a fresh `hf` engine over `model`; `pivot-hpc profile --engine vllm`
    passes one vLLM engine for every point, sized for the largest). `model` gives the
    vocabulary the random prompts are drawn from."""
    g = torch.Generator().manual_seed(seed)
    vocab = min(model.config.vocab_size, 99)
    out: list[Sample] = []
    grid = [(b, c) for b in batch_sizes for c in context_lens]
    for k, (b, c) in enumerate(grid):
        i, j = batch_sizes.index(b), context_lens.index(c)
        kv, max_len = b * (c + steps + WARMUP_STEPS + 4), c + steps + WARMUP_STEPS + 4
        engine = _engine(model, engine_factory, num_threads, b, kv, max_len)
        sp = SamplingParams(temperature=0.0, max_tokens=steps + WARMUP_STEPS, ignore_eos=True)
        for s in range(b):
            engine.add(s, torch.randint(3, vocab, (c,), generator=g).tolist(), sampling=sp)
        # prefill (chunked: a large batch needs several steps) + a first decode that warms
        # the KV buffers
        for _ in range(WARMUP_STEPS):
            engine.step()
            if engine.stats().running >= b:
                break
        lat, tok = [], []
        for _ in range(steps):
            st = engine.stats()
            if st.running < b:
                break
            tok.append(st.tokens_in_cache + st.running)  # K/V read during the step
            engine.step()
            lat.append(engine.stats().last_step_s)
        engine.abort_all()
        out.append(Sample(statistics.median(lat), b, int(statistics.median(tok)), (i + j) % 4 == 3))
        if progress is not None:
            progress(k + 1, len(grid))
    return out


def prefill_sweep(
    model,
    batch_sizes: list[int],
    prompt_lens: list[int],
    repeats: int = 3,
    seed: int = 1,
    progress=None,
    num_threads: int | None = None,
    engine_factory: Callable[[int, int, int], InferenceEngine] | None = None,
) -> list[PrefillSample]:
    """One sample per (batch size, prompt length): the median over `repeats` batches of
    fresh random prompts (no prefix-cache hits) of the wall time of the engine steps from
    their `add` until every one of them finished with its first token. A fresh engine per
    point (`engine_factory` as in `sweep`), warmed by one untimed batch first."""
    g = torch.Generator().manual_seed(seed)
    vocab = min(model.config.vocab_size, 99)
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    out: list[PrefillSample] = []
    grid = [(b, n) for b in batch_sizes for n in prompt_lens]
    for k, (b, n) in enumerate(grid):
        max_len = n + 2
        engine = _engine(model, engine_factory, num_threads, b, b * max_len, max_len)
        lat = []
        for r in range(repeats + 1):
            for s in range(b):
                engine.add(
                    r * b + s, torch.randint(3, vocab, (n,), generator=g).tolist(), sampling=sp
                )
            t0 = time.perf_counter()
            for _ in range(WARMUP_STEPS):
                engine.step()
                if not engine.has_unfinished():
                    break
            dt = time.perf_counter() - t0
            engine.abort_all()
            if r:  # the first batch warms the engine's buffers
                lat.append(dt)
        out.append(PrefillSample(statistics.median(lat), b, n))
        if progress is not None:
            progress(k + 1, len(grid))
    return out


def fit_prefill(samples: list[PrefillSample]) -> PrefillFit:
    """Least squares latency = s·tokens + c with s, c >= 0 (a negative intercept refits
    through the origin; a negative slope, only from noise, is 0)."""
    x = [float(p.tokens) for p in samples]
    y = [p.latency_s for p in samples]
    n = len(x)
    if n == 0:
        raise ValueError("fit_prefill: no samples")
    mx, my = sum(x) / n, sum(y) / n
    sxx = sum((a - mx) ** 2 for a in x)
    s = sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True)) / sxx if sxx > 0 else 0.0
    c = my - s * mx
    if c < 0 or sxx <= 0:  # through the origin
        c = 0.0
        sq = sum(a * a for a in x)
        s = sum(a * b for a, b in zip(x, y, strict=True)) / sq if sq > 0 else 0.0
    if s < 0:
        s, c = 0.0, max(my, 0.0)
    ss_res = sum((b - (s * a + c)) ** 2 for a, b in zip(x, y, strict=True))
    ss_tot = sum((b - my) ** 2 for b in y)
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
    return PrefillFit(s_per_token=s, intercept_s=c, r2=r2, samples=n)


def fit_samples(samples: list[Sample], prefill: list[PrefillSample] | None = None) -> ProfileResult:
    train = [s for s in samples if not s.held_out]
    test = [s for s in samples if s.held_out] or train
    fit = fit_throughput_model(
        [s.latency_s for s in train], [s.n_seq for s in train], [s.n_tok for s in train]
    )
    held = evaluate_fit(
        fit.model, [s.latency_s for s in test], [s.n_seq for s in test], [s.n_tok for s in test]
    )
    return ProfileResult(
        fit=fit,
        held_out=held,
        samples=samples,
        prefill=fit_prefill(prefill) if prefill else None,
        prefill_samples=list(prefill or []),
    )


def write_profile(path: Path, result: ProfileResult, *, engine: str, model: str, role: str) -> Path:
    m = result.fit.model
    doc = {
        "engine": engine,
        "model": model,
        "role": role,
        "throughput": {"A": m.A, "B": m.B, "C": m.C, "D": m.D},
        "fit": {
            "r2": result.fit.r2,
            "median_rel_error": result.fit.median_rel_error,
            "held_out_r2": result.held_out.r2,
            "held_out_median_rel_error": result.held_out.median_rel_error,
            "samples": result.fit.samples,
            "held_out_samples": result.held_out.samples,
        },
        "samples": [
            {"latency_s": s.latency_s, "n_seq": s.n_seq, "n_tok": s.n_tok, "held_out": s.held_out}
            for s in result.samples
        ],
    }
    if result.prefill is not None:  # absent: prefill not measured (profiles before it)
        p = result.prefill
        doc["prefill_s_per_token"] = p.s_per_token
        doc["prefill_fit"] = {"intercept_s": p.intercept_s, "r2": p.r2, "samples": p.samples}
        doc["prefill_samples"] = [
            {"latency_s": s.latency_s, "n_seq": s.n_seq, "prompt_len": s.prompt_len}
            for s in result.prefill_samples
        ]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(doc, sort_keys=False))
    tmp.replace(path)
    return path


def load_profile(path: str | Path) -> ThroughputConfig:
    """The fitted constants of a profile file, as a role's `throughput` config section
    (`prefill_s_per_token` None where the file has none: a profile from before it)."""
    from pivot_hpc.config.loader import ConfigError, load_yaml_text, read_yaml_file

    source = f"throughput profile {str(path)!r}"
    doc = load_yaml_text(read_yaml_file(path, source), source)  # no aliases, bounded
    t = doc.get("throughput") if isinstance(doc, dict) else None
    try:
        tc = ThroughputConfig(A=float(t["A"]), B=float(t["B"]), C=float(t["C"]), D=float(t["D"]))
    except (TypeError, KeyError, ValueError, OverflowError):
        raise ConfigError(
            f"{source}: needs a 'throughput' mapping with numbers A, B, C and D; write it "
            "with `pivot-hpc profile`"
        ) from None
    p = doc.get("prefill_s_per_token")
    if p is not None:
        try:
            if isinstance(p, bool):
                raise TypeError
            tc.prefill_s_per_token = float(p)
        except (TypeError, ValueError, OverflowError):
            raise ConfigError(f"{source}: prefill_s_per_token must be a number") from None
    tc.validate(f"{path}:throughput")
    return tc


def apply_profiles(cfg):
    """`cfg` with `rollout.throughput` / `reward.throughput` from the profile files named by
    `engines.<role>.throughput_profile` (a new config: the validated one is not changed)."""
    for role in ("rollout", "reward"):
        prof = getattr(cfg.engines, role).throughput_profile
        if prof is not None:
            section = dataclasses.replace(getattr(cfg, role), throughput=load_profile(prof))
            cfg = dataclasses.replace(cfg, **{role: section})
    return cfg
