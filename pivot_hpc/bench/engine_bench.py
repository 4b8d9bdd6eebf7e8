"""`pivot-hpc bench engine`: `hf` engine and vLLM tokens/s vs `transformers` generate.

For each batch size: the same random prompts through `model.generate` (greedy, no EOS
stop, KV cache), through the continuous-batching `hf` engine and through the `vllm` engine
(vLLM's CPU build in this process, one engine for every batch size; its start is timed on
its own), each producing exactly `--new-tokens` tokens per sequence (greedy, ignore_eos),
in one process with the same torch thread count. Reports the rates, the ratios, and
whether the token ids agree. Without vLLM installed (or with `--no-vllm`) the vLLM keys
are null and `vllm_skipped` says why.
"""

from __future__ import annotations

import argparse
import shutil
import time

import torch

from pivot_hpc.bench.stats import table


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-sizes", type=_ints, default=[1, 8, 64])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--repeat", type=int, default=3, help="best of N runs per side")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-vllm", action="store_true", help="leave the vllm engine out")


def _timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def run(args: argparse.Namespace) -> dict:
    from pivot_hpc.engines.base import SamplingParams
    from pivot_hpc.engines.hf.engine import HFEngine, generate_all
    from pivot_hpc.models.config import ModelConfig
    from pivot_hpc.models.qwen2 import create_model

    torch.set_num_threads(args.threads)
    arch = ModelConfig(initializer_range=0.3)  # the default policy's size
    model = create_model(arch, seed=args.seed)
    g = torch.Generator().manual_seed(args.seed)
    n = args.new_tokens
    gen_cfg = model.generation_config
    gen_cfg.eos_token_id = None  # both sides produce exactly n tokens
    results: dict[str, dict] = {}
    vllm, vllm_info = _start_vllm(args, model, arch)
    for b in args.batch_sizes:
        prompts = torch.randint(3, 99, (b, args.prompt_len), generator=g)
        mask = torch.ones_like(prompts)

        def hf_generate(prompts=prompts, mask=mask):
            with torch.no_grad():
                return model.generate(
                    prompts,
                    attention_mask=mask,
                    max_new_tokens=n,
                    do_sample=False,
                    generation_config=gen_cfg,
                    pad_token_id=0,
                )

        def engine_run(prompts=prompts, b=b):
            e = HFEngine(model, num_threads=None, max_batch=max(b, 1))
            sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            return generate_all(e, prompts.tolist(), sp)

        t_gen, ref = min((_timed(hf_generate) for _ in range(args.repeat)), key=lambda x: x[0])
        t_eng, res = min((_timed(engine_run) for _ in range(args.repeat)), key=lambda x: x[0])
        same = all(r.token_ids == ref[i, args.prompt_len :].tolist() for i, r in enumerate(res))
        results[str(b)] = {
            "tokens_per_s": b * n / t_eng,
            "hf_generate_tokens_per_s": b * n / t_gen,
            "ratio": t_gen / t_eng,
            "tokens": b * n,
            "outputs_match": same,
        }
        if vllm is not None:

            def vllm_run(prompts=prompts):
                sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                return generate_all(vllm, prompts.tolist(), sp)

            t_v, res_v = min((_timed(vllm_run) for _ in range(args.repeat)), key=lambda x: x[0])
            results[str(b)]["vllm_tokens_per_s"] = b * n / t_v
            results[str(b)]["vllm_outputs_match"] = all(
                r.token_ids == ref[i, args.prompt_len :].tolist() for i, r in enumerate(res_v)
            )
    if vllm is not None:
        vllm.close()
        shutil.rmtree(vllm_info.pop("vllm_model_dir"), ignore_errors=True)
    out = {
        "batch": results,
        "ratio_batch64": results["64"]["ratio"] if "64" in results else None,
        "new_tokens": n,
        "prompt_len": args.prompt_len,
        "threads": args.threads,
        "model": {"hidden": arch.hidden_size, "layers": arch.num_layers, "vocab": arch.vocab_size},
        **vllm_info,
    }
    for b in args.batch_sizes:
        out[f"vllm_tokens_per_s_batch{b}"] = results[str(b)].get("vllm_tokens_per_s")
    if "64" in results and vllm is not None:
        out["ratio_vllm_vs_hf_batch64"] = (
            results["64"]["vllm_tokens_per_s"] / results["64"]["tokens_per_s"]
        )
    else:
        out["ratio_vllm_vs_hf_batch64"] = None
    if not args.json:
        rows = [["batch", "hf tok/s", "vllm tok/s", "generate tok/s", "hf/gen", "same tokens"]]
        for b, r in results.items():
            v = r.get("vllm_tokens_per_s")
            rows.append(
                [
                    b,
                    f"{r['tokens_per_s']:.0f}",
                    "-" if v is None else f"{v:.0f}",
                    f"{r['hf_generate_tokens_per_s']:.0f}",
                    f"{r['ratio']:.2f}x",
                    str(r["outputs_match"] and r.get("vllm_outputs_match", True)),
                ]
            )
        print(f"hf engine, vllm, transformers generate ({n} new tokens, {args.threads} thread)")
        print(table(rows))
        if vllm_info["vllm_skipped"]:
            print(f"vllm: skipped ({vllm_info['vllm_skipped']})")
        else:
            print(
                f"vllm: import {vllm_info['vllm_import_s']:.1f}s, "
                f"engine start {vllm_info['vllm_startup_s']:.1f}s"
            )
    return out


def _start_vllm(args: argparse.Namespace, model, arch) -> tuple[object | None, dict]:
    """The `vllm` engine over `model` (saved to a temporary directory: vLLM loads
    directories), sized for the largest batch; (None, why) when it cannot run here."""
    info: dict = {"vllm_import_s": None, "vllm_startup_s": None, "vllm_skipped": None}
    if args.no_vllm:
        info["vllm_skipped"] = "--no-vllm"
        return None, info
    import tempfile

    from pivot_hpc.engines.config import InferenceEngineConfig
    from pivot_hpc.engines.vllm.engine import load_vllm_api
    from pivot_hpc.engines.vllm.launch import check_installed, make_vllm_engine
    from pivot_hpc.errors import PivotError
    from pivot_hpc.models.tokenizer import build_tokenizer

    try:
        check_installed("bench engine")
    except PivotError as exc:
        info["vllm_skipped"] = str(exc)
        return None, info
    t0 = time.perf_counter()
    api = load_vllm_api("bench engine")
    info["vllm_import_s"] = time.perf_counter() - t0
    d = tempfile.mkdtemp(prefix="pivot-bench-vllm-")
    model.save_pretrained(d)
    build_tokenizer().save_pretrained(d)
    b = max(args.batch_sizes)
    per_seq = args.prompt_len + args.new_tokens + 1
    ec = InferenceEngineConfig(
        engine="vllm",
        max_batch=b,
        max_seq_len=min(arch.max_position_embeddings, per_seq + 31),
        num_threads=args.threads,
    )
    t0 = time.perf_counter()
    engine = make_vllm_engine(
        ec, d, role="rollout", tp=1, kv_capacity_tokens=b * (per_seq + 32), seed=args.seed, api=api
    )
    info["vllm_startup_s"] = time.perf_counter() - t0
    return engine, {**info, "vllm_model_dir": d}
