"""`pivot-hpc profile`: fit the throughput-model constants (A, B, C, D) of an engine + model,
and its prefill cost per prompt token (`prefill_s_per_token`, the planner's re-prefill cost).

Writes <out>/hf-<model>.yaml (default out: $PIVOT_HPC_CACHE/profiles or
~/.cache/pivot_hpc/profiles). Use it in a run config with
    engines.rollout.throughput_profile: <that file>
or copy the printed `--set` overrides into `rollout.throughput.*`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pivot_hpc.progress import Progress


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--engine",
        default="hf",
        choices=["hf", "vllm"],
        help="inference engine (vllm: one vLLM engine in this process, sized for the grid)",
    )
    p.add_argument(
        "--model",
        default="policy",
        choices=["policy", "genrm", "random"],
        help="cached tiny policy / GenRM (built if absent) or a random model of the policy's size",
    )
    p.add_argument("--role", default="rollout", choices=["rollout", "reward"])
    p.add_argument("--batch-sizes", type=_ints, default=[1, 2, 4, 8, 16, 32, 64, 128])
    p.add_argument("--context-lens", type=_ints, default=[16, 64, 128, 256, 384])
    p.add_argument("--steps", type=int, default=7, help="decode steps timed per grid point")
    p.add_argument(
        "--prefill-batches",
        type=_ints,
        default=[1, 4],
        help="batch sizes of the prefill timings (at most the largest --batch-sizes)",
    )
    p.add_argument(
        "--prefill-lens",
        type=_ints,
        default=None,
        help="prompt lengths of the prefill timings (default: --context-lens; at most their "
        "largest); an empty list skips the prefill measurement",
    )
    p.add_argument("--prefill-repeats", type=int, default=3, help="timed batches per point")
    p.add_argument("--threads", type=int, default=1, help="torch threads (workers use 1)")
    p.add_argument("--out", type=Path, default=None, help="directory for the profile YAML")
    p.add_argument("--cache-dir", type=Path, default=None, help="model cache directory")
    p.add_argument("--json", action="store_true", help="print one JSON object only")


def run(args: argparse.Namespace) -> int:
    import torch

    from pivot_hpc.engines.profile import fit_samples, prefill_sweep, sweep, write_profile
    from pivot_hpc.models.config import ModelsConfig, cache_root
    from pivot_hpc.models.qwen2 import create_model
    from pivot_hpc.models.zoo import load_model
    from pivot_hpc.recipes.tiny_models import ensure_model

    torch.set_num_threads(args.threads)
    mcfg = ModelsConfig(cache_dir=args.cache_dir)
    if args.model == "random":
        model, name = create_model(mcfg.policy.arch, seed=0), "random"
    else:
        path = ensure_model(mcfg, args.model, progress=not args.json)
        model, _ = load_model(path)
        name = path.name
    factory, vllm = None, None
    if args.engine == "vllm":
        vllm = _start_vllm(args, model, path if args.model != "random" else None)
        factory = lambda max_batch, kv, max_len: vllm  # noqa: E731 (one engine, every point)
    # the prefill grid fits the engine the decode grid sized (one vLLM engine for both)
    lens = args.context_lens if args.prefill_lens is None else args.prefill_lens
    lens = sorted({n for n in lens if 0 < n <= max(args.context_lens)})
    batches = sorted({b for b in args.prefill_batches if 0 < b <= max(args.batch_sizes)})
    prefill_points = len(lens) * len(batches)
    points = len(args.batch_sizes) * len(args.context_lens) + prefill_points
    with Progress(points, "profile", unit="grid points", enabled=not args.json) as bar:
        samples = sweep(
            model,
            args.batch_sizes,
            args.context_lens,
            steps=args.steps,
            progress=lambda k, n: bar.update(1),
            engine_factory=factory,
        )
        prefill = (
            prefill_sweep(
                model,
                batches,
                lens,
                repeats=args.prefill_repeats,
                progress=lambda k, n: bar.update(1),
                engine_factory=factory,
            )
            if prefill_points
            else None
        )
    if vllm is not None:
        vllm.close()
    result = fit_samples(samples, prefill)
    out_dir = args.out or cache_root(args.cache_dir) / "profiles"
    path = write_profile(
        out_dir / f"{args.engine}-{name}.yaml",
        result,
        engine=args.engine,
        model=name,
        role=args.role,
    )
    m = result.fit.model
    summary = {
        "profile": str(path),
        "engine": args.engine,
        "model": name,
        "A": m.A,
        "B": m.B,
        "C": m.C,
        "D": m.D,
        "r2": result.fit.r2,
        "median_rel_error": result.fit.median_rel_error,
        "held_out_r2": result.held_out.r2,
        "held_out_median_rel_error": result.held_out.median_rel_error,
        "samples": len(samples),
        "prefill_s_per_token": result.prefill.s_per_token if result.prefill else None,
        "prefill_intercept_s": result.prefill.intercept_s if result.prefill else None,
        "prefill_r2": result.prefill.r2 if result.prefill else None,
    }
    if args.json:
        print(json.dumps(summary, sort_keys=True))
        return 0
    print(f"fit ({result.fit.samples} points):      {result.fit.summary()}")
    print(
        f"held out ({result.held_out.samples} points): R²={result.held_out.r2:.4f}  "
        f"median rel. error={result.held_out.median_rel_error * 100:.2f}%"
    )
    if result.prefill is not None:
        p = result.prefill
        print(
            f"prefill ({p.samples} points): {p.s_per_token:.4g} s/token "
            f"(+ {p.intercept_s:.4g} s per batch, not used)  R²={p.r2:.4f}"
        )
    print(f"wrote {path}")
    print(
        f"use: engines.{args.role}.throughput_profile={path}   or   "
        + " ".join(f"{args.role}.throughput.{k}={v:.6g}" for k, v in m.as_dict().items())
        + (
            f" {args.role}.throughput.prefill_s_per_token={result.prefill.s_per_token:.6g}"
            if result.prefill is not None
            else ""
        )
    )
    return 0


def _start_vllm(args: argparse.Namespace, model, model_dir: Path | None):
    """One vLLM engine for the whole sweep (a start per grid point would dominate it),
    sized for the largest batch and context; every point gets it back, emptied."""
    import tempfile

    from pivot_hpc.engines.config import InferenceEngineConfig
    from pivot_hpc.engines.profile import WARMUP_STEPS
    from pivot_hpc.engines.vllm.launch import make_vllm_engine

    if model_dir is None:  # the random model: vLLM loads directories only
        from pivot_hpc.models.tokenizer import build_tokenizer

        model_dir = Path(tempfile.mkdtemp(prefix="pivot-profile-"))
        model.save_pretrained(model_dir)
        build_tokenizer().save_pretrained(model_dir)
    b, c = max(args.batch_sizes), max(args.context_lens) + args.steps + WARMUP_STEPS + 4
    ec = InferenceEngineConfig(
        engine="vllm", max_batch=b, max_seq_len=c, prefill_chunk_tokens=4096,
        num_threads=args.threads,
    )  # fmt: skip
    return make_vllm_engine(ec, model_dir, role=args.role, tp=1, kv_capacity_tokens=b * c, seed=0)
