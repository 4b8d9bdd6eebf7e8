"""`pivot-hpc bench engine`: `hf` engine tokens/s vs `transformers` generate, same model.

For each batch size: the same random prompts through `model.generate` (greedy, no EOS
stop, KV cache) and through the continuous-batching engine (greedy, ignore_eos), each
producing exactly `--new-tokens` tokens per sequence, in one process with the same torch
thread count. Reports both rates, their ratio, and whether the token ids agree.
"""

from __future__ import annotations

import argparse
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


def _timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def run(args: argparse.Namespace) -> dict:
    from pivot_hpc.engines.base import SamplingParams
    from pivot_hpc.engines.hf_engine import HFEngine, generate_all
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
    out = {
        "batch": results,
        "ratio_batch64": results["64"]["ratio"] if "64" in results else None,
        "new_tokens": n,
        "prompt_len": args.prompt_len,
        "threads": args.threads,
        "model": {"hidden": arch.hidden_size, "layers": arch.num_layers, "vocab": arch.vocab_size},
    }
    if not args.json:
        rows = [["batch", "engine tok/s", "generate tok/s", "ratio", "same tokens"]]
        for b, r in results.items():
            rows.append(
                [
                    b,
                    f"{r['tokens_per_s']:.0f}",
                    f"{r['hf_generate_tokens_per_s']:.0f}",
                    f"{r['ratio']:.2f}x",
                    str(r["outputs_match"]),
                ]
            )
        print(f"hf engine vs transformers generate ({n} new tokens, {args.threads} thread)")
        print(table(rows))
    return out
